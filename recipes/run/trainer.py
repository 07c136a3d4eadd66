"""The model, its optimizer and one training step, for one rank.

``Trainer`` builds the model chunks (``recipes.build.model``), megatron's optimizer on a GPU (torch's
AdamW on a CPU), the learning-rate schedule and the data iterators, and runs a step through megatron's
forward-backward schedule (``step``), with the activation ledger and recompute counter around it on
request. The worker (``recipes.run.worker``) decides when to step, measure, log and checkpoint.
"""

from __future__ import annotations

import torch

from recipes.build import compat
from recipes.build.model import build_model, build_transformer_config, megatron_optimizer
from recipes.build.offload import emulate_copy_streams_on_cpu, offload_paused, reset_offload_manager
from recipes.build.parallel import from_last_stage, reduce_gradients_cpu
from recipes.config import typed
from recipes.data.datasets import batches, build_datasets
from recipes.measure.labels import labels_disabled
from recipes.measure.ledger import ActivationLedger, CheckpointCounter
from recipes.measure.offload import OffloadMeter
from recipes.offload import modules_of
from recipes.run.schedule import build_scheduler


class Trainer:
    """Model chunks, optimizer and one ``step()``: megatron's schedule, grads, optimizer."""

    def __init__(self, cfg: dict):
        cfg = typed(cfg)
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
        train = cfg.train
        self.global_batch_size = gbs = train.global_batch_size or train.micro_batch_size * self.dp_size
        self.num_microbatches = gbs // (train.micro_batch_size * self.dp_size)
        self.optimizer_kind = self._build_optimizer()
        self.scheduler = build_scheduler(self.optimizer, train)
        samples = train.train_iters * gbs
        eval_interval = cfg.data.eval_interval
        eval_samples = 0
        if eval_interval:
            eval_samples = (train.train_iters // eval_interval + 1) * cfg.data.eval_iters * gbs
        datasets = build_datasets(cfg, [samples, eval_samples, 0])
        self.data = batches(datasets[0], train.micro_batch_size, compat.device())
        self.valid_data = None
        if eval_interval and datasets[1] is not None:
            self.valid_data = batches(datasets[1], train.micro_batch_size, compat.device())
        self.forward_backward = get_forward_backward_func(
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            vp_size=cfg.parallel.virtual_pipeline_model_parallel_size,
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
        train = self.cfg.train
        use_megatron = megatron_optimizer(self.cfg, self.on_gpu)
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
                lr=train.lr,
                min_lr=train.min_lr,
                weight_decay=train.weight_decay,
                bf16=self.config.bf16,
                params_dtype=self.config.params_dtype,
                use_distributed_optimizer=True,
                clip_grad=train.clip_grad,
            )
            self.optimizer = get_megatron_optimizer(opt_config, self.chunks)
            fused = use_fused_adam(self.optimizer) if train.fused_adam else 0
            return "megatron DistributedOptimizer (adam" + (", fused kernel)" if fused else ")")
        params = [p for c in self.chunks for p in c.parameters()]
        self.optimizer = torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay)
        if train.fused_adam:
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

    def forward_only(self) -> None:
        """The step's micro-batches forward only, under ``torch.no_grad``, in training mode: as a
        checkpoint runs its region's first forward (``recipes.measure.moduletime`` times that)."""
        with torch.no_grad():
            self._schedule(self.data, forward_only=True)

    def _schedule(self, data, forward_only: bool) -> list[dict]:
        """megatron's forward-backward schedule over this step's micro-batches (all chunks)."""
        train = self.cfg.train
        vpp = self.cfg.parallel.virtual_pipeline_model_parallel_size
        return self.forward_backward(
            forward_step_func=self._forward_step,
            data_iterator=[data] * len(self.chunks) if vpp else data,
            model=self.chunks if vpp else self.chunks[0],
            num_microbatches=self.num_microbatches,
            seq_length=train.seq_length,
            micro_batch_size=train.micro_batch_size,
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
            for _ in range(self.cfg.data.eval_iters):
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
        self._grad_norm = reduce_gradients_cpu(self.chunks, self.config, self.cfg.train.clip_grad)


def use_fused_adam(optimizer) -> int:
    """Switch the torch Adam(W) inside ``optimizer`` to torch's fused kernel; returns how many.

    Without Transformer Engine or apex, megatron-core's ``get_megatron_optimizer`` falls back to
    ``torch.optim.AdamW`` in its default multi-tensor (``foreach``) mode; with TE or apex it uses
    their FusedAdam. torch's ``fused=True`` is the same update in one kernel per parameter group
    (same math, no host loop over tensor lists). Set before the first step, when the optimizer
    state is still empty (its ``step`` counters are then created on the device, as fused needs).
    On the H200 the foreach update took about 14 of a 93 ms dense step (docs/evidence/h200.md).
    """
    inners = [getattr(o, "optimizer", o) for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    count = 0
    for inner in inners:
        if isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            for group in inner.param_groups:
                group["fused"], group["foreach"] = True, False
            count += 1
    return count

