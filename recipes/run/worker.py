"""The training worker: one process per rank, started by the controller through torchrun.

It reads the frozen, resolved config the controller wrote (``RUN_DIR/config.yaml``) and never runs
Hydra. Order of work: distributed init -> model -> optimizer -> ``train.train_iters`` steps: the
first records the activation ledger; the window ``measure.start_step`` .. ``+ measure.steps - 1``
is timed step by step (the only per-step device synchronization), and at its end come the profiled
step (``profile=peak``) and the in-run control ledger (labels switched off; see
``control_ledgers``); the rest trains -> this rank's measurements, written atomically to
``RUN_DIR/ranks/rank<N>.json``. An OOM or crash writes a rank file with status ``oom``/``failed``
and the error, so the controller can always record the point.

    python -m torch.distributed.run --standalone --nproc_per_node 1 -m recipes.run.worker RUN_DIR
"""

from __future__ import annotations

if __name__ == "__main__":  # first, before torch's imports (seconds): die with torchrun or the controller
    from launch.process import die_with_parent

    die_with_parent()

import os
import signal
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from launch.affinity import pin_worker
from launch.torchrun import set_one_rank_env
from recipes.analyze.logger import NullRun, WandbRun, open_run, read_identity
from recipes.build import compat, upstream
from recipes.build.model import num_parameters
from recipes.build.parallel import pipeline_report
from recipes.data.indexed import check_tokenizer
from recipes.errors import ConfigError
from recipes.files import GIB, write_json_atomic
from recipes.measure.collections import collection_findings, window_record
from recipes.measure.flops import step_flops
from recipes.measure.labels import LabelError, check_resolved, label_findings, resolve_labels
from recipes.measure.moduletime import time_modules
from recipes.measure.offload import ReloadWaits, copy_overlap, host_link_bandwidth
from recipes.measure.profile import profile_step
from recipes.measure.routing import RoutingRecorder
from recipes.measure.steptrace import trace_step
from recipes.offload import modules_of
from recipes.recompute import labels_of
from recipes.recompute import option_of as recompute_option
from recipes.results import merge_result
from recipes.run.checkpoint import checkpoint_root, find_resume, load_checkpoint, save_checkpoint
from recipes.run.collector import ManualCollection
from recipes.run.progress import Progress, say
from recipes.run.schedule import current_lr
from recipes.run.trainer import Trainer

#: What the measured window put into a rank's result: a checkpoint taken after the window carries
#: it, so a run resumed past the window still writes the same result.json.
MEASURED_KEYS = ("window", "setup_s", "ledger", "pipeline", "checkpoints", "timing", "memory", "profile",
                 "trace", "offload", "module_times", "moe_routing", "_ledger_warnings")


def init_distributed(cfg: dict, marks: dict | None = None) -> None:
    """torch.distributed from torchrun's environment, then megatron's parallel state.

    ``marks`` (the rank's timeline) gets when each part ended: on the H200 this "init" phase took
    8-14 s of a sweep point's 18-25 s, the largest fixed cost, so it is split to show which part.
    """
    marks = {} if marks is None else marks
    # lazy: megatron's import is timed as its own phase (megatron_imported); the console shows it
    from megatron.core import parallel_state

    upstream.apply_all()  # imports megatron's transformer, MoE and optimizer modules
    marks["megatron_imported"] = time.time()
    if compat.cuda_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.init()  # the CUDA context now, so the next mark is the process group alone
    compat.install_cpu_compat()
    marks["device_ready"] = time.time()
    if not torch.distributed.is_initialized():
        backend = "nccl" if compat.cuda_available() else "gloo"
        torch.distributed.init_process_group(backend=backend)
    marks["process_group_ready"] = time.time()
    par = cfg["parallel"]
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=par["tensor_model_parallel_size"],
        pipeline_model_parallel_size=par["pipeline_model_parallel_size"],
        virtual_pipeline_model_parallel_size=par["virtual_pipeline_model_parallel_size"],
        context_parallel_size=par["context_parallel_size"],
        expert_model_parallel_size=par["expert_model_parallel_size"],
        expert_tensor_parallel_size=par["expert_tensor_parallel_size"],
    )
    # As Megatron-LM does: each pipeline stage draws its own weights (seed + 100 * pp rank).
    compat.seed_model_parallel_rng(cfg["train"]["seed"] + 100 * parallel_state.get_pipeline_model_parallel_rank(),
                                   cudagraphable=cfg["model"].get("cuda_graph_impl", "none") == "local")


def init_one_rank(cfg: dict) -> None:
    """A one-rank world in this process, for benchmarks and tests that build a Trainer without a launcher."""
    set_one_rank_env()
    init_distributed(cfg)


def rank_coordinates() -> dict:
    """This rank's place in every parallel dimension."""
    from megatron.core import parallel_state as ps

    return {
        "rank": torch.distributed.get_rank(),
        "tp": ps.get_tensor_model_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "cp": ps.get_context_parallel_rank(),
        "ep": ps.get_expert_model_parallel_rank(),
        "dp": ps.get_data_parallel_rank(),
    }


class StopSignal:
    """SIGTERM and SIGUSR1 (Slurm's warning before the time limit, a preemption) set a flag; the
    training loop saves a checkpoint at the next step boundary and stops (status ``preempted``).

    With several ranks the flag is agreed over a gloo group (a CPU all-reduce: no device sync), so
    every rank stops at the same step even when only some received the signal."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.received: str | None = None
        self._group = None

    def install(self) -> StopSignal:
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def connect(self) -> None:
        """After the process group exists (every rank calls it): the group the flag is agreed on."""
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            self._group = torch.distributed.new_group(backend="gloo")

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        self.received = signal.Signals(signum).name

    def requested(self) -> str | None:
        """The signal's name once any rank has received one, else None (call it on every rank)."""
        if self._group is None:
            return self.received
        flag = torch.tensor([0 if self.received is None else self.SIGNALS.index(
            signal.Signals[self.received]) + 1])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self._group)
        return self.SIGNALS[int(flag) - 1].name if int(flag) else None


#: One per worker process; ``main`` installs it before the model is built.
STOP = StopSignal()


def _sync() -> None:
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


def cap_allocator(measure: dict) -> None:
    """``measure.memory_fraction`` or ``measure.memory_budget_gib``: cap PyTorch's allocator (its
    reserved memory) on this GPU; past the cap it frees its cache and retries, then raises an OOM."""
    if measure["memory_fraction"]:
        torch.cuda.set_per_process_memory_fraction(measure["memory_fraction"])
    budget = measure.get("memory_budget_gib")
    if budget:
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GIB
        if budget > total:
            raise ConfigError("measure.memory_budget_gib", f"{budget:g} GiB is more than this GPU's "
                              f"{total:.1f} GiB", f"use at most {total:.1f}, or null (no cap)")
        torch.cuda.set_per_process_memory_fraction(budget / total)


def measure_window(cfg: dict, first_step: int) -> tuple[int, int] | None:
    """The measured steps ``(start, end)`` (1-based, inclusive) of a process whose first step is
    ``first_step``, or None when the run ends before it. ``measure.start_step`` and ``measure.steps``
    place it; a resumed process past that window measures nothing (its checkpoint carries the
    measurements), and one resumed inside it measures the same number of steps after its own first."""
    train_iters, meas = cfg["train"]["train_iters"], cfg["measure"]
    start, end = meas["start_step"], meas["start_step"] + meas["steps"] - 1
    warm = warmup_steps(cfg)
    if first_step > 1 and first_step > end:
        return None
    if first_step == 1:  # a run shorter than the window measures its last step (validate refuses it)
        start = max(1 + warm, min(start, train_iters))
    if first_step + warm - 1 >= start:  # the first step of any process warms up (allocator, kernels, ledger)
        start, end = first_step + warm, first_step + warm - 1 + meas["steps"]
    end = min(end, train_iters)
    return (start, end) if start <= end else None


def warmup_steps(cfg: dict) -> int:
    """Steps a process runs before its measured window: one (allocator, kernels, and the ledger), and
    with activation offload a second, which records the ledger once megatron's offload manager has
    planned its groups in the first (its warm-up moves every group; later steps keep the last one of
    each module on the device)."""
    return 2 if modules_of(cfg) and cfg["measure"]["ledger"] else 1


class Window:
    """The measured window's state: step times, the static memory before it, the losses so far."""

    def __init__(self, span: tuple[int, int] | None):
        self.span = span
        self.times: list[float] = []
        self.static: dict = {}
        self.moved: list[dict] = []  # activation offload: what each measured step copied (OffloadMeter)
        self.collections: list[tuple[list[int], float]] = []  # Python's collections in each timed step

    def __contains__(self, step: int) -> bool:
        return self.span is not None and self.span[0] <= step <= self.span[1]


def train_and_measure(cfg: dict, result: dict, run_dir: Path | None = None,
                      logger: WandbRun | NullRun | None = None) -> Trainer:
    """Train ``train.train_iters`` steps; measure inside the window (``measure.*``); fill ``result``.
    ``logger`` (rank 0's W&B run) gets the progress metrics and the validation loss at their steps."""
    train = cfg["train"]
    if compat.cuda_available():
        cap_allocator(cfg["measure"])
    t0 = time.perf_counter()
    marks = result.setdefault("timeline", {})
    check_tokenizer(cfg)  # data.tokenizer agrees with the data (vocabulary, eod) before any compute
    trainer = Trainer(cfg)
    routing = RoutingRecorder(trainer.chunks, lambda: len(trainer.grad_norms))  # MoE: routed rows per rank
    marks["built"] = time.time()
    result["num_parameters"] = num_parameters(trainer.chunks)
    result["optimizer"] = trainer.optimizer_kind
    result["precision"] = "bf16" if trainer.config.bf16 else "fp32"
    result["memory_after_init"] = memory_now()
    labels = labels_of(cfg)
    result["labels"] = resolve_labels(trainer.chunks, labels)
    check_resolved(result["labels"])  # a label that wraps nothing is refused before training
    resume, notes = find_resume(cfg, run_dir)
    if resume is not None:
        restored = load_checkpoint(trainer, cfg, resume)
        notes += restored["notes"]
        result["resumed_from"] = {"path": str(resume), "step": restored["step"]}
        result.update(restored["measured"])
    for note in notes:
        say(f"[checkpoint] {note}")
    result["checkpoint_notes"] = notes
    first = trainer.step_count + 1
    window = Window(measure_window(cfg, first))
    ledger_step = first + warmup_steps(cfg) - 1  # with offload, once the manager has planned
    result["first_step"] = first
    if window.span or "window" not in result:
        result["window"] = list(window.span) if window.span else None
    ck = cfg["checkpoint"]
    root = checkpoint_root(cfg, run_dir) if ck["save"] else None
    logger = logger or NullRun()
    progress = Progress(cfg, trainer, first, run_dir, logger) if train["log_interval"] else None
    exit_interval = train["exit_interval"]
    result["phase"] = "before_window"
    losses: list = []  # device tensors (or None off the last stage) until the end: no host sync
    grad_norms: list = []
    lrs: list[float | None] = []  # the learning rate each step ran at
    evals: list[dict] = []
    eval_interval = cfg["data"]["eval_interval"]
    collector = ManualCollection(train).start()  # train.manual_gc: no collector pauses inside the steps
    try:
        for step in range(first, train["train_iters"] + 1):
            if step in window and step == window.span[0]:
                _sync()
                window.static = memory_now()
                if compat.cuda_available():
                    torch.cuda.reset_peak_memory_stats()
                trainer.counter.reset()
                result["phase"] = "window"
            timed = step in window
            if timed:
                _sync()
                moved = trainer.offload_meter.snapshot() if trainer.offloading else None
                collected = collector.meter.snapshot()
                started = time.perf_counter()
            lrs.append(current_lr(trainer.optimizer))
            record = step == ledger_step and window.span is not None and cfg["measure"]["ledger"]
            losses.append(trainer.train_step(record_ledger=record))
            grad_norms.append(trainer.grad_norms[-1])
            if timed:
                _sync()
                window.times.append(time.perf_counter() - started)
                window.collections.append(collector.meter.since(collected))
                if moved is not None:
                    window.moved.append(trainer.offload_meter.since(moved))
            if step == first and window.span is not None:
                _after_first_step(trainer, cfg, result, t0)
            if step == ledger_step and step != first and window.span is not None:
                _record_ledger(trainer, cfg, result)
            if window.span and step == window.span[1]:
                _measure(trainer, cfg, result, window, labels, run_dir)
                # the recorder counts this process's steps from 0 (the ledger's is its first, with offload its second)
                record_routing(routing, result, ledger_step - first if cfg["measure"]["ledger"] else None,
                               range(window.span[0] - first, window.span[1] - first + 1))
                result["phase"] = "after_window"
            collector.after_step(step)
            if eval_interval and trainer.valid_data is not None and step % eval_interval == 0:
                evals.append({"step": step, "loss": trainer.evaluate()})
                logger.log({"val/loss": evals[-1]["loss"]}, step)  # evaluate() synchronized already
            if progress is not None and (step % progress.interval == 0 or step == train["train_iters"]):
                progress.log(step, losses[-1], lrs[-1], grad_norms[-1], evals[-1] if evals else None)
            stop = None
            if step < train["train_iters"]:
                received = STOP.requested()
                if received:
                    stop = "preempted"
                    result["signal"] = received
                    say(f"[signal] {received} at step {step}: " + (
                        "saving a checkpoint, then stopping" if root is not None else "stopping (checkpoint.save=false)"))
                elif exit_interval and step % exit_interval == 0:
                    stop = "stopped"
            if root is not None and (stop or step == train["train_iters"] or (ck["interval"] and step % ck["interval"] == 0)):
                measured = {k: result[k] for k in MEASURED_KEYS if k in result} if "timing" in result else {}
                path = save_checkpoint(trainer, cfg, root, measured)
                result["checkpoint"] = {"path": str(path), "step": step}
                say(f"[checkpoint] saved step {step} to {path}")
            if stop:
                result["stopped_at"], result["stop_reason"] = step, stop
                break
    finally:
        collector.stop()
    marks["trained"] = time.time()
    result["loss"] = [None if l is None else float(l) for l in losses]
    result["grad_norm"] = [None if g is None else float(g) for g in grad_norms]  # before clipping
    result["lr"] = lrs
    if evals:
        result["eval_loss"] = evals
    result["warnings"] = (label_findings(result, labels) + result.pop("_ledger_warnings", [])
                          + collection_findings(result.get("timing")))
    if "timing" not in result:
        result["warnings"].append("nothing measured: this process started after the measured window and "
                                  "its checkpoint carried no measurements")
    result["status"] = result.get("stop_reason", "ok")
    trainer.close()
    return trainer


def _after_first_step(trainer: Trainer, cfg: dict, result: dict, t0: float) -> None:
    """The ledger of the first step (one micro-batch through every chunk) and the pipeline report."""
    _sync()
    result["timeline"]["warmed_up"] = time.time()
    result["setup_s"] = time.perf_counter() - t0
    if warmup_steps(cfg) == 1:
        _record_ledger(trainer, cfg, result)


def _record_ledger(trainer: Trainer, cfg: dict, result: dict) -> None:
    """The ledger of one micro-batch through every chunk (the step that recorded it) and the pipeline
    report; with offload also what that forward copied to the host, and the manager's plan."""
    result["ledger"] = {
        "bytes_by_kind": trainer.ledger.bytes_by_kind,
        "total_bytes": trainer.ledger.total_bytes,
    }
    if trainer.offloading:
        result["ledger"]["host_bytes_by_kind"] = trainer.ledger.host_bytes_by_kind
        result["ledger"]["host_total_bytes"] = trainer.ledger.host_total_bytes
        result["offload"] = {"modules": modules_of(cfg)}
    chunk_bytes = [l.total_bytes for l in trainer.chunk_ledgers] if cfg["measure"]["ledger"] else []
    result["pipeline"] = pipeline_report(trainer.chunks, trainer.num_microbatches, trainer.config,
                                         chunk_bytes)


def _measure(trainer: Trainer, cfg: dict, result: dict, window: Window, labels: list[str],
             run_dir: Path | None) -> None:
    """At the window's last step: timing, memory, checkpoint counts; then the profiled step and the
    in-run control ledgers (off the step count: see docs/training.md)."""
    train, marks, times = cfg["train"], result["timeline"], window.times
    steps = len(times)
    result["checkpoints"] = {
        label: {k: v // max(steps, 1) for k, v in counts.items()}
        for label, counts in trainer.counter.as_dict().items()
    }
    marks["steady_done"] = time.time()
    median = statistics.median(times)
    world = torch.distributed.get_world_size()
    flops = step_flops({**cfg, "_data_parallel_size": trainer.dp_size}, trainer.num_microbatches)
    tokens = train["micro_batch_size"] * trainer.num_microbatches * trainer.dp_size * train["seq_length"]
    peak = cfg["measure"]["peak_tflops"]
    result["timing"] = {
        "steps": steps,
        "step_time_s": median,
        "step_time_min_s": min(times),
        "step_time_max_s": max(times),
        "tokens_per_s": tokens / median,
        "model_tflops_per_gpu": flops["model"] / median / world / 1e12,
        "hardware_tflops_per_gpu": flops["hardware"] / median / world / 1e12,
        "mfu": flops["model"] / median / world / 1e12 / peak if compat.cuda_available() else None,
        "recompute_flops_fraction": flops["hardware"] / flops["model"] - 1.0,
        "gc": window_record(window.collections, bool(train["manual_gc"])),
    }
    if compat.cuda_available():
        mem, static = memory_now(), window.static
        result["memory"] = {
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
    if not trainer.offloading:  # before the profiled step: after it, the host passes read slower (docs/offload-log.md)
        _record_module_times(trainer, cfg, result, marks)
    keep = trace_path(run_dir, torch.distributed.get_rank()) if cfg["measure"]["trace_step"] and run_dir else None
    if trainer.offloading:
        result.setdefault("offload", {"modules": modules_of(cfg)})
        result["offload"].update(offload_measurements(trainer, window, median, result, keep))
    elif (cfg["measure"]["trace_step"] or cfg["measure"]["gpu_time"] is not False) and trainer.on_gpu:
        try:  # one more step, off the step count; for the GPU's time alone, without the host's events
            result["trace"] = trace_step(trainer.step, keep, host=bool(cfg["measure"]["trace_step"]))
        except Exception as err:  # the profiler (CUPTI) unavailable, or an OOM in the extra step
            result["trace"] = failed_measurement(err)
        finally:
            trainer.optimizer.zero_grad()
    if cfg["measure"]["profile"] != "none":
        result["profile"] = profile_step(trainer, cfg, run_dir, step_time_s=median)
    marks["profile_done"] = time.time()
    if labels and cfg["measure"]["ledger"]:
        result["_ledger_warnings"] = control_ledgers(trainer, labels, result, run_dir)
    marks["ledgers_done"] = time.time()
    if trainer.offloading:  # as measured on 2026-12-03: after the offload measurements' step
        _record_module_times(trainer, cfg, result, marks)


def _record_module_times(trainer: Trainer, cfg: dict, result: dict, marks: dict) -> None:
    """``result["module_times"]`` where the run times its modules (``times_modules``)."""
    if times_modules(cfg, trainer.on_gpu):
        try:
            result["module_times"] = time_modules(trainer, marks=prices_others(cfg))
        except Exception as err:  # an OOM in the extra pass: the run's own measurements stand
            result["module_times"] = failed_measurement(err)
        marks["modules_timed"] = time.time()


def times_modules(cfg: dict, on_gpu: bool) -> bool:
    """Whether the run times its layers' modules (``measure.module_times``; null: on a GPU, eager)."""
    wanted = cfg["measure"]["module_times"]
    return bool(wanted) if wanted is not None else on_gpu and cfg["model"]["compile"] == "none"


def prices_others(cfg: dict) -> bool:
    """Whether the point is one the planner prices the others from (no replay, no offload): only its
    module times record the step's timeline (``recipes.measure.moduletime.timeline``: three more passes)."""
    return recompute_option(cfg) in ("none", "control") and not modules_of(cfg)


def failed_measurement(err: Exception) -> dict:
    """An extra measurement that failed, recorded in its place (the run's own measurements stand)."""
    return {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}


def trace_path(run_dir: Path, rank: int) -> Path:
    return run_dir / ("step_trace.json.gz" if rank == 0 else f"step_trace_rank{rank}.json.gz")


def offload_measurements(trainer: Trainer, window: Window, step_time_s: float, result: dict,
                         keep: Path | None = None) -> dict:
    """What offload moved per measured step (the median step's counts: bytes and tensors each way, and
    the groups moved and kept per module, summed over the step's micro-batches) and, on a GPU, the host link's
    bandwidth, one extra step timing where compute waited for each reload (``reload_wait_s``, the
    stall; ``ReloadWaits``) and one profiled for how much of the copying compute did not hide (its whole
    step summary into ``result["trace"]``)."""
    median = window.moved[len(window.moved) // 2] if window.moved else {}
    moved = dict(median)
    out = {"groups_moved": moved.pop("groups_moved", {}), "groups_kept": moved.pop("groups_kept", {}),
           "moved_per_step": moved, "moved_steps_equal": all(m == median for m in window.moved)}
    if trainer.on_gpu:  # measurements about the run, not of it: a failure is recorded, not raised
        try:  # one more step, off the step count, unprofiled: the profiler slows the forward copies hide under
            with ReloadWaits() as waits:
                trainer.step()
            out["reload_waits"], out["reload_wait_s"] = waits.count, waits.seconds()
        except Exception as err:  # e.g. an OOM in the extra step
            out["reload_wait_s"] = failed_measurement(err)
        finally:
            trainer.optimizer.zero_grad()
        try:  # first: the link test empties the allocator's cache, which the traced step would refill
            overlap, result["trace"] = copy_overlap(trainer.step, keep)  # one more step, off the step count
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


def record_routing(routing: RoutingRecorder, result: dict, ledger_step: int | None, timed: range) -> None:
    """MoE: the rows routed to this rank's experts (``recipes.measure.routing``) at the ledger's
    micro-batch (the run's first step) and per measured step (0-based), into ``result["moe_routing"]``;
    then unhooked."""
    if routing:
        result["moe_routing"] = routing.summary(ledger_step, timed)
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


def control_ledgers(trainer: Trainer, labels: list[str], result: dict, run_dir: Path | None = None) -> list[str]:
    """The matched control inside this run: the same micro-batch with the labels switched off (and,
    for several labels, each one alone off), recorded into ``result["ledger"]``.

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
        result["ledger"]["control_bytes_by_kind"] = control
        result["ledger"]["control_total_bytes"] = sum(control.values())
        alone = {l: sum(trainer.ledger_pass([l]).values()) for l in labels} if len(labels) > 1 else {}
        result["ledger"]["without_label_total_bytes"] = alone
        return []
    except Exception as err:  # an OOM here; with several ranks also a peer lost in the pass's collectives
        if not is_oom(err) and world == 1:
            raise
        result["control_abandoned"] = world > 1
        first = (str(err).splitlines() or [""])[0]
        if is_oom(err):
            result["ledger"]["control_error"] = f"oom: {first}"
            return [CONTROL_OOM_WARNING]
        result["ledger"]["control_error"] = f"interrupted: {type(err).__name__}: {first}"
        return [CONTROL_INTERRUPTED_WARNING]
    finally:
        trainer.optimizer.zero_grad()
        if compat.cuda_available():
            torch.cuda.empty_cache()


def provisional_result(result: dict, labels: list[str], run_dir: Path | None) -> None:
    """This rank's result before the control pass, as it would be written if the pass never ends
    here (another rank's ran out of memory): ok, with its measurements and the warning that says so."""
    if run_dir is None:
        return
    rank = torch.distributed.get_rank()
    ledger = {**result["ledger"], "control_error": "interrupted: another rank's control pass ran out of memory"}
    draft = {**result, "ledger": ledger, "status": "ok",
             "warnings": label_findings({**result, "ledger": ledger}, labels) + [CONTROL_INTERRUPTED_WARNING]}
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


def main(run_dir: str, exiting: bool = False) -> int:
    """One rank's run: train, measure, write ``RUN_DIR/ranks/rank<N>.json``; returns the exit code.
    ``exiting``: the process ends right after (``serve``), so a one-process group is not torn down."""
    from omegaconf import OmegaConf

    run = Path(run_dir)
    cfg = OmegaConf.to_container(OmegaConf.load(run / "config.yaml"), resolve=True)
    rank = int(os.environ.get("RANK", 0))
    result: dict[str, Any] = {"rank": rank, "status": "failed", "host": socket.gethostname()}
    result["device"] = torch.cuda.get_device_name() if compat.cuda_available() else "cpu"
    result["timeline"] = {"main_start": time.time()}
    cores = pin_worker(cfg["launcher"].get("cpu_cores_per_rank"))  # before the threads it starts
    if cores is not None:
        result["cpu_cores"] = cores
        torch.set_num_threads(len(cores))  # no more CPU threads than its cores, whatever OMP_NUM_THREADS says
    exit_code = 0
    logger = open_run(cfg, run, rank, resuming=resumes(cfg, run))  # logger=wandb, rank 0; else a no-op twin
    if logger:
        result["timeline"]["logger_ready"] = time.time()
    try:
        STOP.install()  # before the slow part: a signal during start-up stops after the first step
        init_distributed(cfg, result["timeline"])
        STOP.connect()
        result["timeline"]["distributed_ready"] = time.time()
        result["coords"] = rank_coordinates()
        train_and_measure(cfg, result, run, logger=logger)
        if result.pop("control_abandoned", False):
            exit_code = CONTROL_ABANDONED  # ok, written below; the other ranks may wait in that pass
    except (LabelError, ConfigError) as err:  # a label that wraps nothing; a checkpoint of another model
        result.update(status="refused", error=str(err))
        exit_code = 2
    except Exception as err:  # recorded, never lost: the sweep goes on
        if is_oom(err):
            first = next((l for l in str(err).splitlines() if "memory" in l or "calloc" in l), str(err))
            result.update(status="oom", error=first.strip(), memory_at_failure=memory_now())
            exit_code = 3
        else:
            result.update(status="failed", error=f"{type(err).__name__}: {err}")
            result["traceback"] = traceback.format_exc(limit=20)
            exit_code = 1
    write_json_atomic(run / "ranks" / f"rank{rank}.json", result)
    if exit_code == CONTROL_ABANDONED:
        print(f"[rank {rank}] ok, but its in-run control ledger ran out of memory: leaving now so that no rank "
              "waits in that pass (torchrun stops the others; their results are written)", file=sys.stderr)
    elif exit_code:
        print(f"[rank {rank}] {result['status']}: {result.get('error')}", file=sys.stderr)
    if torch.distributed.is_initialized() and exit_code == 0:
        torch.distributed.barrier()  # every rank's file is written: rank 0's W&B summary has them all
        # NCCL's teardown of even a one-rank group took 1.5 s on the H200 (a sweep point's exit); with no
        # other rank to leave in step with, the process's end frees it
        if not (exiting and torch.distributed.get_world_size() == 1):
            torch.distributed.destroy_process_group()
    if logger:
        ok = result["status"] in ("ok", "stopped", "preempted")
        logger.finish(run_summary(run, cfg), 0 if ok else exit_code)
    return exit_code


def resumes(cfg: dict, run_dir: Path) -> bool:
    """Whether this process will continue a checkpoint (then its W&B run continues the earlier one)."""
    try:
        return find_resume(cfg, run_dir)[0] is not None
    except Exception:  # a bad checkpoint.resume is refused later, by train_and_measure
        return False


def run_summary(run_dir: Path, cfg: dict) -> dict:
    """The run as the controller will record it (the rank files written so far, merged), for rank 0's W&B
    summary: every rank's memory, the worst rank's numbers, the status."""
    identity = read_identity(run_dir)
    meta = {"name": identity.get("name"), "choices": identity.get("choices") or {}, "run_dir": str(run_dir),
            "config": cfg}
    return merge_result(run_dir, meta, 0, None)


def serve(run_dir: str) -> None:
    """A worker process's whole life: ``main``, then exit. Run as ``python -m recipes.run.worker RUN_DIR``
    (torchrun, or the controller for one process) or in a child of ``launch.forkserver`` (sweep points of
    one process, megatron already imported). Never returns."""
    code = main(run_dir, exiting=True)
    import multiprocessing

    for child in multiprocessing.active_children():  # dist_checkpointing's result-queue manager
        child.terminate()
    # The results are written (atomically) and the ranks past their last barrier: skip the interpreter's
    # teardown of torch/megatron (about a second per sweep point, and sweeps run many points).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    serve(sys.argv[1])
