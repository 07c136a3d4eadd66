"""What a checkpoint region costs the host, measured on this machine.

A recompute region is host work beyond the kernels it replays: megatron saves and restores the RNG
states around it, runs its first forward under no_grad, replays it from a gradient hook (or from its
own autograd node) and runs its backward in a nested ``torch.autograd.backward``. Where a step's host
is behind its GPU (MoE, MLA at the h200 size) that is step time. On one H200
(a benchmark since retired) a ``moe_act`` region added 1.2 ms to its step's own host time: about
240 us of that is one more call of the experts' activation (megatron's torch.compile'd weighted
SwiGLU), the rest the region's machinery; a norm's region (``layernorm``) about 0.6 ms.

``region_host_ms`` measures the machinery on a region around a one-kernel function, for megatron's
two kinds of region: ``CheckpointWithoutOutput`` (``without_output``: the elementwise labels,
``mla_up_proj``, and our ``mlp``) and ``tensor_parallel.checkpoint`` (``checkpoint``: ``full``,
``core_attn``, ``moe``, ``shared_experts``, ``mlp`` with ``recompute.mlp_replays_fc2``).
A kind that cannot be measured without building megatron's C++ extension first is left out.
``region_forward_host_ms`` measures the forward's part of it, which runs where the region's module runs.
``function_host_ms`` times the functions an elementwise region replays that are not timed modules
(``REGION_FUNCTIONS``). The module-time pass records both (``recipes.measure.moduletime.timeline``)
and ``recipes.predict.cost`` prices a region from them.

An offload group is the same kind of cost: megatron's fine-grained offload manager runs Python for each
group it commits in the forward (its saved-tensor hooks, a pinned buffer from its pool, a copy issued
on its device-to-host stream, events) and reloads in the backward. Under torch's profiler on one H200
(dense h200, ``offload=core_attn-attn_proj``) a commit took about 0.4 ms of host and a
reload 0.2; in the dense forward, where the host is barely ahead, the GPU waited for it.
``offload_host_ms`` measures a group's host cost through the manager itself.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from contextlib import contextmanager
from functools import partial
from importlib import import_module

import torch

from recipes.recompute import LABELS

#: The function each elementwise label's region replays where it is not a timed module (a norm's
#: region replays the norm, which ``recipes.measure.moduletime.TIMED`` times): (module, class, method),
#: each label's ``Label.region_function``.
REGION_FUNCTIONS = {name: label.region_function for name, label in LABELS.items() if label.region_function}
#: Timed repetitions of each variant (after 3 untimed); a variant takes well under a millisecond.
REPEATS = 30


def _host_ms(run, device: torch.device, repeats: int, then=None) -> float:
    """The median host ms of ``run()`` (the stream drained before each: the host never waits);
    ``then(result)`` runs after each, untimed."""
    times = []
    for i in range(repeats + 3):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = run()
        if i >= 3:
            times.append((time.perf_counter() - start) * 1e3)
        if then is not None:
            then(out)
    return statistics.median(times)


def _region_forwards(device: torch.device):
    """The measured variants' forwards, each returning its loss: (plain, one call of the function
    under grad, {kind: the function in a region of that kind}): a one-kernel function, its output used
    by a multiply (which saves it, as FC2 saves the activation). A kind this machine cannot run without
    building megatron's C++ extension first is left out. Megatron's RNG tracker must be seeded
    (``recipes.build.compat.seed_model_parallel_rng``)."""
    from megatron.core import tensor_parallel

    x = torch.randn(64, 64, device=device, requires_grad=True)
    w = torch.randn(64, 64, device=device)
    fn = torch.sigmoid

    def plain():
        return (fn(x) * w).sum()

    def without_output():
        region = tensor_parallel.CheckpointWithoutOutput()
        out = region.checkpoint(fn, x) * w
        region.discard_output_and_register_recompute(out)
        return out.sum()

    def checkpoint():
        return (tensor_parallel.checkpoint(fn, False, x) * w).sum()

    def call():
        with torch.enable_grad():
            fn(x)

    kinds = {"without_output": without_output, "checkpoint": checkpoint}
    if not _without_output_ready(device):
        del kinds["without_output"]
    return plain, call, kinds


def region_host_ms(device: torch.device, repeats: int = REPEATS) -> dict[str, float]:
    """Host ms a region of each kind costs beyond the function it replays, forward and backward: the
    function checkpointed minus without, minus one more call of the function under grad (the replay's
    own work, which a price takes from the function's measured host time)."""
    plain, call, kinds = _region_forwards(device)

    def step(forward):
        return lambda: forward().backward()

    base, once = _host_ms(step(plain), device, repeats), _host_ms(call, device, repeats)
    return {kind: round(max(_host_ms(step(run), device, repeats) - base - once, 0.0), 4) for kind, run in kinds.items()}


def region_forward_host_ms(device: torch.device, repeats: int = REPEATS) -> dict[str, float]:
    """The part of ``region_host_ms`` the forward costs (the backward run untimed after it): saving
    the RNG states, the first call under no_grad, and for ``without_output`` freeing the output and
    registering its replay. It runs where the region's module runs, so it costs a step where the host
    is behind there even when backward leads by far (a dense step's first forward)."""
    plain, _, kinds = _region_forwards(device)
    base = _host_ms(plain, device, repeats, then=torch.Tensor.backward)
    return {kind: round(max(_host_ms(run, device, repeats, then=torch.Tensor.backward) - base, 0.0), 4)
            for kind, run in kinds.items()}


def _without_output_ready(device: torch.device) -> bool:
    """Whether a ``CheckpointWithoutOutput`` region can replay here without building megatron's
    ``share_storage`` extension now (13-24 s on a fresh H200 machine, or no compiler at all): on a CPU
    ``recipes.build.upstream`` hands the memory over in Python; on a GPU the library must be built
    (a sweep with such a label starts building it at launch). Otherwise that kind is not measured and
    its regions are priced at ``estimate.replay_region_ms``."""
    from recipes.validate.share_storage import share_storage_built

    return device.type == "cpu" or share_storage_built() is not False


#: Offload groups a measured synthetic step moves (the manager keeps each chunk's last group of a name).
OFFLOAD_GROUPS = 3
#: Tensors each group of the two measured variants saves: their difference gives the cost a tensor.
OFFLOAD_TENSORS = (1, 4)


def offload_host_ms(device: torch.device, repeats: int = REPEATS) -> dict[str, float] | None:
    """Host ms megatron's fine-grained offload costs, forward commit and backward reload together:
    ``group`` (a group's fixed cost) and ``tensor`` (each tensor it moves), from a synthetic step of
    ``OFFLOAD_GROUPS`` + 1 groups (each a chain of sigmoids saving 1, then 4, tensors of 1 MiB) run
    through the manager, against the same step without offload. The step's copies are issued, not
    waited for: the stream is drained before each repetition. Uses a manager of its own and puts the
    model's back after; None where this machine has no copy streams (a CPU without the emulation,
    ``recipes.build.offload``)."""
    x = _synthetic_input(device)
    if x is None:
        return None
    per_group = {}
    with _own_manager() as fresh:
        for tensors in OFFLOAD_TENSORS:
            _synthetic_step(x, True, tensors)  # the manager's warm-up step plans its groups
            moved = _host_ms(partial(_synthetic_step, x, True, tensors), device, repeats)
            per_group[tensors] = (moved - _host_ms(partial(_synthetic_step, x, False, tensors), device, repeats)
                                  ) / OFFLOAD_GROUPS
            fresh()  # each variant plans afresh
    few, many = OFFLOAD_TENSORS
    tensor = max((per_group[many] - per_group[few]) / (many - few), 0.0)
    return {"group": round(max(per_group[few] - few * tensor, 0.0), 4), "tensor": round(tensor, 4)}


def offload_calls(device: torch.device) -> dict | None:
    """``offload_host_ms``'s synthetic step with 4 tensors a group, once more after the manager's
    warm-up, with the manager's methods timed (``recipes.measure.offload.ManagerCalls.summary``): what
    its groups cost method by method, beside a real step's. None where ``offload_host_ms`` is."""
    from recipes.measure.offload import ManagerCalls

    x = _synthetic_input(device)
    if x is None:
        return None
    with _own_manager():
        _synthetic_step(x, True, OFFLOAD_TENSORS[-1])
        if device.type == "cuda":
            torch.cuda.synchronize()
        with ManagerCalls() as calls:
            _synthetic_step(x, True, OFFLOAD_TENSORS[-1])
    return {**calls.summary(), "groups": OFFLOAD_GROUPS + 1, "tensors_per_group": OFFLOAD_TENSORS[-1]}


def _synthetic_input(device: torch.device) -> torch.Tensor | None:
    """The synthetic step's input, 1 MiB of fp32 (above any size floor); None where this machine has no
    copy streams (a CPU without the emulation, ``recipes.build.offload``)."""
    from recipes.build.offload import copy_streams_ready

    return torch.randn(512, 512, device=device, requires_grad=True) if copy_streams_ready(device) else None


def _synthetic_step(x: torch.Tensor, offload: bool, tensors: int) -> None:
    """``OFFLOAD_GROUPS`` + 1 groups through megatron's offload interface, each saving ``tensors``
    outputs of a sigmoid, then their backward (the manager keeps the last group)."""
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        FineGrainedActivationOffloadingInterface as off_interface,
    )

    off_interface.init_chunk_handler(pp_rank=0, vp_size=None, vp_stage=None, min_offloaded_tensor_size=0,
                                     delta_offload_bytes_across_pp_ranks=0, activation_offload_fraction=1.0)
    h = x
    for _ in range(OFFLOAD_GROUPS + 1):
        group = off_interface(offload, h, "core_attn")
        with group as h:
            for _ in range(tensors):
                h = torch.sigmoid(h)  # saves its output
        h = group.group_offload(h, forced_released_tensors=[])
    h.sum().backward()
    off_interface.reset()


@contextmanager
def _own_manager():
    """A fresh offload manager for the block, the model's put back after; yields a function that
    starts another fresh one."""
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import PipelineOffloadManager

    model_manager = PipelineOffloadManager.OFFLOAD_MGR
    PipelineOffloadManager.reset_instance()
    try:
        yield PipelineOffloadManager.reset_instance
    finally:
        PipelineOffloadManager.OFFLOAD_MGR = model_manager


@contextmanager
def function_host_ms():
    """While inside, each ``REGION_FUNCTIONS`` call under grad (as a replay runs it) is timed on the
    host; yields {label: [ms, ...]}, filled as calls happen."""
    calls: dict[str, list[float]] = defaultdict(list)
    restore = []
    for label, (module, cls_name, method) in REGION_FUNCTIONS.items():
        cls = getattr(import_module(module), cls_name)
        plain = getattr(cls, method)

        def timed(*args, _plain=plain, _label=label, **kwargs):
            if not torch.is_grad_enabled():
                return _plain(*args, **kwargs)
            start = time.perf_counter()
            try:
                return _plain(*args, **kwargs)
            finally:
                calls[_label].append((time.perf_counter() - start) * 1e3)

        setattr(cls, method, timed)
        restore.append((cls, method, plain))
    try:
        yield calls
    finally:
        for cls, method, plain in restore:
            setattr(cls, method, plain)
