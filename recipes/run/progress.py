"""Live progress of a training run: rank 0's console lines, ``RUN_DIR/progress.jsonl`` and W&B."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from recipes.analyze.logger import NullRun, WandbRun, interval_metrics
from recipes.build import compat
from recipes.build.parallel import from_last_stage
from recipes.config import typed
from recipes.files import GIB, PROGRESS_FILE
from recipes.measure.flops import step_flops
from recipes.run.trainer import Trainer


def say(line: str) -> None:
    """One line on rank 0's console (the controller shows the worker's output), flushed now."""
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(line, flush=True)


class Progress:
    """One console line every ``train.log_interval`` steps (rank 0), the same as a JSON line in
    ``RUN_DIR/progress.jsonl`` (appended across resumes: the training record) and as W&B metrics at
    that step (``logger=wandb``; ``recipes.analyze.logger.LIVE_KEYS``).

    Step time is the wall time since the previous line over the steps in between: reading the loss
    here is the only synchronization, once per interval."""

    def __init__(self, cfg: dict, trainer: Trainer, first: int, run_dir: Path | None,
                 logger: WandbRun | NullRun | None = None):
        cfg = typed(cfg)
        train = cfg.train
        self.interval, self.total = train.log_interval, train.train_iters
        self.rank0 = torch.distributed.get_rank() == 0
        self.tokens = train.micro_batch_size * trainer.num_microbatches * trainer.dp_size * train.seq_length
        flops = step_flops({**cfg, "_data_parallel_size": trainer.dp_size}, trainer.num_microbatches)
        self.flops_per_gpu = flops["model"] / torch.distributed.get_world_size()
        self.peak = cfg.measure.peak_tflops * 1e12
        self.path = Path(run_dir) / PROGRESS_FILE if run_dir is not None and self.rank0 else None
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

