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

import json
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

from recipes.analyze.logger import NullRun, WandbRun, interval_metrics, open_run, read_identity
from recipes.build import compat, upstream
from recipes.build.model import build_model, build_transformer_config, num_parameters
from recipes.build.offload import emulate_copy_streams_on_cpu, offload_paused, reset_offload_manager
from recipes.build.parallel import from_last_stage, pipeline_report, reduce_gradients_cpu
from recipes.data.datasets import batches, build_datasets
from recipes.data.indexed import check_tokenizer
from recipes.errors import ConfigError
from recipes.files import GIB, write_json_atomic
from recipes.measure.flops import step_flops
from recipes.measure.labels import LabelError, check_resolved, label_findings, labels_disabled, resolve_labels
from recipes.measure.ledger import ActivationLedger, CheckpointCounter
from recipes.measure.offload import OffloadMeter, copy_overlap, host_link_bandwidth, plan_summary
from recipes.measure.profile import profile_step
from recipes.measure.routing import RoutingRecorder
from recipes.offload import modules_of
from recipes.recompute import labels_of
from recipes.results import merge_result
from recipes.run.checkpoint import checkpoint_root, find_resume, load_checkpoint, save_checkpoint
from recipes.run.schedule import build_scheduler, current_lr

#: What the measured window put into a rank's result: a checkpoint taken after the window carries
#: it, so a run resumed past the window still writes the same result.json.
MEASURED_KEYS = ("window", "setup_s", "ledger", "pipeline", "checkpoints", "timing", "memory", "profile",
                 "_ledger_warnings")


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
    compat.seed_model_parallel_rng(cfg["train"]["seed"] + 100 * parallel_state.get_pipeline_model_parallel_rank())


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


class Trainer:
    """Model chunks, optimizer and one ``step()``: megatron's schedule, grads, optimizer."""

    def __init__(self, cfg: dict):
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func


        self.cfg = cfg
        self.on_gpu = compat.cuda_available()
        self.offloading = bool(modules_of(cfg))
        self.offload_meter = None
        if self.offloading:  # a fresh offload manager plans during this model's first step
            if not self.on_gpu:
                emulate_copy_streams_on_cpu()  # offload.emulate_on_cpu (validate refuses it otherwise)
            self.offload_meter = OffloadMeter().install()
            reset_offload_manager()
        self.config = build_transformer_config(cfg, self.on_gpu)
        self.chunks = build_model(cfg, self.config)
        self.dp_size = ps.get_data_parallel_world_size()
        train = cfg["train"]
        self.global_batch_size = gbs = train["global_batch_size"] or train["micro_batch_size"] * self.dp_size
        self.num_microbatches = gbs // (train["micro_batch_size"] * self.dp_size)
        self.optimizer_kind = self._build_optimizer()
        self.scheduler = build_scheduler(self.optimizer, train)
        samples = train["train_iters"] * gbs
        eval_interval = cfg["data"]["eval_interval"]
        eval_samples = 0
        if eval_interval:
            eval_samples = (train["train_iters"] // eval_interval + 1) * cfg["data"]["eval_iters"] * gbs
        datasets = build_datasets(cfg, [samples, eval_samples, 0])
        self.data = batches(datasets[0], train["micro_batch_size"], compat.device())
        self.valid_data = None
        if eval_interval and datasets[1] is not None:
            self.valid_data = batches(datasets[1], train["micro_batch_size"], compat.device())
        self.forward_backward = get_forward_backward_func(
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            vp_size=cfg["parallel"]["virtual_pipeline_model_parallel_size"],
        )
        self.counter = CheckpointCounter().install()
        self.ledger = ActivationLedger()  # one micro-batch through every model chunk of this rank
        self.chunk_ledgers = [ActivationLedger() for _ in self.chunks]
        self._ledger_pending: set[int] = set()  # chunks whose first forward is still to record
        self.grad_norms: list[float | None] = []  # per optimizer step, before clipping
        self.step_count = 0  # training steps done (a resumed run starts at its checkpoint's)
        self._last_update_ok = True
        self._grad_norm: float | None = None

    def _build_optimizer(self) -> str:
        train = self.cfg["train"]
        use_megatron = self.on_gpu and train["optimizer"] == "auto"
        if use_megatron:
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
            )
            self.chunks = [
                DistributedDataParallel(self.config, ddp_config, chunk) for chunk in self.chunks
            ]
            opt_config = OptimizerConfig(
                optimizer="adam",
                lr=train["lr"],
                min_lr=train["min_lr"],
                weight_decay=train["weight_decay"],
                bf16=self.config.bf16,
                params_dtype=self.config.params_dtype,
                use_distributed_optimizer=True,
                clip_grad=train["clip_grad"],
            )
            self.optimizer = get_megatron_optimizer(opt_config, self.chunks)
            fused = use_fused_adam(self.optimizer) if train["fused_adam"] else 0
            return "megatron DistributedOptimizer (adam" + (", fused kernel)" if fused else ")")
        params = [p for c in self.chunks for p in c.parameters()]
        self.optimizer = torch.optim.AdamW(params, lr=train["lr"], weight_decay=train["weight_decay"])
        if train["fused_adam"]:
            use_fused_adam(self.optimizer)
        return "torch AdamW (CPU fallback)" if not self.on_gpu else "torch AdamW"

    def _forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        chunk = next((i for i, c in enumerate(self.chunks) if c is model), None)
        if chunk in self._ledger_pending:
            self._ledger_pending.discard(chunk)  # the first micro-batch through each model chunk
            with self.chunk_ledgers[chunk].record([model], meter=self.offload_meter):
                output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        else:
            output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        loss_mask = batch["loss_mask"]

        def loss_func(output_tensor):
            losses = output_tensor.float().view(-1)
            mask = loss_mask.view(-1).float()
            loss = (losses * mask).sum() / mask.sum()
            return loss, {"lm loss": loss.detach().clone()}  # the schedule divides `loss` in place

        return output, loss_func

    def step(self, record_ledger: bool = False) -> torch.Tensor | None:
        """One optimizer step over all micro-batches; returns the mean loss (last stage) or None.

        The loss stays a device tensor: reading it here would synchronize the host between the
        backward and the optimizer, leaving the GPU idle while the optimizer's kernels are
        launched. The caller reads it after the step's own synchronization (``float(loss)``).
        """
        loss = self.compute_gradients(record_ledger, sync_loss=False)
        stepped = self.optimizer.step()  # megatron's returns (ok, grad norm, zeros); AdamW None
        self._last_update_ok = stepped[0] if isinstance(stepped, tuple) else True
        self.grad_norms.append(stepped[1] if isinstance(stepped, tuple) else self._grad_norm)
        return loss

    def train_step(self, record_ledger: bool = False) -> torch.Tensor | None:
        """One training step: ``step()``, then the schedule advances (after a successful update, as
        Megatron-LM does) and so does the step count. Extra measurement steps (the profiled step)
        call ``step()`` alone and leave both where they are."""
        loss = self.step(record_ledger)
        if self._last_update_ok:
            self.scheduler.step(increment=1)
        self.step_count += 1
        return loss

    def ledger_pass(self, disabled_labels: list[str] = ()) -> dict[str, int]:
        """Ledger bytes by kind of one micro-batch with some labels switched off (no update)."""
        with labels_disabled(self.chunks, list(disabled_labels)):
            self.compute_gradients(record_ledger=True)
        return dict(self.ledger.bytes_by_kind)

    def close(self) -> None:
        """Undo the checkpoint counter's and offload meter's patches (tests build several trainers
        in one process)."""
        self.counter.uninstall()
        if self.offload_meter is not None:
            self.offload_meter.uninstall()

    def compute_gradients(self, record_ledger: bool = False, sync_loss: bool = True):
        """Forward and backward over all micro-batches and the gradient reduction; no update.
        Returns the mean loss (a float, or with ``sync_loss=False`` a device tensor) or None."""
        self._ledger_pending = set(range(len(self.chunks))) if record_ledger else set()
        if hasattr(self.chunks[0], "zero_grad_buffer"):
            for c in self.chunks:
                c.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = self._schedule(self.data, forward_only=False)
        self._finalize_grads()
        if record_ledger:  # the sum over this rank's chunks (a pipeline stage's layers)
            self.ledger.bytes_by_kind = {
                k: sum(l.bytes_by_kind.get(k, 0) for l in self.chunk_ledgers)
                for k in self.chunk_ledgers[0].bytes_by_kind
            }
            self.ledger.host_bytes_by_kind = {
                k: sum(l.host_bytes_by_kind.get(k, 0) for l in self.chunk_ledgers)
                for k in self.chunk_ledgers[0].host_bytes_by_kind
            }
        if losses:
            loss = torch.stack([l["lm loss"] for l in losses]).mean()
            return float(loss) if sync_loss else loss
        return None

    def _schedule(self, data, forward_only: bool) -> list[dict]:
        """megatron's forward-backward schedule over this step's micro-batches (all chunks)."""
        train = self.cfg["train"]
        vpp = self.cfg["parallel"]["virtual_pipeline_model_parallel_size"]
        return self.forward_backward(
            forward_step_func=self._forward_step,
            data_iterator=[data] * len(self.chunks) if vpp else data,
            model=self.chunks if vpp else self.chunks[0],
            num_microbatches=self.num_microbatches,
            seq_length=train["seq_length"],
            micro_batch_size=train["micro_batch_size"],
            forward_only=forward_only,
        )

    def evaluate(self) -> float | None:
        """Mean validation loss over ``data.eval_iters`` batches (forward only), or None."""
        if self.valid_data is None:
            return None
        for c in self.chunks:
            c.eval()
        values = []
        with torch.no_grad(), offload_paused(self.offloading):
            for _ in range(self.cfg["data"]["eval_iters"]):
                losses = self._schedule(self.valid_data, forward_only=True)
                values += [float(l["lm loss"]) for l in losses or []]
        for c in self.chunks:
            c.train()
        return from_last_stage(sum(values) / len(values) if values else None)  # under PP: on every stage

    def _finalize_grads(self) -> None:
        """Gradient reduction: megatron's on a GPU; on a CPU the same reductions and global-norm
        clipping over the same process groups (``recipes.build.parallel.reduce_gradients_cpu``)."""
        if self.optimizer_kind.startswith("megatron"):
            from megatron.core.distributed import finalize_model_grads

            finalize_model_grads(self.chunks)
            return
        self._grad_norm = reduce_gradients_cpu(self.chunks, self.config, self.cfg["train"]["clip_grad"])


def use_fused_adam(optimizer) -> int:
    """Switch the torch Adam(W) inside ``optimizer`` to torch's fused kernel; returns how many.

    Without Transformer Engine or apex, megatron-core's ``get_megatron_optimizer`` falls back to
    ``torch.optim.AdamW`` in its default multi-tensor (``foreach``) mode; with TE or apex it uses
    their FusedAdam. torch's ``fused=True`` is the same update in one kernel per parameter group
    (same math, no host loop over tensor lists). Set before the first step, when the optimizer
    state is still empty (its ``step`` counters are then created on the device, as fused needs).
    On the H200 the foreach update took about 14 of a 93 ms dense step (docs/h200-results.md).
    """
    inners = [getattr(o, "optimizer", o) for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    count = 0
    for inner in inners:
        if isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            for group in inner.param_groups:
                group["fused"], group["foreach"] = True, False
            count += 1
    return count


def say(line: str) -> None:
    """One line on rank 0's console (the controller shows the worker's output), flushed now."""
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(line, flush=True)


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

    def __contains__(self, step: int) -> bool:
        return self.span is not None and self.span[0] <= step <= self.span[1]


class Progress:
    """One console line every ``train.log_interval`` steps (rank 0), the same as a JSON line in
    ``RUN_DIR/progress.jsonl`` (appended across resumes: the training record) and as W&B metrics at
    that step (``logger=wandb``; ``recipes.analyze.logger.LIVE_KEYS``).

    Step time is the wall time since the previous line over the steps in between: reading the loss
    here is the only synchronization, once per interval."""

    def __init__(self, cfg: dict, trainer: Trainer, first: int, run_dir: Path | None,
                 logger: WandbRun | NullRun | None = None):
        train = cfg["train"]
        self.interval, self.total = train["log_interval"], train["train_iters"]
        self.rank0 = torch.distributed.get_rank() == 0
        self.tokens = train["micro_batch_size"] * trainer.num_microbatches * trainer.dp_size * train["seq_length"]
        flops = step_flops({**cfg, "_data_parallel_size": trainer.dp_size}, trainer.num_microbatches)
        self.flops_per_gpu = flops["model"] / torch.distributed.get_world_size()
        self.peak = cfg["measure"]["peak_tflops"] * 1e12
        self.path = Path(run_dir) / "progress.jsonl" if run_dir is not None and self.rank0 else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.last_step, self.last_time = first - 1, time.perf_counter()
        self.logger = logger or NullRun()

    def log(self, step: int, loss, lr: float | None, grad_norm, last_eval: dict | None) -> None:
        loss = from_last_stage(loss)  # synchronizes (and under PP reaches rank 0): once per interval
        now = time.perf_counter()
        step_s = (now - self.last_time) / max(1, step - self.last_step)
        self.last_step, self.last_time = step, now
        row = {"step": step, "total": self.total, "loss": loss, "lr": lr,
               "grad_norm": None if grad_norm is None else float(grad_norm), "step_time_s": step_s,
               "tokens_per_s": self.tokens / step_s, "eta_s": step_s * (self.total - step), "time": time.time()}
        if compat.cuda_available():
            row["mfu"] = self.flops_per_gpu / step_s / self.peak
            row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
        if last_eval and last_eval["step"] == step:
            row["val_loss"] = last_eval["loss"]
        if not self.rank0:
            return
        parts = [f"step {step}/{self.total}", f"loss {loss:.4f}" if loss is not None else "loss -",
                 f"lr {lr:.3e}" if lr is not None else "", f"grad norm {row['grad_norm']:.3f}" if grad_norm is not None else "",
                 f"{step_s * 1000:.1f} ms/step", f"{row['tokens_per_s']:.0f} tok/s"]
        if "mfu" in row:
            parts += [f"MFU {row['mfu']:.1%}", f"peak {row['peak_allocated_gib']:.2f} GiB"]
        if "val_loss" in row and row["val_loss"] is not None:
            parts.append(f"val loss {row['val_loss']:.4f}")
        parts.append(f"ETA {_clock(row['eta_s'])}")
        say("[progress] " + " | ".join(p for p in parts if p))
        self.logger.log(interval_metrics(row), step, commit=True)  # after this step's val/loss, if any
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(max(0.0, seconds)), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


def train_and_measure(cfg: dict, result: dict, run_dir: Path | None = None,
                      logger: WandbRun | NullRun | None = None) -> Trainer:
    """Train ``train.train_iters`` steps; measure inside the window (``measure.*``); fill ``result``.
    ``logger`` (rank 0's W&B run) gets the progress metrics and the validation loss at their steps."""
    train = cfg["train"]
    if compat.cuda_available() and cfg["measure"]["memory_fraction"]:
        torch.cuda.set_per_process_memory_fraction(cfg["measure"]["memory_fraction"])
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
            started = time.perf_counter()
        lrs.append(current_lr(trainer.optimizer))
        record = step == ledger_step and window.span is not None and cfg["measure"]["ledger"]
        losses.append(trainer.train_step(record_ledger=record))
        grad_norms.append(trainer.grad_norms[-1])
        if timed:
            _sync()
            window.times.append(time.perf_counter() - started)
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
    marks["trained"] = time.time()
    result["loss"] = [None if l is None else float(l) for l in losses]
    result["grad_norm"] = [None if g is None else float(g) for g in grad_norms]  # before clipping
    result["lr"] = lrs
    if evals:
        result["eval_loss"] = evals
    result["warnings"] = label_findings(result, labels) + result.pop("_ledger_warnings", [])
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
        result["offload"] = {"modules": modules_of(cfg), **plan_summary()}
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
        }
    if trainer.offloading:
        result.setdefault("offload", {"modules": modules_of(cfg), **plan_summary()})
        result["offload"].update(offload_measurements(trainer, window, median))
    if cfg["measure"]["profile"] != "none":
        result["profile"] = profile_step(trainer, cfg, run_dir, step_time_s=median)
    marks["profile_done"] = time.time()
    if labels and cfg["measure"]["ledger"]:
        result["_ledger_warnings"] = control_ledgers(trainer, labels, result, run_dir)
    marks["ledgers_done"] = time.time()


def offload_measurements(trainer: Trainer, window: Window, step_time_s: float) -> dict:
    """What offload moved per measured step (the median step's counts) and, on a GPU, the host link's
    bandwidth and one extra step profiled for how much of the copying compute did not hide."""
    moved = window.moved[len(window.moved) // 2] if window.moved else {}
    out = {"moved_per_step": moved, "moved_steps_equal": all(m == moved for m in window.moved)}
    if trainer.on_gpu:  # measurements about the run, not of it: a failure is recorded, not raised
        try:
            out["link"] = host_link_bandwidth()
        except Exception as err:  # e.g. no room for the 256 MiB test buffers at the memory's edge
            out["link"] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
        try:
            overlap = copy_overlap(trainer.step)  # one more step, off the step count (as the profiled step)
            overlap["step_time_s"] = step_time_s
        except Exception as err:  # the profiler (CUPTI) unavailable, or an OOM in the extra step
            overlap = {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
        finally:
            trainer.optimizer.zero_grad()
        out["transfer"] = overlap
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


def main(run_dir: str) -> int:
    from omegaconf import OmegaConf

    run = Path(run_dir)
    cfg = OmegaConf.to_container(OmegaConf.load(run / "config.yaml"), resolve=True)
    rank = int(os.environ.get("RANK", 0))
    result: dict[str, Any] = {"rank": rank, "status": "failed", "host": socket.gethostname()}
    result["device"] = torch.cuda.get_device_name() if compat.cuda_available() else "cpu"
    result["timeline"] = {"main_start": time.time()}
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
    code = main(run_dir)
    import multiprocessing

    for child in multiprocessing.active_children():  # dist_checkpointing's result-queue manager
        child.terminate()
    # The results are written (atomically) and the process group destroyed: skip the interpreter's
    # teardown of torch/megatron (about a second per sweep point, and sweeps run many points).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    serve(sys.argv[1])
