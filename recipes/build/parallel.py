"""What a parallel layout means for one rank: its pipeline schedule and its gradients.

- ``pipeline_schedule``: how many micro-batches megatron's 1F1B (or interleaved 1F1B) schedule keeps
  in flight on this pipeline rank. That is why the first stage holds more activations than the
  last (Korthikanti et al. 2022: the first 1F1B stage holds p micro-batches' worth). It mirrors
  ``megatron.core.pipeline_parallel.schedules.get_pp_rank_microbatches`` and its ``get_schedule_table``
  (``schedule_table``, here so that the estimator, and a controller that compares a pipelined run with
  it, need not import megatron-core: 10 s on a 2-core machine); tests check they agree.
- ``from_last_stage``: a value only the last pipeline stage has (the loss) on every stage, so that
  rank 0 logs it, as Megatron-LM's last-rank logging does.
- ``reduce_gradients_cpu``: the CPU stand-in for megatron's DDP + ``finalize_model_grads`` + the
  optimizer's gradient clipping, which hard-code CUDA. It does the same reductions over the same
  process groups (sequence-parallel norms over TP, tied embeddings over the embedding group, dense
  gradients over DP, expert gradients over expert-DP) and clips by the global norm, so a TP2 run
  takes the same step as a TP1 run (tests/test_parallel.py compares them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads where a gradient is reduced: the estimator's schedule needs none of it
    import torch


def pipeline_schedule(num_microbatches: int, pp_size: int, pp_rank: int,
                      num_model_chunks: int = 1, microbatch_group_size: int | None = None) -> dict:
    """The schedule megatron runs on this pipeline rank and what it keeps in flight.

    ``in_flight_forwards`` is the number of (micro-batch, model chunk) forwards whose activations
    are alive at once: the warm-up forwards plus the first steady-state one, all held until the
    first backward. Without interleaving that is min(pp - pp_rank, num_microbatches) micro-batches
    through this stage; with ``num_model_chunks`` virtual stages each forward holds one chunk.
    ``chunk_order`` lists the model chunk of each of those forwards (megatron's own schedule table),
    so the bytes in flight can be summed from per-chunk ledgers.
    """
    if pp_size == 1:
        return {"schedule": "no pipelining", "num_microbatches": num_microbatches,
                "num_model_chunks": 1, "warmup_forwards": 0, "in_flight_forwards": 1,
                "in_flight_microbatches": 1, "chunk_order": [0]}
    total = num_microbatches * num_model_chunks
    group = microbatch_group_size or pp_size
    if num_model_chunks == 1:
        schedule, warmup = "1F1B", pp_size - pp_rank - 1
    else:
        schedule = "interleaved 1F1B"
        warmup = (pp_size - pp_rank - 1) * 2 + (num_model_chunks - 1) * group
    warmup = min(warmup, total)
    in_flight = min(warmup + 1, total)
    # (micro-batch, model chunk) of each forward, in megatron's order
    table = schedule_table(num_microbatches, num_model_chunks, group)[:in_flight]
    return {"schedule": schedule, "num_microbatches": num_microbatches,
            "num_model_chunks": num_model_chunks, "warmup_forwards": warmup,
            "in_flight_forwards": in_flight,
            "in_flight_microbatches": len({mb for mb, _ in table}),
            "chunk_order": [chunk for _, chunk in table]}


def schedule_table(num_microbatches: int, num_model_chunks: int, group: int) -> list[tuple[int, int]]:
    """(micro-batch, model chunk) of each forward in megatron's order: micro-batches in groups of
    ``group``, each group through every chunk (megatron.core.pipeline_parallel.schedules.get_schedule_table)."""
    table = []
    for first in range(0, num_microbatches, group):
        last = num_microbatches if first + group >= num_microbatches else first + group
        table.extend((mb, chunk) for chunk in range(num_model_chunks) for mb in range(first, last))
    return table


def in_flight_bytes(schedule: dict, chunk_bytes: list[int]) -> int:
    """Saved-for-backward bytes alive at the first backward: the ledger of each in-flight forward."""
    if not chunk_bytes:
        return 0
    return sum(chunk_bytes[c] for c in schedule["chunk_order"])


def from_last_stage(value) -> float | None:
    """``value`` (a float, a 0-d tensor, or None off the last stage) from this rank's last pipeline
    stage, as a float on every stage of the pipeline; a collective: every stage calls it together.
    Without pipelining, the value itself."""
    import torch
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_pipeline_model_parallel_world_size() == 1:
        return None if value is None else float(value)
    from recipes.build import compat

    known = value is not None
    buf = torch.tensor([float(value) if known else 0.0, float(known)], dtype=torch.float64, device=compat.device())
    torch.distributed.broadcast(buf, src=ps.get_pipeline_model_parallel_last_rank(),
                                group=ps.get_pipeline_model_parallel_group())
    return float(buf[0]) if buf[1] else None


def _all_reduce(tensor: torch.Tensor, group) -> None:
    import torch

    if group is not None and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(tensor, group=group)


def reduce_gradients_cpu(chunks: list[torch.nn.Module], config, clip_grad: float) -> float:
    """Reduce this rank's gradients as megatron would, clip by the global norm; return that norm.

    Expert parameters are those megatron marks ``allreduce=False`` (reduced over expert-DP, not DP):
    scaled by 1/dp and summed over expert-DP, which is DDP's scaling (each expert's gradient already
    sums the tokens routed to it from every expert-parallel rank).
    """
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    named = [(n, p) for c in chunks for n, p in c.named_parameters() if p.grad is not None]
    tp_group = ps.get_tensor_model_parallel_group()
    tp = torch.distributed.get_world_size(tp_group)
    for name, p in named:  # replicated over TP but fed different tokens (sequence) or heads
        if tp == 1:
            break
        if (config.sequence_parallel and getattr(p, "sequence_parallel", False)) or (
                config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)):
            _all_reduce(p.grad, tp_group)
        elif getattr(p, "average_gradients_across_tp_domain", False):
            _all_reduce(p.grad, tp_group)
            p.grad.div_(tp)
    if ps.get_pipeline_model_parallel_world_size() > 1:  # tied embedding and output weight
        for _, p in named:
            if getattr(p, "shared_embedding", False):
                _all_reduce(p.grad, ps.get_embedding_group())
    dp_group = ps.get_data_parallel_group(with_context_parallel=True)
    dp = torch.distributed.get_world_size(dp_group)
    expert_dp_group = ps.get_expert_data_parallel_group()
    for _, p in named:
        if dp > 1:
            p.grad.div_(dp)
        _all_reduce(p.grad, dp_group if getattr(p, "allreduce", True) else expert_dp_group)
    device = named[0][1].grad.device if named else torch.device("cpu")
    dense_sq = torch.zeros((), dtype=torch.float32, device=device)
    expert_sq = torch.zeros((), dtype=torch.float32, device=device)
    for _, p in named:
        if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
            sq = p.grad.detach().float().pow(2).sum()
            if getattr(p, "allreduce", True):
                dense_sq += sq
            else:
                expert_sq += sq
    _all_reduce(dense_sq, ps.get_model_parallel_group())
    _all_reduce(expert_sq, ps.get_expert_tensor_model_pipeline_parallel_group())
    norm = float((dense_sq + expert_sq).sqrt())
    if clip_grad and norm > clip_grad:
        coef = clip_grad / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s coefficient
        for _, p in named:
            p.grad.mul_(coef)
    return norm


def pipeline_report(chunks: list[torch.nn.Module], num_microbatches: int, config,
                    chunk_bytes: list[int]) -> dict:
    """This rank's pipeline schedule, layers per model chunk and the ledger bytes held in flight.

    ``chunk_bytes`` is the ledger of one micro-batch through each model chunk (the worker records
    the first micro-batch of every chunk), so ``in_flight_ledger_bytes`` estimates the activations
    this rank holds at its first backward: what makes the first pipeline stage the fullest.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_attr_wrapped_model

    info = pipeline_schedule(num_microbatches, ps.get_pipeline_model_parallel_world_size(),
                             ps.get_pipeline_model_parallel_rank(), len(chunks),
                             config.microbatch_group_size_per_vp_stage)
    info["layers_per_chunk"] = [len(get_attr_wrapped_model(c, "decoder").layers) for c in chunks]
    info["chunk_ledger_bytes"] = list(chunk_bytes)
    info["in_flight_ledger_bytes"] = in_flight_bytes(info, chunk_bytes)
    return info
