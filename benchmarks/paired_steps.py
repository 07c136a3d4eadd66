"""One step of ``benchmarks/bench_paired.py`` timed, and what it probes with an option on and switched
off: a step from a drained stream to its end (the host's own ms, its waits at the grad-norm read, the
collector's ms, the device's allocations), the trainer switched off (``switched_off``), and the three
probes each way: the offload manager's calls (``manager_calls``), the host's operators (``host_ops``)
and the GPU's kernels (``gpu_work``)."""

from __future__ import annotations

import contextlib
import time
from functools import partial

_waits = None  # recipes.measure.syncs.ItemWaits, entered for a measuring process's lifetime (``install_meters``)
_collected = None  # recipes.measure.collections.CollectionMeter, installed the same


def install_meters() -> None:
    """The waits at ``Tensor.item`` and the collector's pauses, metered for every step timed from now
    on: for a process that measures and exits (never uninstalled)."""
    from recipes.measure.collections import CollectionMeter
    from recipes.measure.syncs import ItemWaits

    global _waits, _collected
    _waits = ItemWaits().__enter__()
    _collected = CollectionMeter().install()


def metering() -> bool:
    """Whether ``install_meters`` ran: each step then records its waits at the grad-norm read."""
    return _waits is not None


def timed_step(trainer, cuda: bool, host: list | None = None, allocs: list | None = None,
               waits: list | None = None, collected: list | None = None) -> float:
    """The step's ms from a drained stream to its end; with ``host``, also appends the host's own
    ms: until ``step()`` returned, less its waits in ``Tensor.item`` (megatron's grad-norm read), and
    with ``waits`` those waits (ms); with ``allocs`` (a GPU), the step's ``cudaMalloc`` and ``cudaFree``
    calls (each free waits for the device); with ``collected``, the garbage collector's ms in it."""
    import torch

    if cuda:
        torch.cuda.synchronize()
        counts = device_allocs() if allocs is not None else None
    if _waits is not None:
        _waits.seconds = 0.0
    collections = _collected.snapshot() if _collected is not None else None
    start = time.perf_counter()
    trainer.step()
    returned = time.perf_counter()
    if cuda:
        torch.cuda.synchronize()
        if counts is not None:
            allocs.append([b - a for a, b in zip(counts, device_allocs())])
    waited = _waits.seconds if _waits is not None else 0.0
    if host is not None:
        host.append((returned - start - waited) * 1e3)
    if waits is not None:
        waits.append(waited * 1e3)
    if collected is not None and collections is not None:
        collected.append(round(_collected.since(collections)[1] * 1e3, 3))
    return (time.perf_counter() - start) * 1e3


def device_allocs() -> tuple[int, int]:
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
            timed_step(trainer, cuda, host)
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
                timed_step(trainer, cuda, host)
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


@contextlib.contextmanager
def switched_off(trainer):
    """The trainer's recompute and offload both off for the block: it runs as ``recompute=none
    offload=none`` builds the model, with the same weights and allocator."""
    from recipes.build.offload import offload_paused
    from recipes.measure.labels import recompute_disabled

    with recompute_disabled(trainer.chunks, trainer.config), offload_paused(trainer.offloading):
        yield
