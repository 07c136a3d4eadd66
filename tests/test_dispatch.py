"""The local MoE token dispatcher (recipes/build/dispatch.py): megatron's allgather arithmetic, bit for
bit, without host synchronisation; refused where it cannot be exact."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import compose, gradients

from recipes.errors import ConfigError
from recipes.measure.syncs import HostSyncCounter

HIDDEN, FFN, EXPERTS = 16, 24, 4


@pytest.fixture(autouse=True)
def aux_loss_scale():
    """A layer's aux-loss backward outside megatron's schedule leaves a 0-d scale in a class attribute
    (MoEAuxLossAutoScaler.backward) that the schedule's [1]-shaped scale cannot be copied into later."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    yield
    MoEAuxLossAutoScaler.main_loss_backward_scale = None


def make_config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=EXPERTS,
                  moe_ffn_hidden_size=FFN, moe_router_topk=2, moe_grouped_gemm=True,
                  moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.01, gated_linear_unit=True,
                  activation_func=F.silu, add_bias_linear=False, params_dtype=torch.float32)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def moe_layers(config, gemm_impl: str = "loop"):
    """megatron's MoELayer (allgather) and LocalDispatchMoELayer, same router and expert weights."""
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules

    from recipes.build.dispatch import LocalDispatchMoELayer, LocalTokenDispatcher
    from recipes.build.experts import grouped_experts_builder

    submodules = MoESubmodules(experts=grouped_experts_builder())
    reference = MoELayer(config, submodules, layer_number=1)
    local = LocalDispatchMoELayer(config, submodules, layer_number=1)
    assert isinstance(local.token_dispatcher, LocalTokenDispatcher)
    local.load_state_dict(reference.state_dict())
    reference.experts.gemm_impl = local.experts.gemm_impl = gemm_impl
    return reference, local


def forward_backward(layer, hidden, grad):
    x = copy.deepcopy(hidden).requires_grad_()
    layer.zero_grad(set_to_none=True)
    out, bias = layer(x)
    assert bias is None
    out.backward(grad)
    return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]


def inputs(seed: int = 3, s: int = 6, b: int = 2):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(s, b, HIDDEN, generator=gen), torch.randn(s, b, HIDDEN, generator=gen)


IMPLS = ["loop"] + (["grouped_mm"] if hasattr(torch, "_grouped_mm") else [])
VARIANTS = {
    "top2": {},
    "top1_pre_softmax": dict(moe_router_topk=1, moe_router_pre_softmax=True),
    "top_all": dict(moe_router_topk=EXPERTS),
    "moe_act": dict(recompute_granularity="selective", recompute_modules=["moe_act"]),
    "whole_moe": dict(recompute_granularity="selective", recompute_modules=["moe"]),
    "fused_swiglu": dict(bias_activation_fusion=True),
    "no_aux_loss": dict(moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none"),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("variant", VARIANTS, ids=list(VARIANTS))
def test_local_layer_equals_allgather_bit_for_bit(megatron_world, impl, variant):
    """Output, input gradient, router and expert weight gradients: torch.equal, not close."""
    reference, local = moe_layers(make_config(**VARIANTS[variant]), impl)
    hidden, grad = inputs()
    for _ in range(2):  # the dispatcher holds nothing between steps that could change step 2
        want, got = forward_backward(reference, hidden, grad), forward_backward(local, hidden, grad)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    assert local.token_dispatcher.sorted_indices is None and local.token_dispatcher.routing_map is None


def test_an_expert_without_tokens_is_exact(megatron_world):
    """A router that sends nothing to expert 3: its count is 0, its gradients are 0, the rest equal."""
    reference, local = moe_layers(make_config())
    with torch.no_grad():
        for layer in (reference, local):
            layer.router.weight[3].fill_(-10.0)  # with positive inputs: logits far below the others
    hidden, grad = inputs()
    hidden = hidden.abs() + 0.1
    want, got = forward_backward(reference, hidden, grad), forward_backward(local, hidden, grad)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert local.experts.weight1.grad[3].abs().max() == 0


def count_syncs(layer, hidden, grad) -> HostSyncCounter:
    x = copy.deepcopy(hidden).requires_grad_()
    with HostSyncCounter() as syncs:
        out, _ = layer(x)
        out.backward(grad)
    return syncs


def test_local_dispatch_has_no_host_sync_and_allgather_has(megatron_world):
    """Router, dispatcher and grouped experts, forward and backward: not one call that would make the
    host wait for a GPU. megatron's allgather dispatcher has them in dispatch_postprocess."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm is missing: the per-expert loop reads the counts on the host")
    reference, local = moe_layers(make_config(), "grouped_mm")
    hidden, grad = inputs()
    assert list(count_syncs(local, hidden, grad).by_site()) == []
    allgather = count_syncs(reference, hidden, grad).by_site()
    sites = {(what, where.split(":")[0]) for what, where in allgather}
    assert ("Tensor.cpu", "megatron/core/transformer/moe/token_dispatcher.py") in sites, allgather
    assert ("aten.masked_select", "megatron/core/transformer/moe/token_dispatcher.py") in sites, allgather


def test_the_per_expert_loop_reads_the_counts(megatron_world):
    """The experts' loop path (a CPU, fp32, unaligned shapes) needs the counts on the host: one read
    per layer, in recipes/build/experts.py, and nothing else in the layer."""
    _, local = moe_layers(make_config(), "loop")
    syncs = count_syncs(local, *inputs())
    assert [(what, where.split(":")[0]) for what, where in syncs.by_site()] == [
        ("Tensor.tolist", "recipes/build/experts.py")]


def test_the_counter_sees_what_a_gpu_waits_for():
    t = torch.arange(6, device="cuda" if torch.cuda.is_available() else "cpu")
    with HostSyncCounter() as syncs:
        t.sum().item(), t.tolist(), t.cpu(), bool(t[0] > 1), t[t > 2], t.nonzero(), t.repeat_interleave(t)
        t * 2, t.argsort(), t.index_select(0, t[:2]), t.repeat_interleave(2)  # none of these
    assert [e.what for e in syncs.events] == [
        "aten._local_scalar_dense", "Tensor.tolist", "Tensor.cpu", "aten._local_scalar_dense", "aten.index",
        "aten.nonzero", "aten.repeat_interleave"]
    assert all(e.where.startswith("tests/test_dispatch.py:") for e in syncs.events)
    assert torch.Tensor.cpu is torch._C.TensorBase.cpu  # restored


def test_a_routing_map_without_top_k_per_token_fails_on_the_device(megatron_world):
    """The dispatcher relies on tokens x top-k rows; a map that breaks it stops at the device's check
    (an async assert on a GPU, raised at once on a CPU) instead of permuting wrong rows."""
    _, local = moe_layers(make_config())
    dispatcher = local.token_dispatcher
    hidden = torch.randn(5, 1, HIDDEN)
    routing_map = torch.zeros(5, EXPERTS, dtype=torch.bool)
    routing_map[:, :2] = True
    routing_map[4, 1] = False  # token 4 routed to one expert only
    probs = routing_map.float()
    x, p = dispatcher.dispatch_preprocess(hidden, routing_map, probs)
    with pytest.raises(RuntimeError):
        dispatcher.dispatch_postprocess(x, p)


def test_the_dispatcher_refuses_token_dropping_and_expert_parallel(megatron_world):
    from megatron.core.transformer.moe.moe_layer import MoESubmodules

    from recipes.build.dispatch import LocalDispatchMoELayer
    from recipes.build.experts import grouped_experts_builder

    with pytest.raises(ValueError, match="moe_expert_capacity_factor"):
        LocalDispatchMoELayer(make_config(moe_expert_capacity_factor=1.0),
                              MoESubmodules(experts=grouped_experts_builder()), layer_number=1)


@pytest.mark.parametrize("recompute", ["none", "selective/moe_act", "selective/moe", "full"])
def test_model_local_equals_allgather(megatron_world, recompute):
    """The whole MoE model, one step: loss and every gradient equal under either dispatcher (the labels
    that replay the dispatcher, moe and full, included); the ledger differs by the probs' gather."""
    from recipes.predict.estimate import predict

    runs = {}
    for dispatcher in ("allgather", "local"):
        cfg = compose("model=moe", f"recompute={recompute}", f"model.moe_token_dispatcher_type={dispatcher}")
        runs[dispatcher] = (*gradients(cfg), predict(cfg, device="cpu")["activation_bytes_by_kind"]["moe"])
    (loss0, grads0, ledger0, _, predicted0), (loss, grads, ledger, _, predicted) = runs["allgather"], runs["local"]
    assert loss == loss0
    assert grads.keys() == grads0.keys() and all(torch.equal(grads[k], grads0[k]) for k in grads0)
    # per MoE layer: allgather keeps the [experts, tokens] mask (bool) and probs (fp32); local an int64
    # index of tokens x top-k. Predicted to the byte.
    assert ledger0["moe"] - ledger["moe"] == predicted0 - predicted
    if recompute in ("none", "selective/moe_act"):
        m, t = cfg["model"], cfg["train"]
        tokens, rows = t["seq_length"] * t["micro_batch_size"], t["seq_length"] * t["micro_batch_size"] * 2
        assert ledger0["moe"] - ledger["moe"] == m["num_layers"] * (5 * m["num_moe_experts"] * tokens - 8 * rows)


@pytest.mark.parametrize("overrides,fix", [
    (["model=moe", "parallel.expert_model_parallel_size=2", "launcher.nproc_per_node=2"],
     "model.moe_token_dispatcher_type=allgather"),
    (["model=moe", "model.moe_expert_capacity_factor=1.25"], "model.moe_token_dispatcher_type=allgather"),
    (["model=moe", "model.experts=sequential", "parallel=tp2", "parallel.expert_tensor_parallel_size=2"],
     "parallel.expert_tensor_parallel_size=1"),
])
def test_refused_where_it_cannot_be_exact(overrides, fix):
    from recipes.validate import validate

    with pytest.raises(ConfigError) as err:
        validate(compose(*overrides), num_gpus=2)
    assert err.value.option == "model.moe_token_dispatcher_type"
    assert fix in err.value.fix and "fix:" in str(err.value)


def test_defaults_local_for_moe_models_allgather_under_expert_parallel():
    from recipes.validate import validate

    for family in ("moe", "mla_moe", "gdn_moe"):
        assert compose(f"model={family}")["model"]["moe_token_dispatcher_type"] == "local"
    cfg = compose("model=moe", "parallel=ep2")
    assert cfg["model"]["moe_token_dispatcher_type"] == "allgather"
    validate(cfg, num_gpus=2)
    validate(compose("model=moe", "parallel=tp2"), num_gpus=2)  # expert TP 1: nothing to gather
    validate(compose("model=moe", "model.moe_token_dispatcher_type=allgather",
                     "model.moe_expert_capacity_factor=1.25"), num_gpus=1)


def test_stored_results_keep_their_dispatcher():
    """A result written before the local dispatcher existed stored allgather and is read as allgather."""
    from recipes.config import upgrade

    old = compose("model=moe", "model.moe_token_dispatcher_type=allgather")
    del old["model"]["moe_expert_capacity_factor"]
    new = upgrade(old)
    assert new["model"]["moe_token_dispatcher_type"] == "allgather"
    assert new["model"]["moe_expert_capacity_factor"] is None


def test_item_waits_counts_the_hosts_time_in_item_and_gives_it_back():
    """ItemWaits: the seconds spent inside Tensor.item while
    entered, and Tensor.item as it was after."""
    import time

    from recipes.measure.syncs import ItemWaits

    original = torch.Tensor.item
    with ItemWaits() as waits:
        assert torch.tensor(3.0).item() == 3.0 and waits.seconds > 0.0
        waits.seconds = 0.0
        time.sleep(0.01)  # outside item: not counted
        assert waits.seconds == 0.0
    assert torch.Tensor.item is original
