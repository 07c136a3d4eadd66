"""The table benchmarks/gpu_offload.sh ends with: recompute against activation offload, measured.

One row per point of the sweep directories given (their ``result.json``; a point repeated in several
processes, ``measure.repeat``, is one row of their medians), grouped by model and size:
peak allocated, what the point copied to the host (the ledger's host bytes of one micro-batch after
megatron's plan; bytes moved per measured step), step time and its change against the group's
``none`` point (or, where ``none`` did not fit, its fastest completed point) in percent and in ms
beside the planner's prediction of that difference (today's model at the rates the sweep measured), the
copy time the profiled step measured on the copy streams and the part of it no compute kernel
overlapped (exposed), and the host link's bandwidth.

    python benchmarks/offload_table.py results/offload_standard_attn_h200 results/offload_moe_h200 ...
    python benchmarks/offload_table.py --fit docs/offload-h200/standard_attn_h200

``--fit`` prints the least-squares ``estimate.offload_ms_per_group`` and ``estimate.offload_ms_per_gib``
of the offload points without recompute: their measured added time, less the predicted wait for
reloads, against the groups and GiB each moved per step.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: import the repository's recipes

from recipes.analyze.candidates import measured_rates  # noqa: E402
from recipes.analyze.plan import price_config  # noqa: E402
from recipes.analyze.plan import rates as rates_of  # noqa: E402
from recipes.analyze.sweep import find_results  # noqa: E402
from recipes.config import EstimateConfig  # noqa: E402
from recipes.offload import option_of as offload_option  # noqa: E402
from recipes.predict.copies import fit_offload_rates  # noqa: E402
from recipes.recompute import option_of as recompute_option  # noqa: E402

GIB = 2**30
HEADER = ("| model | size | point | status | peak alloc GiB | host GiB (per micro-batch) | moved GiB per step | "
          "step ms | vs none | added ms | predicted added ms | copies ms | exposed ms | link GB/s (D2H / H2D) |")


def load(dirs: list[str]) -> list[dict]:
    """Every result.json under the directories, priced (``priced``) at the rates its sweep measured
    (``measured_rates``: its base point's TFLOP/s, the link its offload points recorded), as the
    advisor prices a measured sweep; a CPU sweep's points are not priced."""
    out = []
    for d in dirs:
        results = find_results(Path(d))
        out += priced(results, measured_rates(results))
    return out


def priced(results: list[dict], measured: tuple) -> list[dict]:
    """The results, each with its options and today's model's price of it (``price_config``: the config
    as it ran, its offload fraction and block layer count) at ``measured`` (TFLOP/s, link GB/s and,
    optionally, the base point's module times; no TFLOP/s: not priced)."""
    tflops, link_gb_s, module_times = (*measured, None)[:3]
    for result in results:
        cfg = result.get("config") or {}
        result["_plan"] = (recompute_option(cfg), offload_option(cfg))
        result["_rates"] = (*rates_of(cfg, tflops, link_gb_s), module_times) if cfg and tflops else None
        result["_predicted"] = price_config(cfg, *result["_rates"]) if result["_rates"] else None
    return results


def _worst(result: dict) -> dict:
    ranks = result.get("ranks") or [{}]
    return next((r for r in ranks if r.get("rank") == result.get("worst_rank")), ranks[0])


def row(result: dict) -> dict:
    rank = _worst(result)
    mem, timing, ledger = rank.get("memory") or {}, rank.get("timing") or {}, rank.get("ledger") or {}
    off = rank.get("offload") or {}
    transfer, link = off.get("transfer") or {}, off.get("link") or {}
    moved = (off.get("moved_per_step") or {}).get("d2h_bytes")
    ch = result.get("choices") or {}
    recompute, offload = result["_plan"]
    predicted = result.get("_predicted")
    fraction = ((result.get("config") or {}).get("offload") or {}).get("activation_offload_fraction", 1.0)
    share = f" at fraction {fraction:g}" if offload != "none" and fraction != 1.0 else ""
    return {"model": ch.get("model"), "size": ch.get("size"), "status": result.get("status"),
            "point": f"recompute={recompute}" + (f" offload={offload}{share}" if offload != "none" else ""),
            "offload": offload, "recompute": recompute,
            "peak": mem.get("peak_allocated_gib"), "host": ledger.get("host_total_bytes"), "moved": moved,
            "step_ms": timing["step_time_s"] * 1e3 if timing.get("step_time_s") else None,
            "copy_ms": transfer["copy_busy_s"] * 1e3 if transfer.get("copy_busy_s") is not None else None,
            "exposed_ms": transfer["exposed_s"] * 1e3 if transfer.get("exposed_s") is not None else None,
            "link": (link["d2h_gb_s"], link["h2d_gb_s"]) if link.get("d2h_gb_s") else None,
            "predicted_ms": predicted["cost_s"] * 1e3 if predicted else None,
            "groups": predicted.get("offload_groups") if predicted else None,
            "gib": predicted.get("offload_gib") if predicted else None}


def _f(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def merged(rows: list[dict]) -> list[dict]:
    """One row per point: the processes of a repeated point (``measure.repeat``) as their median step,
    copy and exposed times, the status saying how many ran and how far apart their steps were."""
    points: dict[tuple, list[dict]] = {}
    for r in rows:
        points.setdefault((r["model"], r["size"], r["point"]), []).append(r)
    out = []
    for same in points.values():
        timed = [r for r in same if r["step_ms"] is not None]
        if len(same) == 1 or not timed:
            out += same
            continue
        median = {k: statistics.median(r[k] for r in timed if r[k] is not None)
                  if any(r[k] is not None for r in timed) else None for k in ("step_ms", "copy_ms", "exposed_ms")}
        steps = sorted(r["step_ms"] for r in timed)
        status = f"ok, {len(timed)} processes: {steps[0]:.1f}-{steps[-1]:.1f} ms" if len(timed) == len(same) else \
            f"{len(timed)} of {len(same)} processes timed: {steps[0]:.1f}-{steps[-1]:.1f} ms"
        out.append({**timed[0], **median, "status": status})
    return out


def table(results: list[dict]) -> str:
    rows = merged([row(r) for r in results])
    lines = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["size"]), []).append(r)
    for (model, size), group in groups.items():
        done = [r for r in group if r["step_ms"] is not None]
        base = next((r for r in done if r["recompute"] == "none" and r["offload"] == "none"), None)
        base = base or min(done, key=lambda r: r["step_ms"], default=None)
        for r in sorted(group, key=lambda r: (r["offload"] != "none", r["recompute"] != "none", r["point"])):
            vs = (f"{(r['step_ms'] / base['step_ms'] - 1) * 100:+.1f}%" + ("" if base["point"] == "recompute=none"
                  else f" (vs {base['point']})") if r["step_ms"] and base and r is not base else
                  ("reference" if r is base else "-"))
            link = f"{r['link'][0]:.1f} / {r['link'][1]:.1f}" if r["link"] else "-"
            added = r["step_ms"] - base["step_ms"] if r["step_ms"] and base else None
            # against the same reference as the measured column (the reference's own predicted cost)
            predicted = (r["predicted_ms"] - base["predicted_ms"] if r["predicted_ms"] is not None and base
                         and base["predicted_ms"] is not None else None)
            lines.append(f"| {model} | {size} | {r['point']} | {r['status']} | {_f(r['peak'], '{:.2f}')} | "
                         f"{_f(r['host'] / GIB if r['host'] is not None else None, '{:.2f}')} | "
                         f"{_f(r['moved'] / GIB if r['moved'] is not None else None, '{:.2f}')} | "
                         f"{_f(r['step_ms'], '{:.1f}')} | {vs} | {_f(added, '{:+.1f}')} | "
                         f"{_f(predicted, '{:+.1f}')} | {_f(r['copy_ms'], '{:.1f}')} | "
                         f"{_f(r['exposed_ms'], '{:.1f}')} | {link} |")
    return "\n".join(lines)


def fit(results: list[dict]) -> str:
    """Least squares of measured added ms = stall + a x groups + b x GiB over the offload points without
    recompute, each point's fit beside it. The stall depends on a and b (the overhead lengthens the
    layers the copies hide under): Gauss-Newton on the whole model, from the defaults."""
    rows = {id(r): row(r) for r in results}
    base = {(r["model"], r["size"]): r["step_ms"] for r in rows.values()
            if r["recompute"] == "none" and r["offload"] == "none" and r["step_ms"]}
    used = [r for r in results if (x := rows[id(r)])["recompute"] == "none" and x["offload"] != "none"
            and x["step_ms"] and x["groups"] is not None and (x["model"], x["size"]) in base]
    if len(used) < 2:
        return "--fit needs two offload points without recompute and a none point, with their configs"

    def offload_ms(r: dict, a: float, b: float) -> tuple[float, float]:
        """(stall, stall + overhead) in ms at a ms a group and b ms a GiB."""
        est = {**r["config"]["estimate"], "offload_ms_per_group": a, "offload_ms_per_gib": b}
        p = price_config({**r["config"], "estimate": est}, *r["_rates"])
        return p["offload_stall_s"] * 1e3, (p["offload_stall_s"] + p["offload_overhead_s"]) * 1e3

    y = [rows[id(r)]["step_ms"] - base[(rows[id(r)]["model"], rows[id(r)]["size"])] for r in used]
    default = EstimateConfig()
    solved = fit_offload_rates(lambda a, b: [offload_ms(r, a, b)[1] for r in used], y,
                               default.offload_ms_per_group, default.offload_ms_per_gib)
    if solved is None:
        return "--fit needs offload points that differ in groups per GiB moved"
    a, b = solved
    lines = [f"estimate.offload_ms_per_group={a:.3f} estimate.offload_ms_per_gib={b:.2f} "
             f"(least squares over {len(used)} points)",
             "| point | groups per step | GiB per step | measured added ms - stall | fit ms | fit vs measured |",
             "|---|---|---|---|---|---|"]
    for r, yi in zip(used, y):
        x, (stall, _) = rows[id(r)], offload_ms(r, a, b)
        f = a * x["groups"] + b * x["gib"]
        lines.append(f"| {x['model']} {x['size']} {x['point']} | {x['groups']} | {x['gib']:.2f} | {yi - stall:.1f} | "
                     f"{f:.1f} | {(f - (yi - stall)) / (yi - stall):+.0%} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    fitting = "--fit" in argv
    argv = [a for a in argv if a != "--fit"]
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    results = load(argv)
    if not results:
        print("no result.json under " + " ".join(argv), file=sys.stderr)
        return 1
    print(fit(results) if fitting else table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
