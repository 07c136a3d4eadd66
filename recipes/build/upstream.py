"""Workarounds for megatron-core 0.19.2 bugs, each in one place, each naming the bug.

Every function here has a test in ``tests/test_upstream.py`` that reproduces the bug on a pristine
megatron-core and fails once upstream fixes it, so the workaround can be deleted.

Bugs handled elsewhere (by design, not by patching):
- MLA cannot be built with the local spec (``DotProductAttention`` rejects ``k_channels``,
  Megatron-LM issue 1589): ``recipes.build.attention`` provides core-attention modules that accept
  ``k_channels``/``v_channels``.
- ``moe_act`` is implemented only in ``TEGroupedMLP``; the local spec builds ``SequentialMLP`` where
  it is a silent no-op: ``recipes.build.experts.GroupedExperts`` implements it without TE.
- ``selective mlp`` with ``add_bias_linear=True`` recurses in backward and MoE with biases fails in
  place (mlp.py:354): ``recipes.validate`` refuses ``add_bias_linear=True``.
- GatedDeltaNet cannot be built without Transformer Engine: the hybrid block spec asserts
  ``transformer_impl == "transformer_engine"`` and ``get_gated_delta_net_module_spec`` on the local
  backend gives ``in_proj=None`` (it fuses the input norm into TE's norm+linear): ``recipes.build.gdn``
  builds the same layers from local modules (test: ``tests/test_gdn.py``).
"""

from __future__ import annotations

import functools
import queue
import subprocess
from collections.abc import Callable

import torch

_FIXED: set[str] = set()


def _workaround(key: str, without_te: bool = True) -> Callable[[Callable[[], bool | None]], Callable[[], bool]]:
    """One patch per process: the decorated function patches megatron-core and returns None, or False
    when this environment does not need it. The wrapper returns True once the patch is in place
    (again on later calls), False when it does not apply; ``without_te``: with Transformer Engine
    installed, the bug's code path is not taken and nothing is patched."""

    def decorate(patch: Callable[[], bool | None]) -> Callable[[], bool]:
        @functools.wraps(patch)
        def apply() -> bool:
            if key in _FIXED:
                return True
            if without_te and transformer_engine_available():
                return False
            if patch() is False:
                return False
            _FIXED.add(key)
            return True

        return apply

    return decorate


def transformer_engine_available() -> bool:
    """True when Transformer Engine imports (megatron's own HAVE_TE)."""
    # lazy: megatron takes seconds to import; tools that never build a model skip it
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return bool(HAVE_TE)


@_workaround("cwo_fp8")
def fix_checkpoint_without_output_fp8_default() -> bool | None:
    """``CheckpointWithoutOutput(fp8=False)`` sets ``self.fp8 = (fp8 is not None)``, i.e. True.

    Its forward then takes the FP8 branch and raises ``NameError: FP8GlobalStateManager`` without
    Transformer Engine (random.py ~L693), breaking ``layernorm``, ``moe_act`` and ``gdn_norm_out``
    recompute. Upstream documents the default as deliberate for FP8 amax bookkeeping *with* TE, so
    the fix applies only when TE is absent (FP8 cannot be on then): ``self.fp8 = bool(fp8)``.
    Returns True when the fix was applied.
    """
    from megatron.core.tensor_parallel import random as mcore_random

    cls = mcore_random.CheckpointWithoutOutput
    original_init = cls.__init__

    def __init__(self, fp8=False):
        original_init(self, fp8)
        self.fp8 = bool(fp8)

    cls.__init__ = __init__
    cls._recipes_original_init = original_init


@_workaround("torch_norm_sp", without_te=False)
def allow_sequence_parallel_torch_norm() -> bool | None:
    """``WrappedTorchNorm`` asserts ``not config.sequence_parallel`` (megatron/core/transformer/torch_norm.py).

    It is the local spec's norm whenever Apex and Transformer Engine are absent, so sequence
    parallel cannot be built at all here, on a GPU or a CPU. Nothing in a torch norm depends on it:
    under sequence parallel each tensor-parallel rank normalizes its sequence shard with a
    replicated weight whose gradient must be summed over TP, which megatron's
    ``finalize_model_grads`` (and ``recipes.build.parallel.reduce_gradients_cpu``) do for parameters
    marked ``sequence_parallel=True``, as Apex's FusedLayerNorm and TENorm mark theirs. The fix
    builds the norm from a copy of the config with the flag off and marks the weights.
    Returns True when the fix was applied.
    """
    import copy

    from megatron.core.transformer import torch_norm

    cls = torch_norm.WrappedTorchNorm
    original_new = cls.__new__

    def __new__(klass, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return original_new(klass, config, hidden_size, *args, **kwargs)
        shadow = copy.copy(config)  # shallow: the run's TransformerConfig itself is not touched
        shadow.sequence_parallel = False
        norm = original_new(klass, shadow, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    cls.__new__ = staticmethod(__new__)
    cls._recipes_original_new = original_new


@_workaround("dispatcher_probs", without_te=False)
def release_allgather_dispatcher_probs() -> bool | None:
    """``MoEAllGatherTokenDispatcher`` keeps ``self.local_probs`` after the combine (token_dispatcher.py,
    ``dispatch_postprocess``). That attribute is the routing probabilities together with their
    autograd graph, and nothing reads it once ``combine_postprocess`` has run.

    Without recompute, backward frees the graph's saved tensors and only an empty graph stays
    referenced. Under full recompute the attribute holds the *recompute's* graph, and the router's
    saved activations stay alive after the step until the next forward overwrites them: two [s, b,
    h] fp32 tensors per MoE layer. This was found on a CPU (``tests/test_upstream.py``). It
    matches the H200's `full` MoE point (docs/estimate.md), which held 0.5 GiB more static memory
    than every other MoE point, about 64 MiB per layer. The fix drops the reference at the end of
    ``combine_postprocess``; the autograd graph keeps what backward needs. Returns True when applied.
    """
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher as cls

    original = cls.combine_postprocess

    def combine_postprocess(self, hidden_states):
        out = original(self, hidden_states)
        self.local_probs = None
        return out

    cls.combine_postprocess = combine_postprocess
    cls._recipes_original_combine_postprocess = original


@_workaround("psutil", without_te=False)
def allow_checkpoint_save_without_psutil() -> bool | None:
    """``dist_checkpointing``'s file writer logs its process's memory around every write through
    ``_process_memory()`` (strategies/filesystem_async.py), which raises "psutil is not installed"
    without psutil, a package megatron-core 0.19.2 does not declare. Without psutil, the resident
    set size comes from ``/proc/self/statm`` (it is only logged). Returns True when applied."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async.HAVE_PSUTIL:
        return False
    import os

    def _process_memory() -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return 0

    filesystem_async._process_memory = _process_memory


@_workaround("results_queue", without_te=False)
def write_checkpoint_results_through_a_thread_queue() -> bool | None:
    """``dist_checkpointing``'s file writer hands each save's write results over a queue that
    ``get_write_results_queue`` (strategies/filesystem_async.py) makes at a process's first save as
    ``multiprocessing.get_context("spawn").Manager().Queue()``, also for a synchronous save, whose writer
    threads and reader are that process (``AsyncRequest.execute_sync``). The manager is a fresh Python
    process per rank that imports torch to unpickle the results (5-9 CPU-s on two cores, at the first
    save) and stays until the rank exits. This project saves synchronously (``recipes.run.checkpoint``),
    so a thread queue carries the results. Returns True when applied."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()  # the writer threads and the reader: this process


def prime_distributed_optimizer_for_loading(optimizer) -> int:
    """Without Apex or Transformer Engine, ``DistributedOptimizer.state_dict()`` reads Adam's ``step``
    from every parameter's state and asserts there is exactly one value (distrib_optimizer.py,
    ``assert len(steps) == 1``): before the first step the state is empty, so building the sharded
    state dict to load a checkpoint into a fresh optimizer fails (seen on two H200s, megatron-core
    0.19.2, loading a TP2 checkpoint at TP1). megatron's own FSDP path fills the state with dummy
    values first (``_init_optimizer_states_with_dummy_values``: one zero-gradient step); the same
    here, on each inner DistributedOptimizer whose state is empty, before the load replaces it.
    Returns how many it primed."""
    primed = 0
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        init = getattr(inner, "_init_optimizer_states_with_dummy_values", None)
        if init is not None and not transformer_engine_available() and not inner.optimizer.state:
            init()
            primed += 1
    return primed


class _StepLoadedSeparately(dict):
    """A loaded parameter's state tensors, reading any absent key as "not a tensor" (skipped)."""

    def __missing__(self, key):
        return None


@_workaround("adam_step_load")
def load_reshardable_optimizer_with_torch_adam_step() -> bool | None:
    """Loading a ``fully_reshardable`` DistributedOptimizer checkpoint with torch's Adam (no Apex or
    Transformer Engine) raises ``KeyError: 'step'`` in ``_set_main_param_and_optimizer_states``
    (distrib_optimizer.py): it copies every tensor of the parameter's optimizer state from the loaded
    tensors, torch's Adam keeps ``step`` there as a tensor, and
    ``load_parameter_state_from_fully_reshardable`` leaves ``step`` out ("Handle torch Adam 'step'
    state separately": ``load_state_dict`` sets it from the param groups just before). Seen on two
    H200s, megatron-core 0.19.2, loading a TP2 checkpoint at TP1. The fix lets an absent key count as
    "not a tensor", which that method already skips. Returns True when applied."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        return original(self, model_param, _StepLoadedSeparately(tensors))

    DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
    DistributedOptimizer._recipes_original_set_main_param = original


@_workaround("mla_no_q_lora")
def build_mla_without_q_lora_on_local_spec() -> bool | None:
    """MLA without a q down-projection (``q_lora_rank`` null: Moonlight, DeepSeek-V2-Lite) and with
    ``qk_layernorm`` cannot be built on the local spec: megatron-core 0.19.2's ``QKNormConfigResolver``
    (transformer/mla_qk_norm_config.py) refuses the local spec's q_layernorm ("is non-trivial, but
    q_lora_rank is None") and, without it, asks for Transformer Engine's fused layernorm+linear as
    ``linear_q_proj`` ("qk_layernorm requires TransformerEngine"). The published models have no q norm
    there (only ``kv_a_layernorm``): without TE the resolver here builds ``linear_q_proj`` as the plain
    column-parallel projection and no q norm; the kv norm is unchanged. Returns True when applied."""
    import dataclasses

    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver

    original_resolve = QKNormConfigResolver.resolve
    original_fused = QKNormConfigResolver._mla_fused_linear_or_default

    def _no_q_lora_here(self) -> bool:
        return not self.has_q_lora and not self.is_dsa and self.fused_norm_linear_impl is None

    def resolve(self):
        if _no_q_lora_here(self) and self.config.qk_layernorm:
            self.submodules = dataclasses.replace(self.submodules, q_layernorm=IdentityOp)
        return original_resolve(self)

    def _mla_fused_linear_or_default(self, module_spec, module_name):
        if module_name == "linear_q_proj" and _no_q_lora_here(self):
            return module_spec or self.linear_impl
        return original_fused(self, module_spec, module_name)

    QKNormConfigResolver.resolve = resolve
    QKNormConfigResolver._mla_fused_linear_or_default = _mla_fused_linear_or_default
    QKNormConfigResolver._recipes_original_resolve = original_resolve
    QKNormConfigResolver._recipes_original_fused = original_fused


class _NoTransformerEngineOffload:
    """What megatron's fine-grained offload manager needs of Transformer Engine's ``cpu_offload``
    module: the flag it sets around each offload point, which only TE's own layers read."""

    CPUOffloadEnabled = False


@_workaround("te_offload_flag")
def allow_fine_grained_offload_without_te() -> bool | None:
    """megatron-core 0.19.2's fine-grained activation offload runs only with Transformer Engine:
    ``PipelineOffloadManager.__enter__``/``__exit__`` (pipeline_parallel/fine_grained_activation_offload.py,
    ~L779-805) import ``cpu_offload`` from ``megatron.core.extensions.transformer_engine``, set its
    ``CPUOffloadEnabled`` flag, and raise "TE CPU offload is not available" when it is None. Everything
    else the manager does is plain PyTorch (saved-tensor hooks, a pinned host pool, copy streams), and
    on the local spec nothing reads that flag. The fix gives the import a stand-in with the flag, only
    when Transformer Engine is absent. Returns True when applied."""
    from megatron.core.extensions import transformer_engine as te_extension

    if te_extension.cpu_offload is not None:
        return False
    te_extension.cpu_offload = _NoTransformerEngineOffload


@_workaround("inline_reload", without_te=False)
def order_inline_reload_after_offload() -> bool | None:
    """``ChunkOffloadHandler.tensor_pop`` reloads a tensor that is still on the host inline, on the
    current (compute) stream, with no wait for the device-to-host copy that fills its host buffer
    (``bulk_reload_group`` waits on the group's offload event; this path does not). When backward
    reaches a group before any prefetch reloaded it, which happens in the manager's first (warm-up)
    step, the copy back reads the buffer before it is written: wrong gradients, nothing raised
    (Megatron-LM issue 7398, open; PR 7399). The fix makes the current stream wait on the group's
    offload event before that inline reload (tests/test_offload.py shows the wrong gradients on a CPU
    without it). Returns True when applied."""
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    cls = fgo.ChunkOffloadHandler
    original = cls.tensor_pop

    def tensor_pop(self, tensor_tag):
        if isinstance(tensor_tag, tuple):
            group = self.offload_groups[tensor_tag[0] - 1]
            if isinstance(group._tensors.get(tensor_tag), tuple):  # still on the host: copy it back
                group.wait_offload_event(fgo.torch.cuda.current_stream())  # after its copy out
        return original(self, tensor_tag)

    cls.tensor_pop = tensor_pop
    cls._recipes_original_tensor_pop = original


@_workaround("ce_mask_sync", without_te=False)
def mask_cross_entropy_targets_without_host_sync() -> bool | None:
    """``VocabParallelCrossEntropy.calculate_predicted_logits`` (tensor_parallel/cross_entropy.py:47
    and :59) zeroes the targets outside this rank's vocab slice and their logits with boolean-mask
    assignments (``masked_target[target_mask] = 0``). On a GPU each one first counts the mask's
    entries on the host: two waits for the device in every micro-batch's loss, of every family, with
    the forward's kernels still queued. The fix computes the same values with ``masked_fill_`` (no
    count, no wait); the loss and its gradient are bit-identical (tests/test_upstream.py). Returns
    True when applied."""
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as ce

    original = ce.calculate_predicted_logits

    def calculate_predicted_logits(vocab_parallel_logits, target, logits_max, vocab_start_index,
                                   vocab_end_index):
        vocab_parallel_logits -= logits_max.unsqueeze(dim=-1)
        target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
        masked_target = (target.clone() - vocab_start_index).masked_fill_(target_mask, 0)
        partition_vocab_size = vocab_parallel_logits.size()[-1]
        logits_2d = vocab_parallel_logits.view(-1, partition_vocab_size)
        masked_target_1d = masked_target.view(-1)
        arange_1d = torch.arange(start=0, end=logits_2d.size()[0], device=logits_2d.device)
        predicted_logits = logits_2d[arange_1d, masked_target_1d].clone().contiguous().view_as(target)
        predicted_logits.masked_fill_(target_mask, 0.0)
        exp_logits = vocab_parallel_logits
        torch.exp(vocab_parallel_logits, out=exp_logits)
        return target_mask, masked_target_1d, predicted_logits, exp_logits.sum(dim=-1), exp_logits

    ce.calculate_predicted_logits = staticmethod(calculate_predicted_logits)
    ce._recipes_original_calculate_predicted_logits = staticmethod(original)


def _grad_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """megatron's ``local_multi_tensor_l2_norm`` (the l2 norm of all tensors, as a [1] fp32 tensor)
    with every norm on the device: ``torch._foreach_norm``, then the norm of those norms."""
    norms = [norm for tensors in tensor_lists if tensors for norm in torch._foreach_norm(tensors)]
    if not norms:
        return torch.zeros(1, dtype=torch.float, device="cuda"), None
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


@_workaround("grad_norm_sync")
def grad_norm_without_host_syncs() -> bool | None:
    """Without Apex or Transformer Engine, megatron's grad-norm falls back to
    ``megatron.core.utils.local_multi_tensor_l2_norm`` (utils.py ~L1325, used by
    optimizer/clip_grads.py ``get_grad_norm_fp32``): ``torch.tensor(l2)`` of a list of device scalars
    copies each parameter's norm to the host one at a time, then ``float()`` and a copy back: a host
    wait for every parameter in every step (51 at the h200 dense size, 59 for MoE), each a round
    trip while the GPU idles. The fix computes the same norm on the device (``_grad_l2_norm``); the
    only host read left is clip_grads' own ``total_norm.item()``. The value may differ from the
    host's fp32 reduction in the last bit (a different summation order). Returns True when applied."""
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is not mcore_utils.local_multi_tensor_l2_norm:
        return False  # Apex's fused kernel: no host copies
    clip_grads.l2_norm_impl = _grad_l2_norm
    clip_grads._recipes_original_l2_norm_impl = mcore_utils.local_multi_tensor_l2_norm


#: megatron's ``jit_fuser`` functions in fusions/fused_bias_swiglu.py (``torch.compile`` since torch 2.2)
SWIGLU_FUSED = ("swiglu", "bias_swiglu", "weighted_swiglu", "swiglu_back", "bias_swiglu_back",
                "weighted_swiglu_back")


@_workaround("swiglu_one_compile", without_te=False)
def compile_fused_swiglu_once() -> bool | None:
    """megatron's fused SwiGLU (``SwiGLUFunction``, ``WeightedSwiGLUFunction``,
    fusions/fused_bias_swiglu.py) calls its ``torch.compile``-d functions on the autograd function's
    own inputs, and dynamo guards on their ``requires_grad``. A recompute replays the MLP with inputs
    that require grad where the checkpointed forward's did not, so every recompute run compiled each
    function twice, and its first graph was not the one a plain run's compile left in inductor's
    cache. Inside an autograd function's forward and backward grad mode is off, so ``requires_grad``
    changes nothing they compute: the fix hands the compiled functions detached tensors (same
    storage, same values; one graph, shared with the plain run's). On two CPU cores (size=tiny,
    fusion forced on, after the ``none`` point) the first ``selective/mlp`` point's first step took
    22.8 s, and 1.1 s with this fix; on the H200's host a compile of one of these graphs took 0.3-0.5 s
    (what costs a fresh machine's first ``selective/mlp`` point 13-24 s is megatron's
    ``share_storage`` build: docs/speed.md). Returns True when applied."""
    from megatron.core.fusions import fused_bias_swiglu as fbs

    def detaching(compiled):
        @functools.wraps(compiled)
        def call(*args):
            return call._recipes_compiled(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args))

        call._recipes_compiled = compiled
        return call

    for name in SWIGLU_FUSED:
        setattr(fbs, name, detaching(getattr(fbs, name)))


def _share_storage_in_python(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """megatron's ``share_storage`` for CPU tensors, without its C++ extension: ``dst``'s storage (and
    so every view of it) takes the recomputed ``src``'s memory, no copy. The two storages swap their
    memory (dst's was freed when the output was discarded) and ``src`` is pointed at dst's storage, so
    both read the same bytes, as megatron's refcounted share leaves them. False, doing nothing, where
    that is not known to be right: CUDA tensors (not checked on a GPU: torch 2.11 there has no
    ``_swap_data_ptr_``, and a fused ``selective/mlp`` output is held elsewhere), or a ``src`` whose
    storage something else holds (a view, an autograd node that saved it), which a swap would empty
    under it."""
    if src.is_cuda:
        return False
    src_storage = src.untyped_storage()
    if torch._C._storage_Use_Count(src_storage._cdata) > 2:  # src and this handle; more: not ours to move
        return False
    dst_storage = dst.untyped_storage()
    dst_storage._swap_data_ptr_(src_storage)
    with torch.no_grad():
        src.set_(dst_storage, src.storage_offset(), src.size(), src.stride())
    return True


@_workaround("share_storage_on_cpu", without_te=False)
def share_recomputed_cpu_outputs_without_a_cpp_build() -> bool | None:
    """megatron-core 0.19.2's ``CheckpointWithoutOutput._recompute`` (tensor_parallel/random.py,
    ``_get_share_storage``) hands the recomputed outputs' memory to the discarded ones through a C++
    extension it compiles with ``torch.utils.cpp_extension.load_inline`` (ninja, a C++ compiler) at a
    machine's first recompute: 42 s on two CPU cores, paid by the first ``selective/mlp`` point of
    ``make run`` on a fresh machine (13-24 s on an H200's host). For CPU tensors
    ``_share_storage_in_python`` does it without the build; everything else takes megatron's
    extension, built on first use as before. Returns True when applied, False on a torch without the
    storage swap (``recipes.validate.share_storage.torch_swaps_storages``)."""
    from recipes.validate.share_storage import torch_swaps_storages

    if not torch_swaps_storages():
        return False
    from megatron.core.tensor_parallel import random as mcore_random

    def share_storage(dst: torch.Tensor, src: torch.Tensor) -> None:
        if not _share_storage_in_python(dst, src):
            mcore_random._recipes_original_get_share_storage()(dst, src)

    mcore_random._recipes_original_get_share_storage = mcore_random._get_share_storage
    mcore_random._get_share_storage = lambda: share_storage


#: What ``start_share_storage_build`` runs: megatron's own ``_get_share_storage`` (so the build is the
#: one its recompute loads), with SIGTERM turned into an exit, so torch's build lock is released.
SHARE_STORAGE_BUILD = ("import signal, sys; signal.signal(signal.SIGTERM, lambda *_: sys.exit(143)); "
                       "from megatron.core.tensor_parallel.random import _get_share_storage; _get_share_storage()")


def start_share_storage_build(env: dict[str, str]) -> subprocess.Popen | None:
    """Build megatron-core 0.19.2's ``share_storage`` extension (``_get_share_storage``, above) in a
    background process, so that a fresh machine's first recompute through ``CheckpointWithoutOutput``
    finds it built, or waits only for the rest of the build, instead of building it (13-24 s on an
    H200's host) inside a measured point. torch's ``load_inline`` takes a file lock in the build
    directory: the worker that gets there first waits for this build and loads its library. The
    process runs at a lower priority in its own session (a Ctrl-C of the sweep lets it finish and
    release the lock); its output is dropped: a build that fails here fails again in the worker,
    which reports it. None, starting nothing, when the library is built already, or where the build
    cannot run (``recipes.validate.share_storage.share_storage_build_problem``, which refuses those runs)."""
    import shutil
    import sys

    from recipes.validate.share_storage import share_storage_build_problem, share_storage_built

    if share_storage_built() is not False or share_storage_build_problem() is not None:
        return None
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    return subprocess.Popen([*nice, sys.executable, "-c", SHARE_STORAGE_BUILD], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def apply_all() -> None:
    """Apply every workaround that applies to this environment (idempotent)."""
    allow_fine_grained_offload_without_te()
    order_inline_reload_after_offload()
    allow_checkpoint_save_without_psutil()
    write_checkpoint_results_through_a_thread_queue()
    load_reshardable_optimizer_with_torch_adam_step()
    build_mla_without_q_lora_on_local_spec()
    fix_checkpoint_without_output_fp8_default()
    allow_sequence_parallel_torch_norm()
    release_allgather_dispatcher_probs()
    mask_cross_entropy_targets_without_host_sync()
    grad_norm_without_host_syncs()
    compile_fused_swiglu_once()
    share_recomputed_cpu_outputs_without_a_cpp_build()
