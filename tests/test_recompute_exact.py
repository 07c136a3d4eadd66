"""Recompute changes neither the loss nor the gradients, and it really happens (counts, ledger)."""

from __future__ import annotations

import pytest
import torch
from conftest import compose, gradients, measured

#: One worker runs these with tests/test_estimate.py's and tests/test_models.py's measurements, so the
#: points they share (a family's none and control, a label's step) are measured once (conftest.measured).
pytestmark = pytest.mark.xdist_group("measured")

FAMILIES = ["standard_attn", "mla", "moe"]
BACKENDS = ["unfused", "sdpa"]
#: (recompute option, label the checkpoint counter must see, or None for no checkpoints)
OPTIONS = [
    ("control", None),
    ("selective/core_attn", "core_attn"),
    ("selective/mlp", "mlp"),
    ("full", "full"),
]


def _applies(family: str, option: str) -> bool:
    return not (family == "moe" and option == "selective/mlp")


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["nodrop", "dropout"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_recompute_is_bit_exact_and_counted(megatron_world, family, backend, dropout):
    base = [f"model={family}", f"attention={backend}", f"model.hidden_dropout={dropout}",
            f"model.attention_dropout={dropout}"]
    loss0, grads0, ledger0, counts0 = measured(compose(*base, "recompute=none"))
    assert counts0 == {}, "no recompute must run no checkpoint region"
    for option, label in OPTIONS:
        if not _applies(family, option):
            continue
        loss, grads, ledger, counts = measured(compose(*base, f"recompute={option}"))
        assert loss == loss0, f"{option}: loss changed"
        assert grads.keys() == grads0.keys()
        for name in grads0:
            assert torch.equal(grads[name], grads0[name]), f"{option}: gradient of {name} differs"
        if label is None:
            assert counts == {}
            continue
        num_layers = compose(*base)["model"]["num_layers"]
        assert counts[label]["forward"] == num_layers, counts
        assert counts[label]["recompute"] == num_layers, counts
        assert sum(ledger.values()) <= sum(ledger0.values())


def test_core_attn_saves_scores_only_when_unfused(megatron_world):
    """The guide's point, measured: core_attn removes score/probability bytes with unfused
    attention; with SDPA (which never stores probabilities) it saves (almost) nothing."""
    saved, totals = {}, {}
    for backend in BACKENDS:
        _, _, control, _ = measured(compose(f"attention={backend}", "recompute=control"))
        _, _, core, _ = measured(compose(f"attention={backend}", "recompute=selective/core_attn"))
        saved[backend] = control["core_attn"] - core["core_attn"]
        totals[backend] = sum(control.values()) - sum(core.values())
        assert core["core_attn"] == 0, f"{backend}: core attention bytes remain under core_attn"
    cfg = compose("attention=unfused")
    t, m = cfg["train"], cfg["model"]
    scores = t["micro_batch_size"] * m["num_attention_heads"] * t["seq_length"] ** 2 * 4  # fp32
    assert saved["unfused"] >= 2 * scores, "unfused: scores and probabilities must be removed"
    # SDPA's core-attention bytes are its inputs' views and its output: the checkpoint keeps q/k/v,
    # so the net change in total ledger bytes is far smaller than under unfused attention.
    assert totals["unfused"] > 4 * totals["sdpa"], totals


#: Issue 3: every selective label and combination, per family, and full/block. (family, option,
#: overrides of the model, or of the option when they start with "recompute."). core_attn is
#: covered above; GDN's labels in tests/test_gdn.py.
LABEL_CASES = [
    ("standard_attn", "selective/layernorm", ()),
    ("standard_attn", "full/block", ("recompute.recompute_num_layers=1",)),
    ("mla", "selective/mla_up_proj", ()),
    ("mla", "selective/mla_up_proj-core_attn", ()),
    ("mla", "selective/layernorm", ()),
    ("moe", "selective/moe_act", ()),
    ("moe", "selective/moe", ()),
    ("moe", "selective/layernorm", ()),
    ("moe", "selective/moe_act-layernorm", ()),
    ("moe", "selective/moe-layernorm", ()),
    ("moe", "selective/shared_experts", ("model.moe_shared_expert_intermediate_size=64",)),
    # Issue 20: MLA and GatedDeltaNet over MoE, a dense first layer then MoE (DeepSeek's first_k_dense_replace).
    # Every applicable option of these two: tests/test_models.py.
    ("mla_moe", "selective/mla_up_proj-moe_act", ("model.moe_layer_freq=[0,1]",)),
    ("mla_moe", "selective/mlp", ("model.moe_layer_freq=[0,1]",)),
    ("mla_moe", "selective/shared_experts", ("model.moe_layer_freq=[0,1]", "model.moe_shared_expert_intermediate_size=64")),
    ("gdn_moe", "selective/gdn_norm_out-moe_act", ("model.moe_layer_freq=[0,1]",)),
    ("gdn_moe", "selective/moe", ()),
]


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["nodrop", "dropout"])
@pytest.mark.parametrize("family,option,extra", LABEL_CASES, ids=[f"{f}-{o}" for f, o, _ in LABEL_CASES])
def test_every_label_is_bit_exact_recomputes_and_saves(megatron_world, family, option, extra, dropout):
    """Loss and every gradient equal no recompute bit for bit; each of the option's labels ran its
    checkpoint regions forward and again in backward; the ledger holds fewer bytes than the control."""
    base = [f"model={family}", "attention=unfused", f"model.hidden_dropout={dropout}",
            f"model.attention_dropout={dropout}", *(e for e in extra if not e.startswith("recompute."))]
    loss0, grads0, _, _ = measured(compose(*base, "recompute=none"))
    _, _, control, _ = measured(compose(*base, "recompute=control"))
    loss, grads, ledger, counts = measured(compose(*base, f"recompute={option}",
                                                   *(e for e in extra if e.startswith("recompute."))))
    assert loss == loss0, f"{option}: loss changed"
    assert grads.keys() == grads0.keys()
    labels = ["full"] if option.startswith("full") else option.split("/", 1)[1].split("-")
    for name in grads0:
        if "layernorm" in labels:  # see test_layernorm_recompute_reorders_one_gradient_sum
            torch.testing.assert_close(grads[name], grads0[name], rtol=1e-5, atol=1e-6 * grads0[name].abs().max())
        else:
            assert torch.equal(grads[name], grads0[name]), f"{option}: gradient of {name} differs"
    for label in labels:
        assert counts[label]["forward"] > 0 and counts[label]["recompute"] == counts[label]["forward"], counts
    assert sum(ledger.values()) < sum(control.values()), f"{option}: saved nothing ({ledger} vs {control})"


def test_layernorm_recompute_reorders_one_gradient_sum():
    """Why ``layernorm`` is exact only to fp32 rounding (the other labels are bit-exact): a norm's
    input also feeds the residual, and inside the norm x is used twice (x * rsqrt(mean(x^2))). Plain
    autograd adds those three gradient terms in one order; the output-discarding checkpoint sums the
    norm's two first (its own backward) and then adds the residual's. Measured here on the smallest
    case: the loss and the norm weight's gradient are bit-identical, the input's gradient differs by
    a few ULPs, and it is bit-identical again when the input has no second consumer."""
    from megatron.core.tensor_parallel.random import CheckpointWithoutOutput

    from recipes.build import compat, upstream

    compat.install_cpu_compat()
    upstream.fix_checkpoint_without_output_fp8_default()
    torch.manual_seed(0)
    norm, lin, x0 = torch.nn.RMSNorm(64, eps=1e-5), torch.nn.Linear(64, 64), torch.randn(32, 2, 64)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)

    def run(checkpointed: bool, residual: bool):
        x = x0.clone().requires_grad_()
        norm.weight.grad = None
        ckpt = CheckpointWithoutOutput()
        y = ckpt.checkpoint(norm, x) if checkpointed else norm(x)
        z = lin(y)
        if checkpointed:
            ckpt.discard_output_and_register_recompute(z)
        loss = ((z + x) if residual else z).square().sum()
        loss.backward()
        return loss.detach(), x.grad.clone(), norm.weight.grad.clone()

    plain, ckpt = run(False, True), run(True, True)
    assert torch.equal(plain[0], ckpt[0]) and torch.equal(plain[2], ckpt[2])
    assert not torch.equal(plain[1], ckpt[1])
    torch.testing.assert_close(ckpt[1], plain[1], rtol=1e-6, atol=1e-6 * plain[1].abs().max())
    alone, alone_ckpt = run(False, False), run(True, False)
    assert all(torch.equal(a, b) for a, b in zip(alone, alone_ckpt))


OFF_CASES = [("moe", "full"), ("moe", "selective/moe"), ("moe", "selective/moe_act"),
             ("standard_attn", "selective/mlp"), ("standard_attn", "selective/core_attn"),
             ("mla", "selective/mla_up_proj-core_attn")]


@pytest.mark.parametrize("family,option", OFF_CASES, ids=[f"{f}-{o}" for f, o in OFF_CASES])
def test_recompute_disabled_runs_the_model_as_built_without_it(megatron_world, family, option):
    """``recompute_disabled`` (a step without recompute): inside it a model built
    with the option runs no checkpoint region and keeps the bytes a ``none`` model keeps, with its
    gradients; after it the option recomputes again."""
    from recipes.measure.labels import recompute_disabled

    base = [f"model={family}", "attention=unfused"]
    _, grads0, ledger0, _ = measured(compose(*base, "recompute=none"))
    seen = {}

    def off_then_on(trainer):
        with recompute_disabled(trainer.chunks, trainer.config):
            seen["loss"] = trainer.compute_gradients(record_ledger=True)
        seen["grads"] = {n: p.grad.detach().clone() for c in trainer.chunks for n, p in c.named_parameters()
                         if p.grad is not None}
        seen["ledger"], seen["counts"] = dict(trainer.ledger.bytes_by_kind), trainer.counter.as_dict()
        trainer.counter.reset()

    _, _, ledger, counts = gradients(compose(*base, f"recompute={option}"), before=off_then_on)
    assert seen["counts"] == {}, f"{option} still checkpointed while disabled: {seen['counts']}"
    assert seen["ledger"] == ledger0, "disabled, the ledger must hold what recompute=none's does"
    for name in grads0:
        assert torch.equal(seen["grads"][name], grads0[name]), f"{option} disabled: gradient of {name} differs"
    assert counts and all(c["recompute"] > 0 for c in counts.values()), f"{option} did not recompute after: {counts}"
    assert sum(ledger.values()) < sum(ledger0.values())
