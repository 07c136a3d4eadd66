"""Each workaround for a megatron-core 0.19.2 bug has a test here that reproduces the bug on
pristine megatron-core code. When upstream fixes the bug, the test fails: delete the workaround."""

from __future__ import annotations

import inspect
import os

import pytest
import torch
from conftest import compose, gradients


def test_checkpoint_without_output_fp8_default_is_still_true():
    """recipes.build.upstream.fix_checkpoint_without_output_fp8_default: ``fp8=False`` -> ``self.fp8=True``."""
    from megatron.core.tensor_parallel.random import CheckpointWithoutOutput

    from recipes.build import upstream

    upstream.fix_checkpoint_without_output_fp8_default()
    pristine = CheckpointWithoutOutput.__new__(CheckpointWithoutOutput)
    CheckpointWithoutOutput._recipes_original_init(pristine, fp8=False)
    assert pristine.fp8 is True, "upstream fixed the fp8 default: delete the workaround"
    assert CheckpointWithoutOutput(fp8=False).fp8 is False  # the workaround is in force


def test_dot_product_attention_still_rejects_k_channels():
    """recipes.build.attention exists because megatron's DotProductAttention cannot build MLA (issue 1589)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    params = inspect.signature(DotProductAttention.__init__).parameters
    assert "k_channels" not in params, "upstream accepts k_channels now: MLA may use it directly"


def test_sequential_mlp_still_ignores_moe_act(megatron_world):
    """recipes.build.experts exists because SequentialMLP accepts moe_act and recomputes nothing."""
    cfg = compose("model=moe", "model.experts=sequential", "recompute=control",
                  "recompute.recompute_modules=[moe_act]")
    _, _, _, counts = gradients(cfg)
    assert "moe_act" not in counts, "upstream SequentialMLP recomputes moe_act now"


def test_schedules_still_allocate_on_cuda():
    """recipes.build.compat redirects the schedules' token counter (device="cuda") on a CPU."""
    from megatron.core.pipeline_parallel import schedules

    source = inspect.getsource(schedules.forward_backward_no_pipelining)
    assert 'device="cuda"' in source, "schedules no longer hard-code CUDA: drop _TorchOnCpu"


def test_default_causal_mask_still_cuda_only():
    """recipes.build.attention builds its causal masks on the query's device because megatron's don't."""
    from megatron.core.transformer import utils

    assert 'device="cuda"' in inspect.getsource(utils.get_default_causal_mask)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU compatibility layer is CPU-only")
def test_cpu_compat_is_needed_and_scoped(monkeypatch):
    """The layer patches only without CUDA: pretending CUDA exists makes it a no-op."""
    from recipes.build import compat

    monkeypatch.setattr(compat, "_INSTALLED", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert compat.install_cpu_compat() is False


def _graph_held_by_dispatchers(trainer) -> list:
    """Tensors with an autograd graph that MoE token dispatchers still hold after a step."""
    held = []
    for chunk in trainer.chunks:
        for module in chunk.modules():
            dispatcher = getattr(module, "token_dispatcher", None)
            for value in vars(dispatcher).values() if dispatcher is not None else []:
                if torch.is_tensor(value) and value.grad_fn is not None:
                    held.append(value)
    return held


def test_allgather_dispatcher_still_keeps_local_probs_after_combine():
    """recipes.build.upstream.release_allgather_dispatcher_probs: pristine ``combine_postprocess`` leaves
    ``self.local_probs`` (and the router graph behind it) on the dispatcher."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    from recipes.build import upstream

    upstream.release_allgather_dispatcher_probs()
    pristine = MoEAllGatherTokenDispatcher.__new__(MoEAllGatherTokenDispatcher)
    pristine.hidden_shape = (4, 2)
    pristine.local_probs = torch.ones(3, requires_grad=True) * 2
    MoEAllGatherTokenDispatcher._recipes_original_combine_postprocess(pristine, torch.zeros(8))
    assert pristine.local_probs is not None, "upstream drops local_probs now: delete the workaround"


def test_full_recompute_moe_holds_no_router_graph_after_a_step(megatron_world):
    """With the workaround, no dispatcher keeps a graph (and the router's saved [s, b, h] inputs)
    alive between steps under full recompute; gradients are unchanged (the reference is dropped
    after its last use)."""
    import gc

    from conftest import build_trainer

    cfg = compose("model=moe", "recompute=full")
    trainer = build_trainer(cfg)
    try:
        trainer.step()
        gc.collect()
        assert _graph_held_by_dispatchers(trainer) == []
    finally:
        trainer.close()
    base = gradients(compose("model=moe", "recompute=none"))
    full = gradients(cfg)
    assert full[3]["full"]["recompute"] > 0  # the layers really were replayed
    for name, grad in base[1].items():
        torch.testing.assert_close(full[1][name], grad, msg=name)


def test_checkpoint_writer_still_needs_psutil_to_log_memory():
    """recipes.build.upstream.allow_checkpoint_save_without_psutil: dist_checkpointing's writer calls
    ``_process_memory()`` in every save, which raises without psutil (not a megatron-core dependency)."""
    import importlib.metadata
    import importlib.util

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    source = inspect.getsource(filesystem_async.FileSystemWriterAsync.write_preloaded_data)
    assert "_process_memory()" in source, "upstream no longer measures memory in every write"
    if importlib.util.find_spec("psutil") is None:
        from recipes.build import upstream

        upstream.allow_checkpoint_save_without_psutil()
        assert filesystem_async._process_memory() > 0  # the workaround is in force
    meta = importlib.metadata.requires("megatron-core") or []
    assert not any(r.split(";")[0].strip().startswith("psutil") for r in meta), \
        "megatron-core declares psutil now: delete the workaround and depend on it"


def test_checkpoint_write_results_still_go_through_a_spawned_manager(monkeypatch):
    """recipes.build.upstream.write_checkpoint_results_through_a_thread_queue: a process's first save makes
    its results queue in a ``spawn`` Manager process, whether or not the save runs asynchronously."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    asked = []

    class Context:
        def Manager(self):  # noqa: N802  multiprocessing's name
            asked.append("Manager")
            return type("Manager", (), {"Queue": lambda self: "queue"})()

    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    monkeypatch.setattr(filesystem_async.mp, "get_context", lambda mode: asked.append(mode) or Context())
    assert filesystem_async.get_write_results_queue() == "queue"
    assert asked == ["spawn", "Manager"], "upstream no longer starts a manager process: delete the workaround"


def test_distributed_optimizer_state_dict_still_needs_a_step_without_te():
    """megatron's DistributedOptimizer.state_dict() still asserts one Adam step value across the
    state (without Apex/TE), so a fresh optimizer cannot build the state dict a checkpoint loads into
    (recipes.build.upstream.prime_distributed_optimizer_for_loading). Its construction needs CUDA;
    the source shows the assumption, and this fails once upstream reads an empty state safely."""
    import inspect

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    source = inspect.getsource(DistributedOptimizer.state_dict)
    assert "assert len(steps) == 1" in source
    assert hasattr(DistributedOptimizer, "_init_optimizer_states_with_dummy_values")


def test_priming_touches_only_an_empty_distributed_optimizer(monkeypatch):
    """The workaround runs megatron's own dummy-state step on an inner optimizer with empty state, and
    never on one that has stepped (its moments would be overwritten) nor with TE present."""
    import types

    from recipes.build import upstream

    calls = []
    fresh = types.SimpleNamespace(optimizer=types.SimpleNamespace(state={}),
                                  _init_optimizer_states_with_dummy_values=lambda: calls.append("fresh"))
    stepped = types.SimpleNamespace(optimizer=types.SimpleNamespace(state={0: {"step": 1}}),
                                    _init_optimizer_states_with_dummy_values=lambda: calls.append("stepped"))
    chained = types.SimpleNamespace(chained_optimizers=[fresh, stepped])
    monkeypatch.setattr(upstream, "transformer_engine_available", lambda: False)
    assert upstream.prime_distributed_optimizer_for_loading(chained) == 1 and calls == ["fresh"]
    monkeypatch.setattr(upstream, "transformer_engine_available", lambda: True)
    assert upstream.prime_distributed_optimizer_for_loading(chained) == 0


def _fake_distributed_optimizer():
    """The attributes ``_set_main_param_and_optimizer_states`` reads, on a CPU (the real class needs
    CUDA): one main parameter whose torch-Adam state holds ``step`` as a tensor."""
    import types

    import torch

    main = torch.zeros(4)
    state = {main: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)}}
    model_param = torch.nn.Parameter(torch.zeros(4))
    fake = types.SimpleNamespace(
        model_param_group_index_map={model_param: (0, 0)},
        config=types.SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False),
        optimizer=types.SimpleNamespace(param_groups=[{"params": [main]}], state=state))
    loaded = {"param": torch.ones(4), "exp_avg": torch.full((4,), 2.0), "exp_avg_sq": torch.full((4,), 5.0)}
    return fake, model_param, loaded, main, state[main]


def test_reshardable_optimizer_load_still_needs_step_in_loaded_tensors():
    """megatron's ``_set_main_param_and_optimizer_states`` still raises KeyError: 'step' when torch's
    Adam keeps ``step`` as a state tensor and the fully_reshardable load leaves it out
    (recipes.build.upstream.load_reshardable_optimizer_with_torch_adam_step). Fails once upstream
    skips keys it was not given."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    method = getattr(DistributedOptimizer, "_recipes_original_set_main_param",
                     DistributedOptimizer._set_main_param_and_optimizer_states)
    fake, model_param, loaded, _, _ = _fake_distributed_optimizer()
    with pytest.raises(KeyError, match="step"):
        method(fake, model_param, loaded)


def test_reshardable_optimizer_load_copies_the_state_and_keeps_the_step(monkeypatch):
    """With the workaround the loaded parameter and moments are copied and ``step`` (set from the
    param groups by load_state_dict) is left as it is."""
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from recipes.build import upstream

    monkeypatch.setattr(upstream, "transformer_engine_available", lambda: False)
    assert upstream.load_reshardable_optimizer_with_torch_adam_step()
    fake, model_param, loaded, main, state = _fake_distributed_optimizer()
    DistributedOptimizer._set_main_param_and_optimizer_states(fake, model_param, loaded)
    assert torch.equal(main, loaded["param"]) and torch.equal(state["exp_avg_sq"], loaded["exp_avg_sq"])
    assert float(state["step"]) == 3.0


def _mla_without_q_lora():
    """An MLA config without q-LoRA but with qk_layernorm (Moonlight's), and the local spec's attention
    submodules for it."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    config = MLATransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, q_lora_rank=None,
                                  kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
                                  qk_layernorm=True, normalization="RMSNorm", transformer_impl="local")
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm")
    return config, spec.submodules.self_attention.submodules


def test_mla_without_q_lora_still_needs_te_on_the_local_spec():
    """megatron-core's QKNormConfigResolver still refuses MLA without q-LoRA on the local spec: first the
    spec's q_layernorm, then (without it) the missing fused layernorm+linear
    (recipes.build.upstream.build_mla_without_q_lora_on_local_spec). Fails once upstream builds it."""
    import dataclasses

    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver as R

    class Pristine(R):
        resolve = getattr(R, "_recipes_original_resolve", R.resolve)
        _mla_fused_linear_or_default = getattr(R, "_recipes_original_fused", R._mla_fused_linear_or_default)

    config, submodules = _mla_without_q_lora()
    with pytest.raises(ValueError, match="q_lora_rank is None"):
        Pristine(config, submodules).resolve()
    with pytest.raises(RuntimeError, match="requires TransformerEngine"):
        Pristine(config, dataclasses.replace(submodules, q_layernorm=IdentityOp)).resolve()


def test_mla_without_q_lora_builds_a_plain_q_projection(monkeypatch):
    """With the workaround: linear_q_proj is the spec's plain projection, no q norm, the kv norm kept."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver

    from recipes.build import upstream

    monkeypatch.setattr(upstream, "transformer_engine_available", lambda: False)
    assert upstream.build_mla_without_q_lora_on_local_spec()
    config, submodules = _mla_without_q_lora()
    resolved = QKNormConfigResolver(config, submodules).resolve()
    assert resolved["linear_q_proj"] is ColumnParallelLinear and resolved["q_layernorm"] is IdentityOp
    assert resolved["kv_layernorm"] is submodules.kv_layernorm


def test_fine_grained_offload_still_requires_transformer_engine(megatron_world, monkeypatch):
    """recipes.build.upstream.allow_fine_grained_offload_without_te: megatron's offload manager still
    raises "TE CPU offload is not available" on entering an offload point without Transformer Engine,
    though nothing it does needs it. Fails once upstream drops the guard: delete the workaround."""
    import types

    from megatron.core.extensions import transformer_engine as te_extension
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import PipelineOffloadManager

    from recipes.build import offload, upstream

    if upstream.transformer_engine_available():
        pytest.skip("Transformer Engine is installed: megatron's guard is satisfied by TE itself")
    assert upstream.allow_fine_grained_offload_without_te()
    offload.emulate_copy_streams_on_cpu()  # the manager allocates streams (CPU stand-ins here)
    manager = PipelineOffloadManager()
    manager._cur_forward_chunk = types.SimpleNamespace(do_offload=True)
    monkeypatch.setattr(te_extension, "cpu_offload", None)  # pristine: no TE
    with pytest.raises(RuntimeError, match="TE CPU offload is not available"):
        manager.__enter__()
    monkeypatch.undo()
    manager.__enter__()  # the workaround's stand-in satisfies the guard
    manager.__exit__()


def test_offload_inline_reload_still_races_its_copy_out(megatron_world, monkeypatch):
    """recipes.build.upstream.order_inline_reload_after_offload (Megatron-LM issue 7398): with
    megatron's pristine ``tensor_pop`` the manager's warm-up step reloads a tensor whose copy to the
    host has not landed, and its gradients are wrong (here NaN: the emulated host buffer is not yet
    written). With the workaround the same run is bit-exact (tests/test_offload.py). Fails once
    upstream orders that reload: delete the workaround."""
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import ChunkOffloadHandler
    from test_offload import EMULATED, run_steps

    plain = run_steps(compose("model=standard_attn"), steps=1)[0]
    monkeypatch.setattr(ChunkOffloadHandler, "tensor_pop", ChunkOffloadHandler._recipes_original_tensor_pop)
    pristine = run_steps(compose("model=standard_attn", "offload=core_attn-attn_proj", *EMULATED), steps=1)[0]
    wrong = [n for n, g in plain["grads"].items() if not torch.equal(g, pristine["grads"][n])]
    assert wrong, "upstream's inline reload waits for its copy now: delete the workaround"
    assert any(pristine["grads"][n].isnan().any() for n in wrong)


def test_vocab_parallel_cross_entropy_still_syncs_on_its_masks():
    """recipes.build.upstream.mask_cross_entropy_targets_without_host_sync: pristine
    ``calculate_predicted_logits`` makes two boolean-mask assignments (a host sync each on a GPU)."""
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as ce

    from recipes.build import upstream
    from recipes.measure.syncs import HostSyncCounter

    upstream.mask_cross_entropy_targets_without_host_sync()
    logits = torch.randn(3, 2, 16)
    with HostSyncCounter() as syncs:
        ce._recipes_original_calculate_predicted_logits(logits, torch.randint(0, 16, (3, 2)),
                                                        logits.max(-1)[0], 0, 8)
    assert len(syncs) == 2, "upstream masks without a host sync now: delete the workaround"


def test_cross_entropy_masks_without_host_sync_are_bit_identical(megatron_world):
    """The fixed loss makes no host sync and gives megatron's loss and logits gradient to the bit,
    for targets inside and outside a rank's vocab slice (the pristine function run side by side)."""
    from megatron.core.tensor_parallel import cross_entropy
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as ce

    from recipes.build import upstream
    from recipes.measure.syncs import HostSyncCounter

    upstream.mask_cross_entropy_targets_without_host_sync()
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 3, 32, generator=gen)
    target = torch.randint(0, 32, (5, 3), generator=gen)
    for start, end in ((0, 32), (0, 16), (16, 32)):  # all, first half, second half of the vocab
        outs = []
        for fn in (ce._recipes_original_calculate_predicted_logits, ce.calculate_predicted_logits):
            with HostSyncCounter() as syncs:
                outs.append(fn(logits.clone(), target, logits.max(-1)[0], start, end))
            assert len(syncs) == (2 if fn is ce._recipes_original_calculate_predicted_logits else 0)
        for a, b in zip(*outs):
            assert torch.equal(a, b)
    grads = []
    for fn in (ce._recipes_original_calculate_predicted_logits, ce.calculate_predicted_logits):
        ce.calculate_predicted_logits = staticmethod(fn)
        x = logits.clone().requires_grad_()
        loss = cross_entropy.vocab_parallel_cross_entropy(x, target, label_smoothing=0.0)
        loss.sum().backward()
        grads.append((loss.detach(), x.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_local_grad_norm_still_reads_every_norm_on_the_host():
    """recipes.build.upstream.grad_norm_without_host_syncs: pristine ``local_multi_tensor_l2_norm``
    reads the norms on the host: ``torch.tensor(l2)`` of device scalars (not seen by the counter: it
    reads them below the dispatcher; a GPU's sync warnings show one per parameter), then ``float()``
    of their norm, which the counter sees."""
    from megatron.core.utils import local_multi_tensor_l2_norm

    from recipes.measure.syncs import HostSyncCounter

    grads = [torch.randn(4, 3), torch.randn(5), torch.randn(2, 2)]
    with HostSyncCounter() as syncs:
        try:
            local_multi_tensor_l2_norm(0, None, [grads], False)
        except (RuntimeError, AssertionError):  # its result goes to "cuda", absent here
            pass
    assert len(syncs) >= 1, "upstream's grad norm stays on the device now: delete the workaround"


def test_grad_norm_without_host_syncs_matches_megatrons():
    """The device grad norm reads nothing on the host and equals the host-reduced norm to fp32."""
    from recipes.build import upstream
    from recipes.measure.syncs import HostSyncCounter

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(64, 32, generator=gen), torch.randn(100, generator=gen) * 1e-3,
             torch.randn(7, 7, generator=gen) * 10]
    with HostSyncCounter() as syncs:
        norm, _ = upstream._grad_l2_norm(0, None, [grads], False)
    assert len(syncs) == 0 and norm.shape == (1,) and norm.dtype == torch.float32
    reference = torch.norm(torch.tensor([torch.norm(g).item() for g in grads]))
    torch.testing.assert_close(norm[0], reference, rtol=1e-6, atol=0)
    assert upstream._grad_l2_norm(0, None, [grads[:1], grads[1:]], False)[0].allclose(norm, rtol=1e-6)



def _requires_grad_seen(monkeypatch, fbs, compiled_of) -> list[bool]:
    """The ``requires_grad`` of the tensors megatron's SwiGLU autograd functions hand the compiled
    ``swiglu`` and ``weighted_swiglu``, for an input without grad (the checkpointed forward) and with
    it (the replay). ``compiled_of(name)``: the object whose ``_recipes_compiled`` the call reaches,
    or None for the module attribute itself (pristine)."""
    seen: list[bool] = []
    for name in ("swiglu", "weighted_swiglu"):
        holder = compiled_of(name)
        compiled = holder._recipes_compiled if holder is not None else getattr(fbs, name)

        def spy(*args, eager=compiled._torchdynamo_orig_callable):
            seen.append(args[0].requires_grad)
            return eager(*args)

        if holder is None:
            monkeypatch.setattr(fbs, name, spy)
        else:
            monkeypatch.setattr(holder, "_recipes_compiled", spy)
    for grad in (False, True):
        fbs.SwiGLUFunction.apply(torch.randn(4, 8, requires_grad=grad), False, False)
    for grad in (False, True):
        fbs.WeightedSwiGLUFunction.apply(torch.randn(4, 8, requires_grad=grad), torch.rand(4, 1), False)
    return seen


def test_fused_swiglu_still_passes_the_callers_requires_grad(monkeypatch):
    """recipes.build.upstream.compile_fused_swiglu_once: pristine, the compiled function sees the
    caller's ``requires_grad``, which dynamo guards on, so a recompute's replay compiles it again."""
    from megatron.core.fusions import fused_bias_swiglu as fbs

    from recipes.build import upstream

    upstream.compile_fused_swiglu_once()
    for name in upstream.SWIGLU_FUSED:  # pristine: the functions megatron's jit_fuser compiled
        monkeypatch.setattr(fbs, name, getattr(fbs, name)._recipes_compiled)
    eager = fbs.swiglu._torchdynamo_orig_callable
    # weighted_swiglu's own call of swiglu records its input too
    assert _requires_grad_seen(monkeypatch, fbs, lambda name: None) == [False, True, False, False, True, True], \
        "upstream detaches the fused SwiGLU's inputs: delete compile_fused_swiglu_once"
    counted = torch.compile(eager, backend="eager")  # dynamo's guard
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for grad in (False, True):
        counted(torch.randn(4, 8, requires_grad=grad))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 2, "dynamo no longer guards on it"


def test_fused_swiglu_compiles_once_with_equal_values(monkeypatch):
    """With the workaround, the checkpointed forward and the replay hand the compiled functions the
    same kind of tensor, so each compiles once, and outputs and gradients equal eager arithmetic."""
    from megatron.core.fusions import fused_bias_swiglu as fbs

    from recipes.build import upstream

    upstream.compile_fused_swiglu_once()
    assert _requires_grad_seen(monkeypatch, fbs, lambda name: getattr(fbs, name)) == [False] * 6
    monkeypatch.undo()
    for name in upstream.SWIGLU_FUSED:  # dynamo alone (no inductor), so the count costs no compile
        wrapper = getattr(fbs, name)
        monkeypatch.setattr(wrapper, "_recipes_compiled", torch.compile(
            wrapper._recipes_compiled._torchdynamo_orig_callable, backend="eager"))
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    y = torch.randn(4, 8)
    for grad in (False, True):
        x = y.clone().requires_grad_(grad)
        out = fbs.SwiGLUFunction.apply(x, False, False)
        ref = y.clone().requires_grad_(grad)
        expected = torch.nn.functional.silu(ref[:, :4]) * ref[:, 4:]
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        if grad:
            out.sum().backward()
            expected.sum().backward()
            torch.testing.assert_close(x.grad, ref.grad)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 2, "swiglu and swiglu_back once each"


def test_checkpoint_without_output_still_builds_a_cpp_extension():
    """recipes.build.upstream.share_recomputed_cpu_outputs_without_a_cpp_build: megatron compiles its
    ``share_storage`` with ``load_inline`` (ninja, a C++ compiler) at a machine's first recompute."""
    from megatron.core.tensor_parallel import random as mcore_random

    from recipes.build import upstream

    upstream.share_recomputed_cpu_outputs_without_a_cpp_build()
    assert "load_inline" in inspect.getsource(mcore_random._recipes_original_get_share_storage), \
        "megatron no longer builds share_storage at run time: delete the workaround"


def _discarded_output(n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpointed output after ``discard_output``: its storage freed, a view of it kept."""
    dst = torch.zeros(n)
    view = dst.view(2, n // 2)
    dst.untyped_storage().resize_(0)
    return dst, view


def _share_with_megatrons_recorded(monkeypatch) -> list:
    """megatron's ``share_storage`` as the workaround reaches it, replaced by a recorder (no build)."""
    from megatron.core.tensor_parallel import random as mcore_random

    from recipes.build import upstream

    upstream.share_recomputed_cpu_outputs_without_a_cpp_build()
    calls: list = []
    monkeypatch.setattr(mcore_random, "_recipes_original_get_share_storage",
                        lambda: lambda d, s: calls.append((d, s)))
    return calls


@pytest.mark.skipif(not hasattr(torch.UntypedStorage, "_swap_data_ptr_"), reason="this torch has no storage swap")
def test_recomputed_cpu_outputs_are_shared_without_a_build_or_a_copy(monkeypatch):
    from megatron.core.tensor_parallel import random as mcore_random

    calls = _share_with_megatrons_recorded(monkeypatch)
    dst, view = _discarded_output()
    x = torch.randn(6, requires_grad=True)
    src = x * 2
    address = src.data_ptr()
    mcore_random._get_share_storage()(dst, src)
    assert calls == []  # megatron's extension not asked for
    assert dst.data_ptr() == src.data_ptr() == address  # no copy: the recomputed memory itself
    assert torch.equal(dst, src) and torch.equal(view.reshape(-1), src)  # views of the output see it
    src.sum().backward()  # the recomputed graph still runs backward from src
    assert torch.equal(x.grad, torch.full((6,), 2.0))


def test_a_recomputed_output_held_elsewhere_goes_to_megatrons_share(monkeypatch):
    """An output an autograd node saved (sigmoid keeps its result) must keep its memory: megatron's
    extension shares it instead of a swap."""
    from megatron.core.tensor_parallel import random as mcore_random

    calls = _share_with_megatrons_recorded(monkeypatch)
    dst, _ = _discarded_output()
    src = torch.sigmoid(torch.randn(6, requires_grad=True))
    mcore_random._get_share_storage()(dst, src)
    assert len(calls) == 1 and calls[0][1] is src


@pytest.mark.slow
def test_the_background_build_is_the_one_megatrons_recompute_loads(tmp_path, monkeypatch):
    """recipes.build.upstream.start_share_storage_build: a worker that reaches megatron's
    ``_get_share_storage`` while the background build runs (or after it) loads that build; the
    extension is compiled once (ninja's log), and a later start builds nothing."""
    import subprocess
    import sys

    from recipes.build import upstream
    from recipes.validate.share_storage import share_storage_build_problem, share_storage_built

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    if share_storage_build_problem() is not None:
        pytest.skip(f"megatron's extension cannot be built here: {share_storage_build_problem()}")
    assert share_storage_built() is False
    env = {**os.environ}
    builder = upstream.start_share_storage_build(env)
    assert builder is not None
    loader = subprocess.run([sys.executable, "-c", "from megatron.core.tensor_parallel.random import "
                             "_get_share_storage; _get_share_storage()"], env=env, capture_output=True, text=True,
                            timeout=600)
    assert builder.wait(timeout=600) == 0 and loader.returncode == 0, loader.stderr[-2000:]
    assert share_storage_built() is True
    log = next(tmp_path.rglob(".ninja_log")).read_text().splitlines()
    outputs = [line.split("\t")[3] for line in log if not line.startswith("#")]  # start, end, mtime, output, hash
    assert [o for o in outputs if o.endswith(".o")] == ["main.o"], log
    assert upstream.start_share_storage_build(env) is None
