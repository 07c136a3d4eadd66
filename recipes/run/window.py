"""The measured window of a rank's run: which steps it covers (``measure.start_step``,
``measure.steps``), and what the rank records at its first step, inside the window and at its end:
the activation ledger and its in-run controls, timing and memory, the profiled step, activation
offload's copies, module times, MoE routing. ``MEASURED_KEYS`` names what it records, which a
checkpoint carries, so a run resumed past its window writes the same result.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch

from recipes.build import compat
from recipes.build.parallel import pipeline_report
from recipes.config import typed
from recipes.files import GIB, write_json_atomic
from recipes.measure.collections import window_record
from recipes.measure.flops import step_flops
from recipes.measure.labels import label_findings
from recipes.measure.moduletime import note_host_wait, time_modules
from recipes.measure.offload import CopyTimeline, copy_overlap, host_link_bandwidth
from recipes.measure.profile import profile_step
from recipes.measure.routing import RoutingRecorder
from recipes.measure.steptrace import trace_step
from recipes.offload import modules_of
from recipes.recompute import option_of as recompute_option
from recipes.results import RankResult
from recipes.run.trainer import Trainer

#: What the measured window put into a rank's result (``RankResult``, by their keys in the file): a
#: checkpoint taken after the window carries it, so a run resumed past the window still writes the
#: same result.json.
MEASURED_KEYS = ("window", "setup_s", "ledger", "pipeline", "checkpoints", "timing", "memory", "profile",
                 "trace", "offload", "module_times", "moe_routing", "_ledger_warnings")



def sync() -> None:
    if compat.cuda_available():
        torch.cuda.synchronize()



def memory_now() -> dict:
    """The allocator's numbers now (GPU only)."""
    if not compat.cuda_available():
        return {}
    return {
        "allocated_gib": torch.cuda.memory_allocated() / GIB,
        "reserved_gib": torch.cuda.memory_reserved() / GIB,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
    }



def measure_window(cfg: dict, first_step: int) -> tuple[int, int] | None:
    """The measured steps ``(start, end)`` (1-based, inclusive) of a process whose first step is
    ``first_step``, or None when the run ends before it. ``measure.start_step`` and ``measure.steps``
    place it; a resumed process past that window measures nothing (its checkpoint carries the
    measurements), and one resumed inside it measures the same number of steps after its own first."""
    cfg = typed(cfg)
    train_iters, meas = cfg.train.train_iters, cfg.measure
    start, end = meas.start_step, meas.start_step + meas.steps - 1
    warm = warmup_steps(cfg)
    if first_step > 1 and first_step > end:
        return None
    if first_step == 1:  # a run shorter than the window measures its last step (validate refuses it)
        start = max(1 + warm, min(start, train_iters))
    if first_step + warm - 1 >= start:  # the first step of any process warms up (allocator, kernels, ledger)
        start, end = first_step + warm, first_step + warm - 1 + meas.steps
    end = min(end, train_iters)
    return (start, end) if start <= end else None



def warmup_steps(cfg: dict) -> int:
    """Steps a process runs before its measured window: one (allocator, kernels, and the ledger), and
    with activation offload a second, which records the ledger once megatron's offload manager has
    planned its groups in the first (its warm-up moves every group; later steps keep the last one of
    each module on the device)."""
    cfg = typed(cfg)
    return 2 if modules_of(cfg) and cfg.measure.ledger else 1



class Window:
    """The measured window's state: step times, the static memory before it, the losses so far."""

    def __init__(self, span: tuple[int, int] | None):
        self.span = span
        self.times: list[float] = []
        self.static: dict = {}
        self.moved: list[dict] = []  # activation offload: what each measured step copied (OffloadMeter)
        self.collections: list[tuple[list[int], float]] = []  # Python's collections in each timed step
        self.host: list[tuple[float, float]] = []  # each timed step's host work and host wait (s: ItemWaits)

    def __contains__(self, step: int) -> bool:
        return self.span is not None and self.span[0] <= step <= self.span[1]



def after_first_step(trainer: Trainer, cfg: dict, result: RankResult, t0: float) -> None:
    """The ledger of the first step (one micro-batch through every chunk) and the pipeline report."""
    cfg = typed(cfg)
    sync()
    result.timeline["warmed_up"] = time.time()
    result.setup_s = time.perf_counter() - t0
    if warmup_steps(cfg) == 1:
        record_ledger(trainer, cfg, result)



def record_ledger(trainer: Trainer, cfg: dict, result: RankResult) -> None:
    """The ledger of one micro-batch through every chunk (the step that recorded it) and the pipeline
    report; with offload also what that forward copied to the host, and the manager's plan."""
    cfg = typed(cfg)
    result.ledger = {
        "bytes_by_kind": trainer.ledger.bytes_by_kind,
        "total_bytes": trainer.ledger.total_bytes,
    }
    if trainer.offloading:
        result.ledger["host_bytes_by_kind"] = trainer.ledger.host_bytes_by_kind
        result.ledger["host_total_bytes"] = trainer.ledger.host_total_bytes
        result.offload = {"modules": modules_of(cfg)}
    chunk_bytes = [l.total_bytes for l in trainer.chunk_ledgers] if cfg.measure.ledger else []
    result.pipeline = pipeline_report(trainer.chunks, trainer.num_microbatches, trainer.config, chunk_bytes)



def record_window(trainer: Trainer, cfg: dict, result: RankResult, window: Window, labels: list[str],
             run_dir: Path | None) -> None:
    """At the window's last step: timing, memory, checkpoint counts; then the profiled step and the
    in-run control ledgers (off the step count: see docs/training.md)."""
    cfg = typed(cfg)
    train, marks, times = cfg.train, result.timeline, window.times
    steps = len(times)
    result.checkpoints = {
        label: {k: v // max(steps, 1) for k, v in counts.items()}
        for label, counts in trainer.counter.as_dict().items()
    }
    marks["steady_done"] = time.time()
    median = statistics.median(times)
    world = torch.distributed.get_world_size()
    flops = step_flops({**cfg, "_data_parallel_size": trainer.dp_size}, trainer.num_microbatches)
    tokens = train.micro_batch_size * trainer.num_microbatches * trainer.dp_size * train.seq_length
    peak = cfg.measure.peak_tflops
    result.timing = {
        "steps": steps,
        "step_time_s": median,
        "step_time_min_s": min(times),
        "step_time_max_s": max(times),
        "tokens_per_s": tokens / median,
        "model_tflops_per_gpu": flops["model"] / median / world / 1e12,
        "hardware_tflops_per_gpu": flops["hardware"] / median / world / 1e12,
        "mfu": flops["model"] / median / world / 1e12 / peak if compat.cuda_available() else None,
        "recompute_flops_fraction": flops["hardware"] / flops["model"] - 1.0,
        "gc": window_record(window.collections, bool(train.manual_gc)),
        **host_timing(window.host),
    }
    if compat.cuda_available():
        mem, static = memory_now(), window.static
        result.memory = {
            "peak_allocated_gib": mem["peak_allocated_gib"],
            "peak_reserved_gib": mem["peak_reserved_gib"],
            "static_allocated_gib": static["allocated_gib"],
            "activation_gib": mem["peak_allocated_gib"] - static["allocated_gib"],
            "fragmentation_gib": mem["peak_reserved_gib"] - mem["peak_allocated_gib"],
            "total_gib": torch.cuda.get_device_properties(0).total_memory / GIB,
            # times the allocator found the device (or its cap) full, freed its cache and retried: then
            # the reserved peak measures the memory there was, not what the run needed
            "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0),
        }
    if not trainer.offloading:  # before the profiled step: after it, the host passes read slower (docs/offload.md)
        record_module_times(trainer, cfg, result, marks)
        # under pipeline parallelism the host also waits for its neighbours' sends, a margin this wait
        # does not see, so none is given there
        if "host_wait_s" in result.timing and cfg.parallel.pipeline_model_parallel_size == 1:
            note_host_wait(result.module_times, result.timing["host_wait_s"] * 1e3)
    keep = trace_path(run_dir, torch.distributed.get_rank()) if cfg.measure.trace_step and run_dir else None
    if trainer.offloading:
        if result.offload is None:
            result.offload = {"modules": modules_of(cfg)}
        result.offload.update(offload_measurements(trainer, window, median, result, keep))
    elif (cfg.measure.trace_step or cfg.measure.gpu_time is not False) and trainer.on_gpu:
        try:  # one more step, off the step count; for the GPU's time alone, without the host's events
            result.trace = trace_step(trainer.step, keep, host=bool(cfg.measure.trace_step))
        except Exception as err:  # the profiler (CUPTI) unavailable, or an OOM in the extra step
            result.trace = failed_measurement(err)
        finally:
            trainer.optimizer.zero_grad()
    if cfg.measure.profile != "none":
        result.profile = profile_step(trainer, cfg, run_dir, step_time_s=median)
    marks["profile_done"] = time.time()
    if labels and cfg.measure.ledger:
        result.ledger_warnings = control_ledgers(trainer, labels, result, run_dir)
    marks["ledgers_done"] = time.time()
    if trainer.offloading:  # as measured: after the offload measurements' step
        record_module_times(trainer, cfg, result, marks)



def host_timing(host: list[tuple[float, float]]) -> dict:
    """The measured steps' host side (medians, s): ``host_work_s``, the host's time to issue a step
    (until it returned, less its waits in ``Tensor.item``), and ``host_wait_s``, its wait where
    megatron reads the grad norm, once a step. A wait near 0 means the host never got ahead of the GPU:
    the step is host-bound, and host work that a recompute or an offload adds shows in it; a dense
    h200 step's host waited 89-123 ms, an MoE step's 27-29 (one H200, docs/offload.md)."""
    if not host:
        return {}
    return {"host_work_s": statistics.median(w for w, _ in host), "host_wait_s": statistics.median(t for _, t in host)}



def record_module_times(trainer: Trainer, cfg: dict, result: RankResult, marks: dict) -> None:
    """``result.module_times`` where the run times its modules (``times_modules``)."""
    cfg = typed(cfg)
    if times_modules(cfg, trainer.on_gpu):
        try:
            result.module_times = time_modules(trainer, marks=prices_others(cfg))
        except Exception as err:  # an OOM in the extra pass: the run's own measurements stand
            result.module_times = failed_measurement(err)
        marks["modules_timed"] = time.time()



def times_modules(cfg: dict, on_gpu: bool) -> bool:
    """Whether the run times its layers' modules (``measure.module_times``; null: on a GPU, eager)."""
    cfg = typed(cfg)
    wanted = cfg.measure.module_times
    return bool(wanted) if wanted is not None else on_gpu and cfg.model.compile == "none"



def prices_others(cfg: dict) -> bool:
    """Whether the point is one the planner prices the others from (no replay, no offload): only its
    module times record the step's timeline (``recipes.measure.moduletime.timeline``: three more passes)."""
    cfg = typed(cfg)
    return recompute_option(cfg) in ("none", "control") and not modules_of(cfg)



def failed_measurement(err: Exception) -> dict:
    """An extra measurement that failed, recorded in its place (the run's own measurements stand)."""
    return {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}



def trace_path(run_dir: Path, rank: int) -> Path:
    return run_dir / ("step_trace.json.gz" if rank == 0 else f"step_trace_rank{rank}.json.gz")



def offload_measurements(trainer: Trainer, window: Window, step_time_s: float, result: RankResult,
                         keep: Path | None = None) -> dict:
    """What offload moved per measured step (the median step's counts: bytes and tensors each way, and
    the groups moved and kept per module, summed over the step's micro-batches) and, on a GPU, the host link's
    bandwidth, one extra step timing each group's copies and where compute waited for each reload
    (``CopyTimeline``: ``reload_wait_s``, the stall; ``copies``, the rate the copies ran at in the step)
    and one profiled for how much of the copying compute did not hide (its whole step summary into
    ``result.trace``)."""
    median = window.moved[len(window.moved) // 2] if window.moved else {}
    moved = dict(median)
    out = {"groups_moved": moved.pop("groups_moved", {}), "groups_kept": moved.pop("groups_kept", {}),
           "moved_per_step": moved, "moved_steps_equal": all(m == median for m in window.moved)}
    if trainer.on_gpu:  # measurements about the run, not of it: a failure is recorded, not raised
        try:  # one more step, off the step count, unprofiled: the profiler slows the forward copies hide under
            with CopyTimeline() as clock:
                trainer.step()
            out.update(clock.summary())
        except Exception as err:  # e.g. an OOM in the extra step
            out["reload_wait_s"] = failed_measurement(err)
        finally:
            trainer.optimizer.zero_grad()
        try:  # first: the link test empties the allocator's cache, which the traced step would refill
            overlap, result.trace = copy_overlap(trainer.step, keep)  # one more step, off the step count
            overlap["step_time_s"] = step_time_s
        except Exception as err:  # the profiler (CUPTI) unavailable, or an OOM in the extra step
            overlap = failed_measurement(err)
        finally:
            trainer.optimizer.zero_grad()
        out["transfer"] = overlap
        try:
            out["link"] = host_link_bandwidth()
        except Exception as err:  # e.g. no room for the 256 MiB test buffers at the memory's edge
            out["link"] = failed_measurement(err)
    return out



def record_routing(routing: RoutingRecorder, result: RankResult, ledger_step: int | None, timed: range) -> None:
    """MoE: the rows routed to this rank's experts (``recipes.measure.routing``) at the ledger's
    micro-batch (the run's first step) and per measured step (0-based), into ``result.moe_routing``;
    then unhooked."""
    if routing:
        result.moe_routing = routing.summary(ledger_step, timed)
    routing.close()



#: The worker's exit code when its in-run control ledger ran out of memory in a multi-rank run: its
#: result is written and ok, but the other ranks may be waiting in a collective of that pass, so it
#: exits at once (non-zero: torchrun then stops the others, whose provisional results stand).
CONTROL_ABANDONED = 5



CONTROL_OOM_WARNING = ("the in-run control ledger (these labels switched off) ran out of memory: this option's "
                       "measurements stand; compare against the sweep's control point or `python -m recipes estimate`")



CONTROL_INTERRUPTED_WARNING = (
    "the in-run control ledger did not complete on this rank: another rank's pass ran out of memory and "
    "the run was stopped there (so no rank waits forever in that pass's collectives); this option's "
    "measurements stand; compare against the sweep's control point or `python -m recipes estimate`")



def control_ledgers(trainer: Trainer, labels: list[str], result: RankResult, run_dir: Path | None = None) -> list[str]:
    """The matched control inside this run: the same micro-batch with the labels switched off (and,
    for several labels, each one alone off), recorded into ``result.ledger``.

    These passes run after the timed steps (and the profiled step), for two reasons: without
    recompute the step may not fit, which is often why the user recomputes (at ``size=h200_long``
    the dense control needs about 150 GiB), and such an OOM must not cost the run its
    measurements; and the allocator would otherwise keep the larger pass's blocks cached, so the
    timed steps' reserved peak (the fragmentation verdict) would read the control's, not this
    option's. An OOM here leaves the control bytes unset; the returned warning says where to look.

    With several ranks a pass is a whole forward and backward with the layout's collectives, so an
    OOM on one rank leaves the others waiting inside it (two H200s, ``ep2``: the point hung until
    the machine was returned). So first every rank writes its result as it stands (``provisional_result``)
    and all meet at a barrier; a rank whose pass runs out of memory then records it and leaves
    (``control_abandoned``: exit code ``CONTROL_ABANDONED``), and torchrun stops the others, whose
    provisional results, warning included, are their record.
    """
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if world > 1:
        provisional_result(result, labels, run_dir)
        torch.distributed.barrier()
    try:
        injected_control_oom()
        control = trainer.ledger_pass(labels)
        result.ledger["control_bytes_by_kind"] = control
        result.ledger["control_total_bytes"] = sum(control.values())
        alone = {l: sum(trainer.ledger_pass([l]).values()) for l in labels} if len(labels) > 1 else {}
        result.ledger["without_label_total_bytes"] = alone
        return []
    except Exception as err:  # an OOM here; with several ranks also a peer lost in the pass's collectives
        if not is_oom(err) and world == 1:
            raise
        result.control_abandoned = world > 1
        first = (str(err).splitlines() or [""])[0]
        if is_oom(err):
            result.ledger["control_error"] = f"oom: {first}"
            return [CONTROL_OOM_WARNING]
        result.ledger["control_error"] = f"interrupted: {type(err).__name__}: {first}"
        return [CONTROL_INTERRUPTED_WARNING]
    finally:
        trainer.optimizer.zero_grad()
        if compat.cuda_available():
            torch.cuda.empty_cache()



def provisional_result(result: RankResult, labels: list[str], run_dir: Path | None) -> None:
    """This rank's result before the control pass, as it would be written if the pass never ends
    here (another rank's ran out of memory): ok, with its measurements and the warning that says so."""
    if run_dir is None:
        return
    rank = torch.distributed.get_rank()
    ledger = {**result.ledger, "control_error": "interrupted: another rank's control pass ran out of memory"}
    written = result.as_dict()
    draft = {**written, "ledger": ledger, "status": "ok",
             "warnings": label_findings({**written, "ledger": ledger}, labels) + [CONTROL_INTERRUPTED_WARNING]}
    write_json_atomic(Path(run_dir) / "ranks" / f"rank{rank}.json", draft)



def injected_control_oom() -> None:
    """Test hook (CPU tests of a multi-rank OOM): ``RECIPES_TEST_CONTROL_OOM_RANK=<rank>`` makes that
    rank's control pass raise the OOM a GPU would."""
    target = os.environ.get("RECIPES_TEST_CONTROL_OOM_RANK")
    if target is not None and torch.distributed.is_initialized() and int(target) == torch.distributed.get_rank():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (injected: "
                                     "RECIPES_TEST_CONTROL_OOM_RANK)")



def is_oom(err: BaseException) -> bool:
    """An allocation failure, also when it surfaces through NCCL (``DistBackendError: ... Failed to
    CUDA calloc``, as the dense control did at size=h200_long on the H200) rather than as
    ``torch.OutOfMemoryError``."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    text = str(err)
    return type(err).__name__ == "DistBackendError" and any(
        s in text for s in ("Failed to CUDA calloc", "Failed to CUDA malloc", "out of memory"))
