"""The tables of ``benchmarks/bench_paired.py``: its saved processes read back, each option priced with
this code (``reprice``), their rows, per-process tables and the summary over every machine's processes,
and the fit of offload's overhead rates to them. No GPU: every function here reads saved records.

    python benchmarks/bench_paired.py --table DIR ...      # rows, per-process tables, summary
    python benchmarks/bench_paired.py --summary DIR ...    # the summary alone, with each error's interval
                                                           # (docs/offload-h200/paired_every.md)
    python benchmarks/bench_paired.py --fit DIR ...        # estimate.offload_ms_per_group and _per_gib
"""

from __future__ import annotations

import gzip
import json
import os
import random
import statistics


def price(cfg: dict, module_times: dict, link_gb_s: float | None) -> dict:
    """The planner's price of ``cfg`` (replays and copies together, ms) on a pass's module times."""
    from recipes.analyze.plan import price_config, rates

    tflops, link = rates(cfg, None, link_gb_s)
    # priced for a GPU, as the planner prices; a CPU test's emulated copies stand for its copies
    p = price_config({**cfg, "offload": {**cfg["offload"], "emulate_on_cpu": False}}, tflops, link, module_times)
    return {"priced_ms": p["cost_s"] * 1e3, "priced_recompute_ms": p["recompute_s"] * 1e3,
            "priced_stall_ms": p["offload_stall_s"] * 1e3, "priced_overhead_ms": p["offload_overhead_s"] * 1e3,
            "priced_copy_ms": p["offload_copy_s"] * 1e3}


def error(priced: float, added: float) -> str:
    return f"{(priced - added) / added:+.0%}" if added > 1e-9 else "-"


def load(path: str) -> list[dict]:
    """A saved process (``--save``): its options' results, raw steps and module times."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def reprice(r: dict) -> dict:
    """A saved option's price from its module times with this code: ``priced_ms`` (and its parts) from
    the first pass (what a sweep's base point records), ``passes_ms`` from each."""
    passes = [price(r["raw"]["cfg"], mt, r.get("link_gb_s")) for mt in r["raw"]["module_times"]]
    return {**r, **passes[0], "passes_ms": [p["priced_ms"] for p in passes]}


ROW_HEADER = ("| process | option | off ms | on ms | added ms (middle half) | host added ms | priced ms "
              "| price vs added | priced on | host pass ms |\n|---|---|---|---|---|---|---|---|---|---|")


def row(n: int, r: dict) -> str:
    lo, hi = r["added_iqr_ms"]
    host = f"{r['host_pass_ms']:.1f}" if r["host_pass_ms"] is not None else "-"
    host_added = f"{r['host_added_ms']:+.1f}" if r.get("host_added_ms") is not None else "-"
    return (f"| {n} | {r['option']} | {r['off_ms']:.1f} | {r['on_ms']:.1f} | {r['added_ms']:+.1f} "
            f"({lo:+.1f} to {hi:+.1f}) | {host_added} | {r['priced_ms']:+.1f} | {error(r['priced_ms'], r['added_ms'])} "
            f"| {r['priced_on']} | {host} |")


def _table(header: str, lines: list[str]) -> list[str]:
    """A table's lines, a blank line after; none where no process recorded what it shows."""
    return [header, *lines, ""] if lines else []


def _each_way(rows: list[tuple[int, dict]], key: str):
    """The processes whose option recorded ``key``, a measurement with the option on and switched off:
    (process number, result, on, off, the whole record)."""
    for n, r in rows:
        if r.get(key):
            yield n, r, r[key]["on"], r[key]["off"], r[key]


COPY_HEADER = ("| process | option | link GB/s | copies ms (priced) | stall ms (priced) | reload waits ms (measured) "
               "| overhead ms (priced) | exposed ms (profiled step) | added ms | cudaMalloc, cudaFree a step: on / off |\n"
               "|---|---|---|---|---|---|---|---|---|---|")


def copy_rows(rows: list[tuple[int, dict]]) -> list[str]:
    """The offload options' copies: the price's parts beside what was measured: the time compute waited
    for reloads in an unprofiled step (``CopyTimeline``, beside the priced stall), and the profiled
    step's exposed copy time."""
    out = []
    for n, r in rows:
        if r.get("priced_copy_ms"):
            link = f"{r['link_gb_s']:.1f}" if r.get("link_gb_s") else "-"
            exposed = f"{r['exposed_ms']:.1f}" if r.get("exposed_ms") is not None else "-"
            calls = [[statistics.median(c[i] for c in r["raw"][k]) for i in (0, 1)] if r["raw"].get(k) else None
                     for k in ("on_allocs", "off_allocs")]
            calls = " / ".join(f"{c[0]:g}, {c[1]:g}" for c in calls) if all(calls) else "-"  # not recorded before 20:55
            waited = f"{r['reload_wait_ms']:.1f}" if r.get("reload_wait_ms") is not None else "-"  # saved before it: -
            out.append(f"| {n} | {r['option']} | {link} | {r['priced_copy_ms']:.1f} | {r['priced_stall_ms']:.1f} "
                       f"| {waited} | {r['priced_overhead_ms']:.1f} | {exposed} | {r['added_ms']:+.1f} | {calls} |")
    return _table(COPY_HEADER, out)


STEP_COPY_HEADER = ("| process | option | link GB/s (copies alone) | out GB/s (in the step) | back GB/s (in the step) "
                    "| reload waits ms | the longest waits: point, wait number, ms | strided tensors copied out |"
                    "\n|---|---|---|---|---|---|---|---|")


def step_copy_rows(rows: list[tuple[int, dict]]) -> list[str]:
    """Where a process timed its copies on the step's clock (``CopyTimeline``): the rate each direction
    ran at inside the step against the link's rate alone, and the three longest waits for a reload."""
    out = []
    for n, r in rows:
        copies, spans = r.get("copies"), (r.get("raw") or {}).get("copy_timeline")
        if not copies or not spans:
            continue
        waits = [(name, i, b - a) for i, (_, name, _, a, b) in enumerate(s for s in spans if s[0] == "wait")]
        longest = ", ".join(f"{name} #{i} {ms:.1f}" for name, i, ms in sorted(waits, key=lambda w: -w[2])[:3])
        rate = [f"{copies[k]:.1f}" if copies.get(k) else "-" for k in ("d2h_gb_s", "h2d_gb_s")]
        link = f"{r['link_gb_s']:.1f}" if r.get("link_gb_s") else "-"
        strided = r.get("strided_out")  # not in older records: -
        strided = ", ".join(f"{k} {v}" for k, v in strided.items()) if strided is not None else "-"
        out.append(f"| {n} | {r['option']} | {link} | {rate[0]} | {rate[1]} | {r['reload_wait_ms']:.1f} | {longest} "
                   f"| {strided} |")
    return _table(STEP_COPY_HEADER, out)


GPU_HEADER = ("| process | option | added ms | kernels busy ms: on / off | kernels added ms | GPU idle ms: on / off "
              "| the kernels that grew most, ms |\n|---|---|---|---|---|---|---|")


def gpu_rows(rows: list[tuple[int, dict]]) -> list[str]:
    """Where a process profiled the GPU's side of its option (``gpu_work``): what its kernels added
    beside what its step added, and the GPU's idle time each way."""
    out = []
    for n, r, on, off, _ in _each_way(rows, "gpu_work"):
        before = {k["name"]: k["ms"] for k in off["kernels"]}
        grew = sorted(((k["ms"] - before.get(k["name"], 0.0), k["name"]) for k in on["kernels"]), reverse=True)[:2]
        grew = "; ".join(f"{name[:40]} {ms:+.1f}" for ms, name in grew if ms > 0.05) or "-"
        out.append(f"| {n} | {r['option']} | {r['added_ms']:+.1f} | {on['kernel_busy_ms']:.1f} / {off['kernel_busy_ms']:.1f} "
                   f"| {on['kernel_busy_ms'] - off['kernel_busy_ms']:+.1f} | {on['gpu_idle_ms']:.1f} / {off['gpu_idle_ms']:.1f} "
                   f"| {grew} |")
    return _table(GPU_HEADER, out)


CALLS_HEADER = ("| process | option | groups moved | tensors saved | manager ms: on / off | host added ms "
                "| per moved group: step / synthetic | most self ms: step (synthetic, per group) |"
                "\n|---|---|---|---|---|---|---|---|")


def calls_rows(rows: list[tuple[int, dict]]) -> list[str]:
    """Where a process timed its offload manager method by method (``manager_calls``): the host ms spent
    in it with the option on and off, the host's own step time they added, and per moved group the
    step's against the synthetic groups' the planner prices from, with the three methods that took most."""
    out = []
    for n, r, on, off, calls in _each_way(rows, "manager_calls"):
        syn = calls.get("synthetic")
        moved = on["methods"].get("ChunkOffloadHandler.bulk_offload_group", [0])[0]
        saved_ = on["methods"].get("ChunkOffloadHandler.tensor_push", [0])[0]
        per = (on["total_ms"] - off["total_ms"]) / moved if moved else None
        syn_moved = syn["methods"].get("ChunkOffloadHandler.bulk_offload_group", [0])[0] if syn else 0
        syn_per = syn["total_ms"] / syn_moved if syn_moved else None
        top = sorted(on["methods"].items(), key=lambda kv: -kv[1][1])[:3]
        syn_methods = (syn or {}).get("methods", {})
        shares = {k: f"{syn_methods[k][1] / syn_moved:.2f}" if k in syn_methods and syn_moved else "-" for k, _ in top}
        most = "; ".join(f"{k.split('.')[-1]} {v[1]:.1f} ({shares[k]})" for k, v in top)
        fmt = lambda x: f"{x:.2f}" if x is not None else "-"  # noqa: E731
        out.append(f"| {n} | {r['option']} | {moved} | {saved_} | {on['total_ms']:.1f} / {off['total_ms']:.1f} "
                   f"| {on['host_ms'] - off['host_ms']:+.1f} | {fmt(per)} / {fmt(syn_per)} | {most} |")
    return _table(CALLS_HEADER, out)


OPS_HEADER = ("| process | option | host added ms: paired steps / profiled | ops' self ms: on / off | GC ms: on / off "
              "(paired steps' median) | the ops whose host ms grew most: calls on / off, ms on / off |"
              "\n|---|---|---|---|---|---|")


def ops_rows(rows: list[tuple[int, dict]]) -> list[str]:
    """Where a process profiled its option's host side (``host_ops``): the operators' and CUDA calls'
    self host ms each way, the garbage collector's, and the four ops that grew most."""
    out = []
    for n, r, on, off, ops in _each_way(rows, "host_ops"):
        paired = [statistics.median(r["raw"][k]) if r["raw"].get(k) else None for k in ("on_gc_ms", "off_gc_ms")]
        gc_ = f"{on['gc_ms']:.1f} / {off['gc_ms']:.1f}" + (
            f" ({paired[0]:.1f} / {paired[1]:.1f})" if None not in paired else "")
        grew = "; ".join(f"{k[:32]} {a} / {b}, {x:.1f} / {y:.1f}" for k, a, b, x, y in ops["top"][:4])
        out.append(f"| {n} | {r['option']} | {r['host_added_ms']:+.1f} / {on['host_ms'] - off['host_ms']:+.1f} "
                   f"| {on['self_ms']:.1f} / {off['self_ms']:.1f} | {gc_} | {grew} |")
    return _table(OPS_HEADER, out)


def process_tables(numbered: list[tuple[int, dict]]) -> list[str]:
    """Every per-process table a run's processes recorded, in order (each absent where none did)."""
    return (copy_rows(numbered) + step_copy_rows(numbered) + calls_rows(numbered) + ops_rows(numbered)
            + gpu_rows(numbered))


def summary(rows: dict[tuple[str, str], list[dict]], interval: bool = False) -> list[str]:
    """Per (model, option): the processes' added ms and prices, their medians, and the median price
    of every module-time pass they recorded; with ``interval``, how far the price's error could lie
    given the spread between processes (``error_bounds``), and the count against the 20% target."""
    out = ["| model | option | processes | added ms, each | added, median | priced, median | vs added "
           "| priced, every pass: median | vs added |" + (" vs added, 90% of resamples |" if interval else ""),
           "|---|---|---|---|---|---|---|---|---|" + ("---|" if interval else "")]
    within, unresolved = 0, []
    for (model, option), rs in rows.items():
        added, priced = statistics.median(r["added_ms"] for r in rs), statistics.median(r["priced_ms"] for r in rs)
        every = statistics.median(p for r in rs for p in r.get("passes_ms") or [r["priced_ms"]])
        each = ", ".join(f"{r['added_ms']:+.1f}" for r in rs)
        line = (f"| {model} | {option} | {len(rs)} | {each} | {added:+.1f} | {priced:+.1f} | {error(priced, added)} "
                f"| {every:+.1f} | {error(every, added)} |")
        if not interval:
            out.append(line)
            continue
        bounds = error_bounds(rs)
        out.append(line + (f" {bounds[0]:+.0%} to {bounds[1]:+.0%} |" if bounds else " - |"))
        if abs(priced - added) <= TARGET * abs(added):
            within += 1
        elif bounds and bounds[0] <= TARGET and bounds[1] >= -TARGET:
            unresolved.append(f"{model} {option}")
    if interval:
        out += ["", f"Priced within {TARGET:.0%} of the added median: {within} of {len(rows)} options. Outside it, "
                f"with a spread between processes that reaches inside it: {', '.join(unresolved) or 'none'}."]
    return out


#: The price's target against the added median; ``error_bounds``' resamples (its generator is
#: seeded, so a table regenerates identically).
TARGET, RESAMPLES = 0.2, 2000


def error_bounds(rs: list[dict], resamples: int = RESAMPLES) -> tuple[float, float] | None:
    """The 5th and 95th percentiles of the priced median's error against the added median over the
    processes resampled with replacement (a bootstrap): what the processes' spread lets the error be.
    Where they reach inside the target, these processes cannot show that the price misses it. None
    for fewer than three processes (too few to resample) or an added median at zero."""
    if len(rs) < 3:
        return None
    rng = random.Random(0)
    errors = []
    for _ in range(resamples):
        pick = [rs[rng.randrange(len(rs))] for _ in rs]
        added = statistics.median(r["added_ms"] for r in pick)
        if added > 1e-9:
            errors.append(statistics.median(r["priced_ms"] for r in pick) / added - 1)
    if len(errors) < resamples // 2:
        return None
    errors.sort()
    return errors[len(errors) // 20], errors[(19 * len(errors)) // 20]


def pool(rows: dict[tuple[str, str], list[dict]], r: dict) -> None:
    """Add a measured option to the summary's rows, under its model family and option."""
    rows.setdefault((r["raw"]["cfg"]["model"]["family"], r["option"]), []).append(r)


def paired_figures(on: list[float], off: list[float], on_host: list[float], off_host: list[float]) -> dict:
    """An option's figures from its paired steps (ms): the median off and on step, the added ms (the
    median of the rounds' on-minus-off differences) with the middle half of them, and the host's."""
    added = sorted(a - b for a, b in zip(on, off))
    host = [a - b for a, b in zip(on_host, off_host)]
    return {"off_ms": statistics.median(off), "on_ms": statistics.median(on), "added_ms": statistics.median(added),
            "added_iqr_ms": [added[len(added) // 4], added[(3 * len(added)) // 4]],
            **({"host_added_ms": statistics.median(host)} if host else {})}


def settled(r: dict, rounds: int) -> dict:
    """A saved option's figures from its rounds after the first ``rounds`` after its module-time passes:
    the rounds it ran untimed (``settle_rounds``, in newer records) count, the rest of the
    first ``rounds`` are left out. Switching to the option after the passes (which run it switched
    off) costs the first rounds a transient the option does not cost a run (``by_round``)."""
    raw = r["raw"]
    drop = max(0, rounds - raw.get("settle_rounds", 0)) * (raw.get("run_length") or 1)
    if not drop:
        return r
    return {**r, **paired_figures(raw["on_ms"][drop:], raw["off_ms"][drop:], raw["on_host_ms"][drop:],
                                  raw["off_host_ms"][drop:])}


def saved(d: str, settle: int = 0) -> list[tuple[int, dict]]:
    """The options the processes saved under ``d`` measured, each with its process's number; with
    ``settle``, from their rounds after the first ``settle`` (``settled``)."""
    files = sorted(f for f in os.listdir(d) if f.startswith("process-") and f.endswith(".json.gz"))  # not traces
    return [(int(f.split("-")[1].split(".")[0]), settled(r, settle)) for f in files for r in load(os.path.join(d, f))]


#: The rounds ``by_round`` shows, from the first after the passes.
ROUNDS_SHOWN = 10


def by_round(dirs: list[str]) -> list[str]:
    """Each round's on-minus-off ms less its option's median over the process, the median over every
    saved option of a kind (the design, offload or recompute, MoE or dense): where the first rounds
    after the module-time passes stand apart from the rest (the untimed rounds count as rounds)."""
    kinds: dict[str, dict[int, list[float]]] = {}
    for d in dirs:
        for _, r in saved(d):
            raw = r["raw"]
            if (raw.get("run_length") or 1) != 1:
                continue
            diffs = [a - b for a, b in zip(raw["on_ms"], raw["off_ms"])]
            mid = statistics.median(diffs)
            kind = (f"{'together' if raw.get('together') else 'one after another'}, "
                    f"{'offload' if 'offload=' in r['option'] else 'recompute'}, "
                    f"{'MoE' if raw['cfg']['model']['family'] == 'moe' else 'dense'}")
            for i, x in enumerate(diffs, start=raw.get("settle_rounds", 0)):
                kinds.setdefault(kind, {}).setdefault(i, []).append(x - mid)
    width = min(ROUNDS_SHOWN, max(max(rounds) for rounds in kinds.values()) + 1) if kinds else 0
    out = ["| design, options, family | options | " + " | ".join(f"round {i + 1}" for i in range(width)) + " |",
           "|---|---|" + "---|" * width]
    for kind, rounds in sorted(kinds.items()):
        cells = [f"{statistics.median(rounds[i]):+.1f}" if i in rounds else "untimed" if i < min(rounds) else "-"
                 for i in range(width)]
        out.append(f"| {kind} | {max(len(v) for v in rounds.values())} | " + " | ".join(cells) + " |")
    return out


def table(dirs: list[str], summary_only: bool = False, settle: int = 0) -> None:
    """Every saved process under ``dirs``, priced with this code, and the summary over them all (alone
    with ``summary_only``: every machine's processes of an option pooled, the target's own test); with
    ``settle``, from each option's rounds after the first ``settle`` (``settled``)."""
    rows: dict[tuple[str, str], list[dict]] = {}
    for d in dirs:
        numbered = [(n, reprice(r)) for n, r in saved(d, settle)]
        for _, r in numbered:
            pool(rows, r)
        if summary_only:
            continue
        together = any(r["raw"].get("together") for _, r in numbered)  # bench_paired.py --together
        print(f"{d} ({len({n for n, _ in numbered})} processes"
              f"{', the options together on one model' if together else ''})\n\n{ROW_HEADER}")
        for n, r in numbered:
            print(row(n, r))
        print()
        for line in process_tables(numbered):
            print(line)
    print("\n".join(summary(rows, interval=summary_only)))


def at_rates(r: dict, a: float, b: float) -> dict:
    """A saved option with its config's ``estimate.offload_ms_per_group`` and ``_per_gib`` set."""
    cfg = r["raw"]["cfg"]
    est = {**cfg["estimate"], "offload_ms_per_group": a, "offload_ms_per_gib": b}
    return {**r, "raw": {**r["raw"], "cfg": {**cfg, "estimate": est}}}


def fit(dirs: list[str], settle: int = 0) -> list[str]:
    """``estimate.offload_ms_per_group`` and ``estimate.offload_ms_per_gib``: the least squares of every
    saved process's added ms against its price, over the offload options without recompute of families
    whose step is not host-bound (a step that hides the manager's host work pays these rates; a
    host-bound one, MoE's, adds what its timeline measured), then the summary of every saved option
    priced at them."""
    from recipes.config import EstimateConfig
    from recipes.offload import modules_of
    from recipes.predict.copies import fit_offload_rates
    from recipes.predict.cost import host_bound

    every = [r for d in dirs for _, r in saved(d, settle)]
    used = [r for r in every if modules_of(r["raw"]["cfg"]) and not r["raw"]["cfg"]["recompute"]["recompute_granularity"]
            and not host_bound(r["raw"]["cfg"])]

    def priced(a: float, b: float) -> list[float]:  # reprice's first pass alone, the price the fit is of
        return [price(at_rates(r, a, b)["raw"]["cfg"], r["raw"]["module_times"][0], r.get("link_gb_s"))["priced_ms"]
                for r in used]

    default = EstimateConfig()
    solved = fit_offload_rates(priced, [r["added_ms"] for r in used], default.offload_ms_per_group,
                               default.offload_ms_per_gib)
    if solved is None:
        return ["--fit needs offload options without recompute, of a step that is not host-bound, that differ "
                "in groups per GiB moved"]
    a, b = solved
    rows: dict[tuple[str, str], list[dict]] = {}
    for r in every:
        r = reprice(at_rates(r, a, b))
        pool(rows, r)
    return [f"estimate.offload_ms_per_group={a:.3f} estimate.offload_ms_per_gib={b:.2f} (least squares over "
            f"{len(used)} processes' options)", "", *summary(rows)]
