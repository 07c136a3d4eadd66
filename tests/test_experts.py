"""GroupedExperts vs megatron's SequentialMLP on a CPU, and its moe_act recompute.

One process, gloo, world size 1. Every comparison uses the same weights (``load_from_sequential``)
and uneven token counts with an expert that receives none.
"""

from __future__ import annotations

import copy
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.random import CheckpointWithoutOutput
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from recipes.build import upstream
from recipes.build.compat import install_cpu_compat, seed_model_parallel_rng
from recipes.build.experts import GroupedExperts, grouped_experts_builder

HIDDEN, FFN, EXPERTS = 16, 24, 4
TOKENS_PER_EXPERT = [5, 0, 9, 3]  # uneven, expert 1 gets nothing
IMPLS = ["loop"] + (["grouped_mm"] if hasattr(torch, "_grouped_mm") else [])


@pytest.fixture(scope="module", autouse=True)
def model_parallel():
    """Single-process gloo group + megatron model-parallel state, torn down after the module."""
    created = not dist.is_initialized()
    if created:
        from launch.torchrun import ONE_RANK_ENV

        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = ONE_RANK_ENV["MASTER_ADDR"], ONE_RANK_ENV["MASTER_PORT"]
        dist.init_process_group("gloo", rank=0, world_size=1)
    owns_state = not parallel_state.model_parallel_is_initialized()  # else conftest's megatron_world
    if owns_state:
        parallel_state.initialize_model_parallel()
    install_cpu_compat()
    upstream.apply_all()
    seed_model_parallel_rng(1234)
    yield
    if owns_state:
        parallel_state.destroy_model_parallel()
    if created:
        dist.destroy_process_group()


def make_config(**overrides) -> TransformerConfig:
    kwargs = dict(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        num_moe_experts=EXPERTS,
        moe_ffn_hidden_size=FFN,
        moe_router_topk=2,
        moe_grouped_gemm=True,
        moe_token_dispatcher_type="allgather",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        params_dtype=torch.float32,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def make_sequential(config: TransformerConfig) -> SequentialMLP:
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    return SequentialMLP(
        EXPERTS, config, submodules, pg_collection=ProcessGroupCollection.use_mpu_process_groups()
    )


def make_inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(TOKENS_PER_EXPERT)
    x = torch.randn(tokens, HIDDEN, generator=gen, requires_grad=True)
    probs = torch.rand(tokens, generator=gen, requires_grad=True)
    grad = torch.randn(tokens, HIDDEN, generator=gen)
    return x, torch.tensor(TOKENS_PER_EXPERT), probs, grad


def run(experts, x, tokens_per_expert, probs, grad):
    """Forward + backward on fresh leaf copies; returns output and every gradient."""
    x, probs = x.detach().requires_grad_(), probs.detach().requires_grad_()
    experts.zero_grad(set_to_none=True)
    out, bias = experts(x, tokens_per_expert, probs)
    assert bias is None
    out.backward(grad)
    return out.detach(), x.grad, probs.grad


def weight_grads(experts):
    if isinstance(experts, SequentialMLP):
        fc1 = torch.stack([e.linear_fc1.weight.grad for e in experts.local_experts])
        fc2 = torch.stack([e.linear_fc2.weight.grad for e in experts.local_experts])
        return fc1, fc2
    return experts.weight1.grad, experts.weight2.grad


TIGHT = dict(rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "variant",
    [
        dict(),  # SwiGLU, top-2
        dict(gated_linear_unit=False, activation_func=F.gelu),
        dict(moe_router_topk=1, moe_router_pre_softmax=True, moe_apply_probs_on_input=True),
        dict(bias_activation_fusion=True),  # megatron's weighted SwiGLU kernel
    ],
    ids=["swiglu", "gelu", "probs_on_input", "fused_swiglu"],
)
def test_matches_sequential_mlp(impl, variant):
    config = make_config(**variant)
    sequential = make_sequential(config)
    grouped = GroupedExperts(EXPERTS, config).load_from_sequential(sequential)
    grouped.gemm_impl = impl
    inputs = make_inputs()
    for got, want in zip(run(grouped, *inputs), run(sequential, *inputs)):
        torch.testing.assert_close(got, want, **TIGHT)
    for got, want in zip(weight_grads(grouped), weight_grads(sequential)):
        torch.testing.assert_close(got, want, **TIGHT)
    assert weight_grads(grouped)[0][1].abs().max() == 0  # the expert with no tokens


def test_same_seed_same_initial_weights_as_sequential_mlp():
    config = make_config()
    seed_model_parallel_rng(7)
    sequential = make_sequential(config)
    seed_model_parallel_rng(7)
    grouped = GroupedExperts(EXPERTS, config)
    reference = GroupedExperts(EXPERTS, config).load_from_sequential(sequential)
    assert torch.equal(grouped.weight1, reference.weight1)
    assert torch.equal(grouped.weight2, reference.weight2)


def saved_bytes_and_output(experts, x, tokens_per_expert, probs):
    """Bytes of the unique storages autograd holds after one forward (discarded ones count 0)."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = experts(x, tokens_per_expert, probs)
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in saved}
    return sum(storages.values()), out


@pytest.mark.parametrize("impl", IMPLS)
def test_moe_act_recomputes_once_exactly_and_saves_memory(impl, monkeypatch):
    plain = GroupedExperts(EXPERTS, make_config())
    recomputed = GroupedExperts(
        EXPERTS, make_config(recompute_granularity="selective", recompute_modules=["moe_act"])
    )
    recomputed.load_state_dict(plain.state_dict())
    assert recomputed.activation_recompute and not plain.activation_recompute
    plain.gemm_impl = recomputed.gemm_impl = impl

    recomputes = []
    original = CheckpointWithoutOutput._recompute

    def counting_recompute(self, grad):
        recomputes.append(self.ctx is not None)
        return original(self, grad)

    monkeypatch.setattr(CheckpointWithoutOutput, "_recompute", counting_recompute)
    activation_calls = []
    for module in (plain, recomputed):
        bound = module.activation
        module.activation = lambda *a, _b=bound, _m=module: activation_calls.append(_m) or _b(*a)

    inputs = make_inputs()
    for step in range(2):  # once per forward, every step
        activation_calls.clear()
        want = run(plain, *inputs)
        want_w = weight_grads(plain)
        got = run(recomputed, *inputs)
        got_w = weight_grads(recomputed)
        assert recomputes == [True] * (step + 1)
        assert activation_calls.count(plain) == 1 and activation_calls.count(recomputed) == 2
        for g, w in zip((*got, *got_w), (*want, *want_w)):
            assert torch.equal(g, w)  # bit-for-bit

    x, tokens_per_expert, probs, _ = inputs
    bytes_plain, _ = saved_bytes_and_output(plain, x, tokens_per_expert, probs)
    bytes_recomputed, out = saved_bytes_and_output(recomputed, x, tokens_per_expert, probs)
    act_bytes = x.shape[0] * FFN * 4  # one [tokens, ffn] fp32 tensor
    # Without moe_act autograd keeps four such tensors that the checkpointed activation does not:
    # silu(gate), x_linear + glu_linear_offset (megatron's GLU always adds it, even 0.0), the GLU
    # product (saved by the probs multiply) and the prob-weighted output (saved by FC2), which
    # moe_act discards (its storage is resized to 0). FC1's output is kept either way.
    assert bytes_plain - bytes_recomputed == 4 * act_bytes, (bytes_plain, bytes_recomputed)
    out.sum().backward()  # the discarded storage is recomputed; backward still works


def test_refuses_add_bias_linear():
    with pytest.raises(ValueError, match="add_bias_linear"):
        GroupedExperts(EXPERTS, make_config(add_bias_linear=True))


def test_refuses_expert_tensor_parallel():
    class Group:
        def __init__(self, size):
            self._size = size

        def size(self):
            return self._size

        def rank(self):
            return 0

    pgs = SimpleNamespace(ep=Group(1), expt_tp=Group(2), expt_dp=Group(1))
    with pytest.raises(ValueError, match="expert_tensor_parallel_size"):
        GroupedExperts(EXPERTS, make_config(), pg_collection=pgs)


@pytest.mark.parametrize("moe_act", [False, True])
def test_moe_layer_with_grouped_experts_matches_sequential(moe_act):
    """megatron's MoELayer (router, allgather dispatcher, combine) with either experts module."""
    recompute = dict(recompute_granularity="selective", recompute_modules=["moe_act"])
    config = make_config(**(recompute if moe_act else {}))
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    submodules = MoESubmodules(
        experts=lambda n, cfg, pg_collection=None, name=None: make_sequential(cfg)
    )
    reference = MoELayer(config, submodules, layer_number=1, pg_collection=pgs)
    layer = MoELayer(
        config, MoESubmodules(experts=grouped_experts_builder()), layer_number=1, pg_collection=pgs
    )
    assert isinstance(layer.experts, GroupedExperts)
    layer.router.load_state_dict(reference.router.state_dict())
    layer.experts.load_from_sequential(reference.experts)

    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(6, 2, HIDDEN, generator=gen)  # [s, b, h]
    grad = torch.randn(6, 2, HIDDEN, generator=gen)
    results = []
    for moe in (reference, layer):
        x = copy.deepcopy(hidden).requires_grad_()
        out, bias = moe(x)
        assert bias is None
        out.backward(grad)
        results.append((out.detach(), x.grad, moe.router.weight.grad, *weight_grads(moe.experts)))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, **TIGHT)
