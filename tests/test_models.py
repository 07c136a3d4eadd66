"""Composed model structure: attention kind x MLP kind, the layer pattern, and every label that applies.

MLA with MoE (DeepSeek-V2/V3, Moonlight) and GatedDeltaNet with MoE (Qwen3-Next) are families of their
own (``model=mla_moe``, ``model=gdn_moe``); ``model.moe_layer_freq`` (megatron's field: an int, a 0/1
list, or Megatron-LM's ``"([0]*3+[1]*58)"``) puts dense layers among the MoE ones. A label applies where
its modules are: ``mlp`` on the dense layers of an MoE model, ``moe_act`` where MoE layers are.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import compose, measured, train_in_process

from recipes.errors import ConfigError
from recipes.predict.estimate import predict
from recipes.predict.static import num_parameters
from recipes.recompute import KINDS, LABELS, layer_kinds, options_for, parse_pattern
from recipes.validate import validate

#: One worker runs these with tests/test_recompute_exact.py's and tests/test_estimate.py's measurements
#: (conftest.measured: a point they share is measured once).
pytestmark = pytest.mark.xdist_group("measured")

#: Tiny two-layer models with one dense and one MoE layer (and shared experts on MLA+MoE).
NEW = {
    "mla_moe": ["model=mla_moe", "model.moe_layer_freq=[0,1]", "model.moe_shared_expert_intermediate_size=64"],
    "gdn_moe": ["model=gdn_moe", "model.moe_layer_freq=[0,1]"],
}


def test_layer_pattern_reads_megatrons_fields():
    deepseek = {"family": "mla_moe", "num_layers": 61, "moe_layer_freq": "([0]*3+[1]*58)"}
    kinds = layer_kinds(deepseek)
    assert kinds[:3] == [("mla", "dense")] * 3 and kinds[3:] == [("mla", "moe")] * 58
    assert parse_pattern(2, 5) == [1, 0, 1, 0, 1]  # megatron: MoE where i % N == 0
    assert parse_pattern([0, 1, 1], 3) == [0, 1, 1] and parse_pattern("[0]*1+[1]*2", 3) == [0, 1, 1]
    qwen3_next = {"family": "gdn_moe", "num_layers": 8, "linear_attention_freq": 4, "moe_layer_freq": 1}
    assert layer_kinds(qwen3_next) == ([("gdn", "moe")] * 3 + [("standard", "moe")]) * 2
    assert layer_kinds({"family": "standard_attn", "num_layers": 2}) == [("standard", "dense")] * 2
    with pytest.raises(ConfigError) as info:
        parse_pattern("([0]*3+[1]*57)", 61)
    assert info.value.option == "model.moe_layer_freq"


def test_label_applicability_follows_the_modules():
    mla_moe = compose(*NEW["mla_moe"])["model"]
    every_layer_moe = compose("model=mla_moe")["model"]
    assert LABELS["mlp"].applies(mla_moe) and not LABELS["mlp"].applies(every_layer_moe)
    assert LABELS["mla_up_proj"].applies(mla_moe) and LABELS["moe_act"].applies(mla_moe)
    assert not LABELS["gdn_norm_out"].applies(mla_moe) and LABELS["shared_experts"].applies(mla_moe)
    assert not LABELS["shared_experts"].applies(every_layer_moe)
    gdn_moe = compose(*NEW["gdn_moe"])["model"]
    assert {"selective/gdn_norm_out-moe_act", "selective/mlp", "selective/core_attn"} <= set(options_for(gdn_moe))
    assert "selective/mla_up_proj" not in options_for(gdn_moe)
    assert "selective/mla_up_proj-moe_act" in options_for("mla_moe")
    # the four measured families keep their options
    assert "selective/mlp" not in options_for("moe") and "selective/moe_act" not in options_for("mla")


@pytest.mark.parametrize("overrides,option", [
    (["model=mla_moe", "recompute=selective/mlp"], "recompute=selective/mlp"),  # every layer MoE
    (["model=mla_moe", "recompute=selective/gdn_norm_out"], "recompute=selective/gdn_norm_out"),
    (["model=gdn_moe", "recompute=selective/mla_up_proj"], "recompute=selective/mla_up_proj"),
    (["model=mla", "recompute=selective/moe_act"], "recompute=selective/moe_act"),
    (["model=mla_moe", "model.moe_layer_freq=[0,1,1]"], "model.moe_layer_freq"),  # 3 entries, 2 layers
    (["model=gdn_moe", "parallel=ep2", "model.num_moe_experts=3"], "parallel.expert_model_parallel_size"),
])
def test_labels_and_patterns_the_model_lacks_are_refused(overrides, option):
    with pytest.raises(ConfigError) as info:
        validate(compose(*overrides), num_gpus=0, te_available=False)
    assert info.value.option == option and info.value.fix


def test_old_families_resolve_as_before():
    """model=standard_attn/mla/moe/gdn: the same resolved values (plus the default moe_layer_freq 1),
    so results measured before compare."""
    for family in ("standard_attn", "mla", "moe", "gdn"):
        cfg = compose(f"model={family}")
        assert cfg["model"]["family"] == family and cfg["model"]["moe_layer_freq"] == 1
    assert layer_kinds(compose("model=moe")["model"]) == [("standard", "moe")] * 2


@pytest.mark.parametrize("family", list(NEW))
def test_composed_families_train(megatron_world, family):
    result = train_in_process(compose(*NEW[family], "recompute=control", "train.train_iters=4",
                                      "measure.start_step=2", "measure.profile=none"))
    assert result["status"] == "ok", result.get("error")
    assert all(math.isfinite(x) for x in result["loss"])


def _cases():
    out = []
    for family, overrides in NEW.items():
        model = compose(*overrides)["model"]
        out += [(family, option) for option in options_for(model) if option not in ("none", "control")]
    return out


@pytest.mark.parametrize("family,option", _cases(), ids=lambda x: str(x))
def test_every_applicable_option_is_bit_exact_and_predicted(megatron_world, family, option):
    """Loss and gradients equal no recompute (layernorm: to fp32 rounding, see test_recompute_exact),
    every label ran forward and replayed, the ledger is below the control's, and the estimator equals
    the ledger byte for byte on the CPU."""
    base = [*NEW[family], "attention=unfused"]
    loss0, grads0, _, _ = measured(compose(*base, "recompute=none"))
    control = measured(compose(*base, "recompute=control"))[2]
    cfg = compose(*base, f"recompute={option}")
    loss, grads, ledger, counts = measured(cfg)
    assert loss == loss0 and grads.keys() == grads0.keys()
    labels = ["full"] if option.startswith("full") else option.split("/", 1)[1].split("-")
    scale = max(g.abs().max() for g in grads0.values())  # rounding is relative to the gradients' scale
    for name in grads0:
        if "layernorm" in labels:  # GDN's A_log/dt_bias gradients are ~1e-8: compare at the model's scale
            torch.testing.assert_close(grads[name], grads0[name], rtol=1e-5, atol=1e-6 * scale)
        else:
            assert torch.equal(grads[name], grads0[name]), f"{option}: gradient of {name} differs"
    for label in labels:
        assert counts[label]["forward"] > 0 and counts[label]["recompute"] == counts[label]["forward"], counts
    assert sum(ledger.values()) < sum(control.values()), f"{option}: saved nothing"
    predicted = predict(cfg, device="auto")
    if predicted["device"] == "cpu":
        assert predicted["activation_bytes_by_kind"] == {k: ledger.get(k, 0) for k in KINDS}


@pytest.mark.parametrize("family", list(NEW))
def test_parameter_count_per_layer_kind(megatron_world, family):
    cfg = compose(*NEW[family])
    _, grads, ledger, _ = measured(cfg)
    assert sum(num_parameters(cfg, 0)) == sum(g.numel() for g in grads.values())
    predicted = predict(cfg, device="auto")
    assert predicted["device"] != "cpu" or predicted["activation_bytes_by_kind"] == {k: ledger.get(k, 0) for k in KINDS}
    per_layer = predicted["per_layer"]
    assert per_layer[0]["mlp"] > 0 and per_layer[0]["moe"] == 0  # layer 0 dense
    assert per_layer[1]["moe"] > 0 and per_layer[1]["mlp"] == 0  # layer 1 MoE
