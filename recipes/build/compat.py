"""Running megatron-core without CUDA: the small, explicit compatibility layer.

megatron-core 0.19.2 assumes a GPU in a handful of places (each reproduced with megatron-core 0.19.2 on a CPU):

1. ``GlobalMemoryBuffer`` allocates on ``torch.cuda.current_device()`` (megatron/core/utils.py).
2. Checkpointing captures the CUDA RNG state through ``random._get_cuda_rng_state`` (random.py).
3. ``model_parallel_cuda_manual_seed`` reads ``torch.cuda.get_rng_state()`` unless the inference
   RNG tracker is used (random.py).
4. The default causal mask is built on "cuda" (transformer/utils.py); our own core-attention
   modules (``recipes.build.attention``) build their masks on the query's device, so nothing is patched.
5. The alltoall token dispatcher uses CUDA streams: ``recipes.validate`` refuses it on a CPU.
6. The pipeline schedules allocate their token counter with ``device="cuda"`` (schedules.py);
   batched p2p calls ``torch.cuda.synchronize`` (``recipes.build.model`` turns ``batch_p2p_comm`` off on
   a CPU, so gloo's plain isend/irecv are used).
7. ``dist_checkpointing``'s file writer copies tensors to the host with ``non_blocking=True``, then
   calls ``torch.cuda.synchronize()`` (strategies/filesystem_async.py ``preload_tensors``).

``install_cpu_compat()`` patches 1, 2, 6 and 7 (7: a blocking copy) and is a no-op when CUDA is available, so the same package
code runs unchanged on a GPU. ``seed_model_parallel_rng`` covers 3. Nothing here changes numerics:
on a CPU the "CUDA" RNG state megatron saves and restores around checkpoints is the CPU generator's,
which is the generator CPU dropout actually draws from.
"""

from __future__ import annotations

import torch

_INSTALLED = False


def cuda_available() -> bool:
    """True when a CUDA device can be used (the GPU path); False selects the CPU layer."""
    return torch.cuda.is_available()


def install_cpu_compat() -> bool:
    """Patch megatron-core's CUDA-only calls when there is no CUDA. Returns True if patched."""
    global _INSTALLED
    if cuda_available():
        return False
    if _INSTALLED:
        return True
    # lazy: megatron takes seconds to import; tools that never build a model skip it
    from megatron.core.tensor_parallel import random as mcore_random

    cpu = torch.device("cpu")
    # (1) GlobalMemoryBuffer and a few builders ask for the "current CUDA device".
    torch.cuda.current_device = lambda: cpu  # type: ignore[assignment]

    # (2) CheckpointFunction / CheckpointWithoutOutput save and restore this state around the
    # recompute so dropout replays identically; on a CPU that is the CPU generator's state.
    def _cpu_rng_state(device="cuda", clone=False, graph_safe=False):  # noqa: ARG001
        return torch.get_rng_state()

    def _set_cpu_rng_state(new_state, device=-1, graph_safe=False):  # noqa: ARG001
        torch.set_rng_state(new_state)

    mcore_random._get_cuda_rng_state = _cpu_rng_state
    mcore_random._set_cuda_rng_state = _set_cpu_rng_state

    # (6) schedules.py: torch.zeros([], dtype=torch.int, device="cuda") for the token count.
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _TorchOnCpu()

    # (7) dist_checkpointing's writer copies tensors to the host with non_blocking=True and then
    # calls torch.cuda.synchronize() (filesystem_async.py preload_tensors): a blocking copy on a CPU.
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    preload = FileSystemWriterAsync.preload_tensors
    FileSystemWriterAsync.preload_tensors = staticmethod(
        lambda write_buckets, non_blocking=True: preload(write_buckets, non_blocking=False))
    _INSTALLED = True
    return True


class _TorchOnCpu:
    """``torch`` as seen by megatron's schedules on a CPU: tensors asked for on "cuda" go to the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            device = "cpu"
        return torch.zeros(*args, device=device, **kwargs)


def seed_model_parallel_rng(seed: int, cudagraphable: bool = False) -> None:
    """Seed torch and megatron's RNG tracker (data/tensor/expert-parallel states).

    On a GPU this is megatron's own ``model_parallel_cuda_manual_seed``; ``cudagraphable`` (for
    ``model.cuda_graph_impl=local``) gives it the graph-safe generators megatron's CUDA graphs require
    (TE's tracker is the other kind they accept). On a CPU the inference
    tracker is used: its ``fork`` leaves the (CPU) default generator in place instead of reading
    CUDA generator states that do not exist.
    """
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    if cuda_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=cudagraphable,
                                                        force_reset_rng=True)
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(
            seed, inference_rng_tracker=True, force_reset_rng=True
        )


def device() -> torch.device:
    """The device this process trains on: its CUDA device, or the CPU."""
    if cuda_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
