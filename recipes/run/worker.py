"""The training worker: one process per rank, started by the controller through torchrun.

It reads the frozen, resolved config the controller wrote (``RUN_DIR/config.yaml``) and never runs
Hydra. Order of work: distributed init -> model -> optimizer -> ``train.train_iters`` steps: the
first records the activation ledger; the window ``measure.start_step`` .. ``+ measure.steps - 1``
is timed step by step (the only per-step device synchronization), and at its end come the profiled
step (``profile=peak``) and the in-run control ledger (labels switched off; see
``recipes.run.window``); the rest trains -> this rank's measurements, written atomically to
``RUN_DIR/ranks/rank<N>.json``. An OOM or crash writes a rank file with status ``oom``/``failed``
and the error, so the controller can always record the point.

    python -m torch.distributed.run --standalone --nproc_per_node 1 -m recipes.run.worker RUN_DIR
"""

from __future__ import annotations

from recipes.config import as_dict, typed

if __name__ == "__main__":  # first, before torch's imports (seconds): die with torchrun or the controller
    from launch.process import die_with_parent

    die_with_parent()

import contextlib
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from launch.affinity import pin_worker
from launch.process import PREEMPT_SIGNALS
from recipes.analyze.logger import NullRun, WandbRun, open_run, read_identity
from recipes.build import compat
from recipes.build.model import num_parameters
from recipes.data.indexed import check_tokenizer
from recipes.errors import ConfigError
from recipes.files import GIB, write_json_or_fallback
from recipes.measure.collections import collection_findings
from recipes.measure.labels import LabelError, check_resolved, label_findings, resolve_labels
from recipes.measure.routing import RoutingRecorder
from recipes.measure.syncs import ItemWaits
from recipes.recompute import labels_of
from recipes.results import RankResult, merge_result
from recipes.run.checkpoint import checkpoint_root, find_resume, load_checkpoint, save_checkpoint
from recipes.run.collector import ManualCollection
from recipes.run.progress import Progress, say
from recipes.run.schedule import current_lr
from recipes.run.trainer import Trainer
from recipes.run.window import (
    CONTROL_ABANDONED,
    MEASURED_KEYS,
    Window,
    after_first_step,
    is_oom,
    measure_window,
    memory_now,
    record_ledger,
    record_routing,
    record_window,
    sync,
    warmup_steps,
)
from recipes.run.world import init_distributed, rank_coordinates


class StopSignal:
    """``launch.process.PREEMPT_SIGNALS`` (SIGTERM, SIGUSR1, SIGUSR2: a preemption, Slurm's warning before
    the time limit) set a flag; the training loop saves a checkpoint at the next step boundary and stops (status ``preempted``).

    With several ranks the flag is agreed over a gloo group (a CPU all-reduce: no device sync), so
    every rank stops at the same step even when only some received the signal."""

    SIGNALS = PREEMPT_SIGNALS

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


def cap_allocator(measure: Any) -> None:
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


def train_and_measure(cfg: dict, result: RankResult, run_dir: Path | None = None,
                      logger: WandbRun | NullRun | None = None) -> Trainer:
    """Train ``train.train_iters`` steps; measure inside the window (``measure.*``); fill ``result``.
    ``logger`` (rank 0's W&B run) gets the progress metrics and the validation loss at their steps."""
    cfg = typed(cfg)
    train = cfg.train
    if compat.cuda_available():
        cap_allocator(cfg.measure)
    t0 = time.perf_counter()
    if result.timeline is None:
        result.timeline = {}
    marks = result.timeline
    check_tokenizer(cfg)  # data.tokenizer agrees with the data (vocabulary, eod) before any compute
    trainer = Trainer(cfg)
    routing = RoutingRecorder(trainer.chunks, lambda: len(trainer.grad_norms))  # MoE: routed rows per rank
    marks["built"] = time.time()
    result.num_parameters = num_parameters(trainer.chunks)
    result.optimizer = trainer.optimizer_kind
    result.precision = "bf16" if trainer.config.bf16 else "fp32"
    result.memory_after_init = memory_now()
    labels = labels_of(cfg)
    result.labels = resolve_labels(trainer.chunks, labels)
    check_resolved(result.labels)  # a label that wraps nothing is refused before training
    resume, notes = find_resume(cfg, run_dir)
    if resume is not None:
        restored = load_checkpoint(trainer, cfg, resume, verified=True)
        notes += restored["notes"]
        result.resumed_from = {"path": str(resume), "step": restored["step"]}
        result.record(restored["measured"])
    for note in notes:
        say(f"[checkpoint] {note}")
    result.checkpoint_notes = notes
    first = trainer.step_count + 1
    window = Window(measure_window(cfg, first))
    ledger_step = first + warmup_steps(cfg) - 1  # with offload, once the manager has planned
    result.first_step = first
    if window.span or "window" not in result:  # recorded: a checkpoint's (null too) stands
        result.window = list(window.span) if window.span else None
    ck = cfg.checkpoint
    root = checkpoint_root(cfg, run_dir) if ck.save else None
    logger = logger or NullRun()
    progress = Progress(cfg, trainer, first, run_dir, logger) if train.log_interval else None
    exit_interval = train.exit_interval
    result.phase = "before_window"
    losses: list = []  # device tensors (or None off the last stage) until the end: no host sync
    grad_norms: list = []
    lrs: list[float | None] = []  # the learning rate each step ran at
    evals: list[dict] = []
    eval_interval = cfg.data.eval_interval
    collector = ManualCollection(train).start()  # train.manual_gc: no collector pauses inside the steps
    try:
        for step in range(first, train.train_iters + 1):
            if step in window and step == window.span[0]:
                sync()
                window.static = memory_now()
                if compat.cuda_available():
                    torch.cuda.reset_peak_memory_stats()
                trainer.counter.reset()
                result.phase = "window"
            timed = step in window
            if timed:
                sync()
                moved = trainer.offload_meter.snapshot() if trainer.offloading else None
                collected = collector.meter.snapshot()
                started = time.perf_counter()
            lrs.append(current_lr(trainer.optimizer))
            record = step == ledger_step and window.span is not None and cfg.measure.ledger
            with ItemWaits() if timed else contextlib.nullcontext() as waits:  # the host's wait at the grad-norm read
                losses.append(trainer.train_step(record_ledger=record))
            returned = time.perf_counter()
            grad_norms.append(trainer.grad_norms[-1])
            if timed:
                sync()
                window.times.append(time.perf_counter() - started)
                window.host.append((returned - started - waits.seconds, waits.seconds))
                window.collections.append(collector.meter.since(collected))
                if moved is not None:
                    window.moved.append(trainer.offload_meter.since(moved))
            if step == first and window.span is not None:
                after_first_step(trainer, cfg, result, t0)
            if step == ledger_step and step != first and window.span is not None:
                record_ledger(trainer, cfg, result)
            if window.span and step == window.span[1]:
                record_window(trainer, cfg, result, window, labels, run_dir)
                # the recorder counts this process's steps from 0 (the ledger's is its first, with offload its second)
                record_routing(routing, result, ledger_step - first if cfg.measure.ledger else None,
                               range(window.span[0] - first, window.span[1] - first + 1))
                result.phase = "after_window"
            collector.after_step(step)
            if eval_interval and trainer.valid_data is not None and step % eval_interval == 0:
                evals.append({"step": step, "loss": trainer.evaluate()})
                logger.log({"val/loss": evals[-1]["loss"]}, step)  # evaluate() synchronized already
            if progress is not None and (step % progress.interval == 0 or step == train.train_iters):
                progress.log(step, losses[-1], lrs[-1], grad_norms[-1], evals[-1] if evals else None)
            stop = None
            if step < train.train_iters:
                received = STOP.requested()
                if received:
                    stop = "preempted"
                    result.signal = received
                    say(f"[signal] {received} at step {step}: " + (
                        "saving a checkpoint, then stopping" if root is not None else "stopping (checkpoint.save=false)"))
                elif exit_interval and step % exit_interval == 0:
                    stop = "stopped"
            if root is not None and (stop or step == train.train_iters or (ck.interval and step % ck.interval == 0)):
                measured = {k: result[k] for k in MEASURED_KEYS if k in result} if "timing" in result else {}
                path = save_checkpoint(trainer, cfg, root, measured)
                result.checkpoint = {"path": str(path), "step": step}
                say(f"[checkpoint] saved step {step} to {path}")
            if stop:
                result.stopped_at, result.stop_reason = step, stop
                break
    finally:
        collector.stop()
    marks["trained"] = time.time()
    result.loss = [None if l is None else float(l) for l in losses]
    result.grad_norm = [None if g is None else float(g) for g in grad_norms]  # before clipping
    result.lr = lrs
    if evals:
        result.eval_loss = evals
    result.warnings = (label_findings(result, labels) + result.pop("ledger_warnings", [])
                       + collection_findings(result.timing))
    if result.timing is None:
        result.warnings.append("nothing measured: this process started after the measured window and "
                               "its checkpoint carried no measurements")
    result.status = result.stop_reason or "ok"
    trainer.close()
    return trainer


def main(run_dir: str, exiting: bool = False) -> int:
    """One rank's run: train, measure, write ``RUN_DIR/ranks/rank<N>.json``; returns the exit code.
    ``exiting``: the process ends right after (``serve``), so a one-process group is not torn down."""
    from omegaconf import OmegaConf

    run = Path(run_dir)
    cfg = typed(OmegaConf.load(run / "config.yaml"))  # the frozen config the controller wrote, typed once
    rank = int(os.environ.get("RANK", 0))
    result = RankResult(rank=rank, status="failed", host=socket.gethostname(),
                        device=torch.cuda.get_device_name() if compat.cuda_available() else "cpu",
                        timeline={"main_start": time.time()})
    cores = pin_worker(cfg.launcher.cpu_cores_per_rank)  # before the threads it starts
    if cores is not None:
        result.cpu_cores = cores
        torch.set_num_threads(len(cores))  # no more CPU threads than its cores, whatever OMP_NUM_THREADS says
    exit_code = 0
    logger = open_run(cfg, run, rank, resuming=resumes(cfg, run))  # logger=wandb, rank 0; else a no-op twin
    if logger:
        result.timeline["logger_ready"] = time.time()
    try:
        STOP.install()  # before the slow part: a signal during start-up stops after the first step
        init_distributed(cfg, result.timeline)
        STOP.connect()
        result.timeline["distributed_ready"] = time.time()
        result.coords = rank_coordinates()
        train_and_measure(cfg, result, run, logger=logger)
        if result.pop("control_abandoned", False):
            exit_code = CONTROL_ABANDONED  # ok, written below; the other ranks may wait in that pass
    except (LabelError, ConfigError) as err:  # a label that wraps nothing; a checkpoint of another model
        result.status, result.error = "refused", str(err)
        exit_code = 2
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # recorded, never lost: the sweep goes on (torch's CheckpointException is a BaseException)
        if is_oom(err):
            first = next((l for l in str(err).splitlines() if "memory" in l or "calloc" in l), str(err))
            result.status, result.error, result.memory_at_failure = "oom", first.strip(), memory_now()
            exit_code = 3
        else:
            result.status, result.error = "failed", f"{type(err).__name__}: {err}"
            result.traceback = traceback.format_exc(limit=20)
            exit_code = 1
    rank_file = run / "ranks" / f"rank{rank}.json"
    small = {k: result.get(k) for k in ("rank", "status", "error", "host", "device", "checkpoint", "stopped_at")}
    if (err := write_json_or_fallback(rank_file, result.as_dict(), small)) is not None:  # a full disk: say what was kept
        saved = result.checkpoint
        result.status, result.error = "failed", f"{rank_file} could not be written ({type(err).__name__}: {err})"
        print(f"[rank {rank}] {result.error}; the run ended {small['status']}; kept: "
              + (f"the checkpoint of step {saved['step']} at {saved['path']}" if saved else "no checkpoint"),
              file=sys.stderr)
        exit_code = exit_code or 1
    if exit_code == CONTROL_ABANDONED:
        print(f"[rank {rank}] ok, but its in-run control ledger ran out of memory: leaving now so that no rank "
              "waits in that pass (torchrun stops the others; their results are written)", file=sys.stderr)
    elif exit_code:
        print(f"[rank {rank}] {result.status}: {result.error}", file=sys.stderr)
    if torch.distributed.is_initialized() and exit_code == 0:
        torch.distributed.barrier()  # every rank's file is written: rank 0's W&B summary has them all
        # NCCL's teardown of even a one-rank group took 1.5 s on the H200 (a sweep point's exit); with no
        # other rank to leave in step with, the process's end frees it
        if not (exiting and torch.distributed.get_world_size() == 1):
            torch.distributed.destroy_process_group()
    if logger:
        ok = result.status in ("ok", "stopped", "preempted")
        logger.finish(run_summary(run, cfg), 0 if ok else exit_code)
    return exit_code


def resumes(cfg: dict, run_dir: Path) -> bool:
    """Whether this process will continue a checkpoint (then its W&B run continues the earlier one)."""
    cfg = typed(cfg)
    try:
        return find_resume(cfg, run_dir, deep=False)[0] is not None
    except Exception:  # a bad checkpoint.resume is refused later, by train_and_measure
        return False


def run_summary(run_dir: Path, cfg: dict) -> dict:
    """The run as the controller will record it (the rank files written so far, merged), for rank 0's W&B
    summary: every rank's memory, the worst rank's numbers, the status."""
    identity = read_identity(run_dir)
    meta = {"name": identity.get("name"), "choices": identity.get("choices") or {}, "run_dir": str(run_dir),
            "config": as_dict(cfg)}
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
