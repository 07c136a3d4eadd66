"""The dense MLP's ``mlp`` recompute replays FC1 and the activation, not FC2 (recipes/build/mlp.py)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import compose, gradients

MEGATRON = "recompute.mlp_replays_fc2=true"


def _step(cfg: dict) -> tuple[float, dict, dict, dict, Counter]:
    """``gradients`` of one step, and the forward calls per MLP linear (FC1, FC2)."""
    calls: Counter = Counter()

    def count_linears(trainer) -> None:
        for chunk in trainer.chunks:
            for name, module in chunk.named_modules():
                if name.endswith(("mlp.linear_fc1", "mlp.linear_fc2")):
                    kind = name.rsplit(".", 1)[1]
                    module.register_forward_hook(lambda *_, kind=kind: calls.update([kind]))

    return (*gradients(cfg, before=count_linears), calls)


@pytest.mark.parametrize("option", ["selective/mlp", "selective/layernorm recompute.recompute_modules=[layernorm,mlp]"],
                         ids=["mlp", "layernorm-mlp"])
def test_mlp_replays_fc1_not_fc2_exactly(megatron_world, option):
    """The same loss and gradients as megatron's whole-MLP replay, bit for bit, and the same bytes
    kept; FC1 runs twice a layer, FC2 once (megatron's: both twice). Against none: bit for bit under
    mlp; under layernorm-mlp megatron's own replay differs from none by ~1e-9 (a summation order),
    and ours the same. With layernorm the pre-MLP norm's recompute (a hook on the MLP's output) must
    run before FC1's replay reads its output: a wrong order would differ far more."""
    base = compose("recompute=none")
    layers = base["model"]["num_layers"]
    loss0, grads0, _, _, calls0 = _step(base)
    assert calls0 == {"linear_fc1": layers, "linear_fc2": layers}
    ours = _step(compose(*f"recompute={option}".split()))
    theirs = _step(compose(*f"recompute={option}".split(), MEGATRON))
    assert ours[0] == theirs[0] == loss0
    for param in grads0:
        assert torch.equal(ours[1][param], theirs[1][param]), f"gradient of {param} differs from megatron's"
        if option == "selective/mlp":
            assert torch.equal(ours[1][param], grads0[param]), f"gradient of {param} differs from none"
        else:
            torch.testing.assert_close(ours[1][param], grads0[param], rtol=1e-5, atol=1e-7)
    for counts in (ours[3], theirs[3]):
        assert counts["mlp"] == {"forward": layers, "recompute": layers}, counts
    assert ours[4] == {"linear_fc1": 2 * layers, "linear_fc2": layers}, ours[4]
    assert theirs[4] == {"linear_fc1": 2 * layers, "linear_fc2": 2 * layers}, theirs[4]
    assert sum(ours[2].values()) == sum(theirs[2].values())
    if option == "selective/mlp":  # its input moves from megatron's layer (kind other) into the MLP
        assert ours[2]["mlp"] == theirs[2]["other"] > 0 and theirs[2]["mlp"] == ours[2]["other"] == 0


def test_estimator_prices_fc1_alone_and_keeps_megatron_for_stored_results():
    """The replayed FLOPs: FC1's (2/3 of SwiGLU's MLP) today, all of the MLP for a result stored
    before (``upgrade`` reads a config without the field as megatron's path)."""
    from recipes.config import upgrade
    from recipes.measure.flops import layer_forward_flops, replayed_layer_flops

    cfg = compose("recompute=selective/mlp")
    layer = layer_forward_flops(cfg)
    per_layer = sum(layer.get(k, 0.0) for k in ("attn_proj", "core_attn", "mlp"))
    assert replayed_layer_flops(cfg, layer, per_layer) == pytest.approx(layer["mlp"] * 2 / 3)
    stored = {k: dict(v) if isinstance(v, dict) else v for k, v in cfg.items()}
    del stored["recompute"]["mlp_replays_fc2"]
    old = upgrade(stored)
    assert old["recompute"]["mlp_replays_fc2"] is True
    assert replayed_layer_flops(old, layer, per_layer) == layer["mlp"]
