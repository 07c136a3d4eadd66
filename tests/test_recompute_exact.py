"""Recompute changes neither the loss nor the gradients, and it really happens (counts, ledger)."""

from __future__ import annotations

import pytest
import torch

from conftest import compose, gradients

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
    loss0, grads0, ledger0, counts0 = gradients(compose(*base, "recompute=none"))
    assert counts0 == {}, "no recompute must run no checkpoint region"
    for option, label in OPTIONS:
        if not _applies(family, option):
            continue
        loss, grads, ledger, counts = gradients(compose(*base, f"recompute={option}"))
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
    saved = {}
    for backend in BACKENDS:
        _, _, control, _ = gradients(compose(f"attention={backend}", "recompute=control"))
        _, _, core, _ = gradients(compose(f"attention={backend}", "recompute=selective/core_attn"))
        saved[backend] = control["core_attn"] - core["core_attn"]
        assert core["core_attn"] == 0, f"{backend}: core attention bytes remain under core_attn"
    cfg = compose("attention=unfused")
    t, m = cfg["train"], cfg["model"]
    scores = t["micro_batch_size"] * m["num_attention_heads"] * t["seq_length"] ** 2 * 4  # fp32
    assert saved["unfused"] >= 2 * scores, "unfused: scores and probabilities must be removed"
    # SDPA's core-attention bytes are its inputs' views and its output: the checkpoint keeps q/k/v,
    # so the net change in total ledger bytes is far smaller than under unfused attention.
    totals = {}
    for backend in BACKENDS:
        _, _, control, _ = gradients(compose(f"attention={backend}", "recompute=control"))
        _, _, core, _ = gradients(compose(f"attention={backend}", "recompute=selective/core_attn"))
        totals[backend] = sum(control.values()) - sum(core.values())
    assert totals["unfused"] > 4 * totals["sdpa"], totals
