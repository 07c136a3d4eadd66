"""What a recompute or offload option adds to a step, measured against itself switched off in the same
process, next to the planner's price from that process's own timeline.

    python benchmarks/bench_paired.py --processes 3 model=moe size=h200 --options full,selective/moe
    python benchmarks/bench_paired.py --processes 1 model=standard_attn size=h200 --options full,selective/mlp
    python benchmarks/bench_paired.py --processes 1 model=standard_attn size=h200 \
      --options "offload=core_attn,recompute=selective/layernorm offload=attn_norm-mlp_norm"

An option is a recompute option (``full``, ``selective/moe``), or overrides separated by spaces
(``offload=core_attn``, ``recompute=selective/moe_act offload=moe_act offload.activation_offload_fraction=0.75``).

A label sweep measures each option in its own processes, so an option's cost is the difference of two
sets of processes; where the host's speed moves between processes (an MoE step's wall time follows it:
docs/speed.md), that difference moves with it. Here each process builds the worker's ``Trainer`` with
the option and, after 2 warm-up steps each way, alternates steps with the option on and switched off
(``recipes.measure.labels.recompute_disabled``: the model as ``recompute=none`` builds it, same
weights, same allocator; and megatron's offload manager paused, ``recipes.build.offload.offload_paused``:
its points stay in the graph and move nothing), ``--rounds`` of each, in the order on/off, off/on, ... Before those it
records the module times and step timeline with the option off (``recipes.measure.moduletime``, what a
sweep's ``none`` point records) and prices the option on them as the planner does
(``recipes.analyze.plan.price_config``). Both figures then belong to one process at one host pace.

Per process and option: the median off and on step (ms, each step timed from a drained stream to
its end), the added ms (the median of the rounds' on-minus-off differences; in brackets the middle half
of them), and the price (``timeline`` where the pass recorded a step timeline, on a GPU, else from the
module times): the replays' and the copies' together, the copies priced at the host link this process
measured (``recipes.measure.offload.host_link_bandwidth``, the slower direction). An offload option also
runs two more steps after its rounds: one timing where compute waits for each reload
(``recipes.measure.offload.CopyTimeline``: ``reload waits ms``, against the price's stall), and one
profiled, the copies' time with no kernel beside them (``exposed ms``; the profiler slows the host, and
with it the forward the copies hide under). It then times the offload manager method by method in a
step on and one off (``recipes.measure.offload.ManagerCalls``, beside the planner's synthetic groups
timed the same way), and for every option profiles the GPU alone in a step on and one off: what the
kernels added beside what the step added (where the step grew by more, the GPU waited for the host),
and the host's side in one more pair (``host_ops``: the operators' and CUDA calls' self host ms, the
ones that grew most, and the garbage collector's ms, which every paired step records too).
On a CPU it runs, for tests, at whatever size is given; times mean nothing there.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.bench_hostbound import defaults  # noqa: E402  (model=moe size=h200 unless named, profile=none)

_waits = None  # recipes.measure.syncs.ItemWaits, entered for a measuring process's lifetime (measure)
_collected = None  # recipes.measure.collections.CollectionMeter, installed the same


def _timed_step(trainer, cuda: bool, host: list | None = None, allocs: list | None = None,
                waits: list | None = None, collected: list | None = None) -> float:
    """The step's ms from a drained stream to its end; with ``host``, also appends the host's own
    ms: until ``step()`` returned, less its waits in ``Tensor.item`` (megatron's grad-norm read), and
    with ``waits`` those waits (ms); with ``allocs`` (a GPU), the step's ``cudaMalloc`` and ``cudaFree``
    calls (each free waits for the device); with ``collected``, the garbage collector's ms in it."""
    import torch

    if cuda:
        torch.cuda.synchronize()
        counts = _device_allocs() if allocs is not None else None
    if _waits is not None:
        _waits.seconds = 0.0
    collections = _collected.snapshot() if _collected is not None else None
    start = time.perf_counter()
    trainer.step()
    returned = time.perf_counter()
    if cuda:
        torch.cuda.synchronize()
        if counts is not None:
            allocs.append([b - a for a, b in zip(counts, _device_allocs())])
    waited = _waits.seconds if _waits is not None else 0.0
    if host is not None:
        host.append((returned - start - waited) * 1e3)
    if waits is not None:
        waits.append(waited * 1e3)
    if collected is not None and collections is not None:
        collected.append(round(_collected.since(collections)[1] * 1e3, 3))
    return (time.perf_counter() - start) * 1e3


def _device_allocs() -> tuple[int, int]:
    import torch

    stats = torch.cuda.memory_stats()
    return stats.get("num_device_alloc", 0), stats.get("num_device_free", 0)


def each_way(trainer) -> tuple:
    """("on", the option as built) and ("off", ``switched_off``): the blocks a one-step measurement
    runs under, each way."""
    return ("on", contextlib.nullcontext), ("off", partial(switched_off, trainer))


def manager_calls(trainer, cuda: bool) -> dict:
    """Where the offload manager's host time goes in a step, method by method
    (``recipes.measure.offload.ManagerCalls``): one step with the option on and one with it switched
    off, each with the host's own ms, and the planner's synthetic groups measured the same way
    (``recipes.measure.regions.offload_calls``)."""
    import torch

    from recipes.measure.offload import ManagerCalls
    from recipes.measure.regions import offload_calls

    out = {}
    for name, block in each_way(trainer):
        host: list[float] = []
        with block(), ManagerCalls() as timed:
            _timed_step(trainer, cuda, host)
        out[name] = {**timed.summary(), "host_ms": host[0]}
    out["synthetic"] = offload_calls(torch.device("cuda" if cuda else "cpu"))
    return out


#: The operators and CUDA calls ``host_ops`` keeps: those whose host time grew most with the option.
TOP_OPS = 12


def host_ops(trainer, cuda: bool) -> dict:
    """Where the option's host time goes outside Python: one step on and one switched off, each under
    torch's profiler (CPU activity, and CUDA's where there is a GPU: its runtime calls, on every thread,
    the backward's too), each way the operators' and calls' self host ms summed (``self_ms``) and the
    garbage collector's ms; the ``TOP_OPS`` whose self ms grew most (``top``: [name, calls on, calls
    off, ms on, ms off]) and every op called a different number of times each way (``calls_changed``,
    the same). The profiler's recording inflates each op's time; the rest of the step's host added is
    Python of its own (the manager's methods, ``manager_calls``)."""
    from torch.profiler import ProfilerActivity, profile

    from recipes.measure.collections import CollectionMeter

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    each = {}
    for name, block in each_way(trainer):
        host: list[float] = []
        meter = CollectionMeter().install()  # the collector's pauses, on whichever thread it runs
        try:
            with block(), profile(activities=activities) as prof:
                _timed_step(trainer, cuda, host)
        finally:
            meter.uninstall()
        ops = {e.key: (e.count, e.self_cpu_time_total / 1e3) for e in prof.key_averages()}
        each[name] = {"host_ms": host[0], "self_ms": sum(ms for _, ms in ops.values()),
                      "gc_ms": meter.pause_s * 1e3, "gc_runs": sum(meter.collections), "ops": ops}
    on, off = each["on"]["ops"], each["off"]["ops"]

    def entry(k):
        (n_on, ms_on), (n_off, ms_off) = on.get(k, (0, 0.0)), off.get(k, (0, 0.0))
        return [k, n_on, n_off, round(ms_on, 3), round(ms_off, 3)]

    grown = lambda k: on.get(k, (0, 0.0))[1] - off.get(k, (0, 0.0))[1]  # noqa: E731
    top = [entry(k) for k in sorted(on, key=grown, reverse=True)[:TOP_OPS]]
    # what the option calls that the step switched off does not, or more often: counted, not timed
    called = [entry(k) for k in sorted(set(on) | set(off), key=grown, reverse=True)
              if on.get(k, (0, 0.0))[0] != off.get(k, (0, 0.0))[0]]
    return {**{name: {k: round(v, 3) for k, v in e.items() if k != "ops"} for name, e in each.items()},
            "top": top, "calls_changed": called}


def gpu_work(trainer) -> dict:
    """The GPU's side of the option: one step on and one switched off, each under torch's profiler
    recording CUDA activity only (``recipes.measure.steptrace.trace_step``): the compute kernels' busy
    ms, the GPU's busy ms (copies too) and its idle ms within the step's span, and the kernels that took
    most (``steptrace.TOP_KERNELS`` of them: a kernel the option adds shows where it is among those).
    Where the option's added step time is more than its kernels added, the GPU waited for the host."""
    from recipes.measure.steptrace import trace_step

    out = {}
    for name, block in each_way(trainer):
        with block():
            s = trace_step(trainer.step, host=False)
        out[name] = {"kernel_busy_ms": s["kernel_busy_s"] * 1e3, "gpu_busy_ms": s["gpu_busy_s"] * 1e3,
                     "gpu_idle_ms": s["gpu_idle_s"] * 1e3, "kernels": s["kernels"]}
    return out


def option_overrides(option: str) -> list[str]:
    """``full`` -> ``recompute=full``; ``offload=core_attn recompute=selective/layernorm`` -> its overrides."""
    return option.split() if "=" in option else [f"recompute={option}"]


@contextlib.contextmanager
def switched_off(trainer):
    """The trainer's recompute and offload both off for the block: it runs as ``recompute=none
    offload=none`` builds the model, with the same weights and allocator."""
    from recipes.build.offload import offload_paused
    from recipes.measure.labels import recompute_disabled

    with recompute_disabled(trainer.chunks, trainer.config), offload_paused(trainer.offloading):
        yield


def _price(cfg: dict, module_times: dict, link_gb_s: float | None) -> dict:
    """The planner's price of ``cfg`` (replays and copies together, ms) on a pass's module times."""
    from recipes.analyze.plan import price_config, rates

    tflops, link = rates(cfg, None, link_gb_s)
    # priced for a GPU, as the planner prices; a CPU test's emulated copies stand for its copies
    p = price_config({**cfg, "offload": {**cfg["offload"], "emulate_on_cpu": False}}, tflops, link, module_times)
    return {"priced_ms": p["cost_s"] * 1e3, "priced_recompute_ms": p["recompute_s"] * 1e3,
            "priced_stall_ms": p["offload_stall_s"] * 1e3, "priced_overhead_ms": p["offload_overhead_s"] * 1e3,
            "priced_copy_ms": p["offload_copy_s"] * 1e3}


def measure_option(overrides: list[str], option: str, rounds: int, passes: int = 1, run_length: int = 1,
                   trace: str | None = None) -> dict:
    """One option in this process: the paired steps and its price on this process's timeline.
    ``run_length``: steps in a row each way (1: on/off, off/on, ...; 4: 4 on, 4 off, 4 off, 4 on, ...);
    ``trace``: where an offload option's profiled step's trace is kept (gzipped)."""
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    from recipes.build.compat import cuda_available, seed_model_parallel_rng
    from recipes.config import compose_config
    from recipes.measure.moduletime import note_host_wait, time_modules
    from recipes.measure.offload import CopyTimeline, copy_overlap, host_link_bandwidth
    from recipes.run.trainer import Trainer

    cfg = compose_config([*overrides, *option_overrides(option)])
    destroy_moe_metrics_tracker()  # a process global sized by the first MoE model (see tests/conftest.py)
    seed_model_parallel_rng(cfg["train"]["seed"])
    trainer, cuda = Trainer(cfg), cuda_available()
    try:
        off = partial(switched_off, trainer)
        for _ in range(2):
            _timed_step(trainer, cuda)
            with off():
                _timed_step(trainer, cuda)
        with off():
            before = [time_modules(trainer) for _ in range(passes)]
        on_ms, off_ms, on_host, off_host, on_allocs, off_allocs, on_wait, off_wait = [], [], [], [], [], [], [], []
        on_gc, off_gc = [], []
        for r in range(max(1, rounds // run_length)):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                for _ in range(run_length):
                    if on:
                        on_ms.append(_timed_step(trainer, cuda, on_host, on_allocs, on_wait, on_gc))
                    else:
                        with off():
                            off_ms.append(_timed_step(trainer, cuda, off_host, off_allocs, off_wait, off_gc))
        with off():
            after = [time_modules(trainer) for _ in range(passes - 1)]
        clock, calls = {}, None
        if trainer.offloading:  # one more step, unprofiled: the copies and where compute stood still for reloads
            with CopyTimeline() as timeline:
                _timed_step(trainer, cuda)
            clock = timeline.summary()
            calls = manager_calls(trainer, cuda)
        ops = host_ops(trainer, cuda)
        gpu = gpu_work(trainer) if cuda else None
        exposed = None
        keep = Path(trace) if trace and trainer.offloading else None
        if trainer.offloading and (overlap := copy_overlap(trainer.step, keep)) is not None:
            exposed = overlap[0]["exposed_s"] * 1e3
        link = host_link_bandwidth() if trainer.offloading else None
        link_gb_s = min(link["d2h_gb_s"], link["h2d_gb_s"]) if link else None
        added = sorted(a - b for a, b in zip(on_ms, off_ms))
        module_times = before[0]  # what a sweep's base point records: one pass after its steps
        marks = module_times.get("marks")
        if _waits is not None:  # each pass with its steps' wait at the grad-norm read, as a sweep's base point
            wait = statistics.median(off_wait)
            for timed in before + after:
                note_host_wait(timed, wait)
        return {"option": option, "off_ms": statistics.median(off_ms), "on_ms": statistics.median(on_ms),
                "added_ms": statistics.median(added),
                "added_iqr_ms": [added[len(added) // 4], added[(3 * len(added)) // 4]],
                "host_added_ms": statistics.median(a - b for a, b in zip(on_host, off_host)),
                **_price(cfg, module_times, link_gb_s), "exposed_ms": exposed, "link_gb_s": link_gb_s,
                **({"reload_waits": clock["reload_waits"], "copies": clock.get("copies"),
                    "strided_out": clock.get("strided_out"),
                    "reload_wait_ms": None if (w := clock["reload_wait_s"]) is None else w * 1e3} if clock else {}),
                **({"manager_calls": calls} if calls else {}), **({"gpu_work": gpu} if gpu else {}),
                "host_ops": ops,
                "priced_on": "timeline" if isinstance(marks, dict) and "names" in marks else "module times",
                "host_pass_ms": marks.get("pass_ms") if isinstance(marks, dict) else None,
                "raw": {"cfg": cfg, "on_ms": on_ms, "off_ms": off_ms, "on_host_ms": on_host, "off_host_ms": off_host,
                        "on_wait_ms": on_wait, "off_wait_ms": off_wait, "on_gc_ms": on_gc, "off_gc_ms": off_gc,
                        "on_allocs": on_allocs, "off_allocs": off_allocs, "run_length": run_length,
                        "module_times": before + after, "copy_timeline": clock.get("copy_timeline")}}
    finally:
        trainer.close()


def measure(overrides: list[str], options: list[str], rounds: int, passes: int, run_length: int = 1,
            traces: str | None = None) -> list[dict]:
    from recipes.config import compose_config
    from recipes.measure.collections import CollectionMeter
    from recipes.measure.syncs import ItemWaits
    from recipes.run.worker import init_one_rank

    global _waits, _collected
    init_one_rank(compose_config(overrides))
    _waits = ItemWaits().__enter__()  # this process measures and exits: never left
    _collected = CollectionMeter().install()
    import torch

    results = []
    for i, option in enumerate(options):
        trace = os.path.join(traces, f"trace-option-{i}.json.gz") if traces else None
        results.append(measure_option(overrides, option, rounds, passes, run_length, trace))
        gc.collect()  # the option's model and optimizer, before the next one's are built
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


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
    passes = [_price(r["raw"]["cfg"], mt, r.get("link_gb_s")) for mt in r["raw"]["module_times"]]
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
        strided = r.get("strided_out")  # not recorded before 2026-12-05 04:30 UTC: -
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


def summary(rows: dict[tuple[str, str], list[dict]]) -> list[str]:
    """Per (model, option): the processes' added ms and prices, their medians, and the median price
    of every module-time pass they recorded."""
    out = ["| model | option | processes | added ms, each | added, median | priced, median | vs added "
           "| priced, every pass: median | vs added |", "|---|---|---|---|---|---|---|---|---|"]
    for (model, option), rs in rows.items():
        added, priced = statistics.median(r["added_ms"] for r in rs), statistics.median(r["priced_ms"] for r in rs)
        every = statistics.median(p for r in rs for p in r.get("passes_ms") or [r["priced_ms"]])
        each = ", ".join(f"{r['added_ms']:+.1f}" for r in rs)
        out.append(f"| {model} | {option} | {len(rs)} | {each} | {added:+.1f} | {priced:+.1f} | {error(priced, added)} "
                   f"| {every:+.1f} | {error(every, added)} |")
    return out


def pool(rows: dict[tuple[str, str], list[dict]], r: dict) -> None:
    """Add a measured option to the summary's rows, under its model family and option."""
    rows.setdefault((r["raw"]["cfg"]["model"]["family"], r["option"]), []).append(r)


def saved(d: str) -> list[tuple[int, dict]]:
    """The options the processes saved under ``d`` measured, each with its process's number."""
    files = sorted(f for f in os.listdir(d) if f.startswith("process-") and f.endswith(".json.gz"))  # not traces
    return [(int(f.split("-")[1].split(".")[0]), r) for f in files for r in load(os.path.join(d, f))]


def table(dirs: list[str], summary_only: bool = False) -> None:
    """Every saved process under ``dirs``, priced with this code, and the summary over them all (alone
    with ``summary_only``: every machine's processes of an option pooled, the target's own test)."""
    rows: dict[tuple[str, str], list[dict]] = {}
    for d in dirs:
        numbered = [(n, reprice(r)) for n, r in saved(d)]
        for _, r in numbered:
            pool(rows, r)
        if summary_only:
            continue
        print(f"{d} ({len({n for n, _ in numbered})} processes)\n\n{ROW_HEADER}")
        for n, r in numbered:
            print(row(n, r))
        print()
        for line in process_tables(numbered):
            print(line)
    print("\n".join(summary(rows)))


def at_rates(r: dict, a: float, b: float) -> dict:
    """A saved option with its config's ``estimate.offload_ms_per_group`` and ``_per_gib`` set."""
    cfg = r["raw"]["cfg"]
    est = {**cfg["estimate"], "offload_ms_per_group": a, "offload_ms_per_gib": b}
    return {**r, "raw": {**r["raw"], "cfg": {**cfg, "estimate": est}}}


def fit(dirs: list[str]) -> list[str]:
    """``estimate.offload_ms_per_group`` and ``estimate.offload_ms_per_gib``: the least squares of every
    saved process's added ms against its price, over the offload options without recompute of families
    whose step is not host-bound (a step that hides the manager's host work pays these rates; a
    host-bound one, MoE's, adds what its timeline measured), then the summary of every saved option
    priced at them."""
    from recipes.config import EstimateConfig
    from recipes.offload import modules_of
    from recipes.predict.copies import fit_offload_rates
    from recipes.predict.cost import host_bound

    every = [r for d in dirs for _, r in saved(d)]
    used = [r for r in every if modules_of(r["raw"]["cfg"]) and not r["raw"]["cfg"]["recompute"]["recompute_granularity"]
            and not host_bound(r["raw"]["cfg"])]

    def priced(a: float, b: float) -> list[float]:  # reprice's first pass alone, the price the fit is of
        return [_price(at_rates(r, a, b)["raw"]["cfg"], r["raw"]["module_times"][0], r.get("link_gb_s"))["priced_ms"]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Everything else is a Hydra override, as train.py takes them.")
    parser.add_argument("--processes", type=int, default=3, help="fresh processes, one after another (default 3)")
    parser.add_argument("--options", default="full", help="options, comma-separated: recompute options, or overrides separated by spaces "
                        "(\"offload=core_attn\"; default full)")
    parser.add_argument("--rounds", type=int, default=8, help="on/off pairs of steps per option (default 8)")
    parser.add_argument("--passes", type=int, default=1,
                        help="module-time passes before the steps (and one fewer after); the price reads the first")
    parser.add_argument("--run-length", type=int, default=1,
                        help="steps in a row each way (default 1: on/off, off/on, ...)")
    parser.add_argument("--keep-traces", action="store_true",
                        help="with --save: keep each offload option's profiled step's trace beside its process")
    parser.add_argument("--save", help="write each process's steps, config and module times to SAVE/process-N.json.gz")
    parser.add_argument("--table", nargs="+", metavar="DIR", help="no run: price the processes saved in DIRs with "
                        "this code and print their rows and the summary over them all")
    parser.add_argument("--summary", nargs="+", metavar="DIR", help="no run: as --table, the summary over them all "
                        "alone")
    parser.add_argument("--fit", nargs="+", metavar="DIR", help="no run: fit estimate.offload_ms_per_group and "
                        "_per_gib to the offload options saved in DIRs (those without recompute, of a step that is "
                        "not host-bound) and print every saved option's summary priced at them")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: measure, print JSON
    parser.add_argument("--traces", help=argparse.SUPPRESS)  # a child: where its offload options' traces go
    args, overrides = parser.parse_known_args()
    if args.table or args.summary:
        table(args.table or args.summary, summary_only=bool(args.summary))
        return
    if args.fit:
        print("\n".join(fit(args.fit)))
        return
    overrides, options = defaults(overrides), args.options.split(",")
    if args.one:
        print("RESULT " + json.dumps(measure(overrides, options, args.rounds, args.passes, args.run_length,
                                             args.traces)), flush=True)
        return
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (times mean nothing)"
    print(f"{' '.join(overrides)}; {args.processes} processes, {args.rounds} rounds; {device}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n{ROW_HEADER}")
    rows: dict[tuple[str, str], list[dict]] = {}
    numbered = []
    for n in range(args.processes):
        traces = [f"--traces={os.path.join(args.save, f'process-{n}')}"] if args.save and args.keep_traces else []
        if traces:
            os.makedirs(traces[0].split("=", 1)[1], exist_ok=True)
        done = subprocess.run([sys.executable, __file__, "--one", f"--options={args.options}", f"--rounds={args.rounds}",
                               f"--passes={args.passes}", f"--run-length={args.run_length}", *traces, *overrides],
                              cwd=REPO, capture_output=True, text=True)
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"| {n} | failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]} | | | | | | | | |")
            continue
        results = json.loads(line[len("RESULT "):])
        if args.save:
            os.makedirs(args.save, exist_ok=True)
            with gzip.open(os.path.join(args.save, f"process-{n}.json.gz"), "wt") as f:
                json.dump(results, f)
        for r in results:
            pool(rows, r)
            numbered.append((n, r))
            print(row(n, r), flush=True)
    print()
    for line in process_tables(numbered):
        print(line)
    print("\n".join(summary(rows)))


if __name__ == "__main__":
    main()
