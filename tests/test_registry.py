"""One entry per label: a throwaway label, defined once (its ``Label`` record and its YAML file, in the
fixture below), flows through validation, the checkpoint ledger, the label flags, the FLOPs, the
activation estimate, the cost model and the advice. Each check fails if that layer keeps a private per-label table the
record does not reach."""

from __future__ import annotations

import importlib.util
import shutil
from dataclasses import replace

import pytest
import torch
from conftest import REPO, compose

from recipes import config as config_module
from recipes import recompute
from recipes.errors import ConfigError
from recipes.recompute import LABELS, Label

TOY = "toy_fc2"


def _drop_fc2_input(d, kinds, terms):
    """The toy's activations: a dense MLP's FC2 input is discarded (an FC2-only checkpoint)."""
    if kinds[1] != "dense":
        return terms
    return [t for t in terms if not (t[0] == "mlp" and t[1] == "fc2 input")]


TOY_LABEL = Label(
    TOY, "dense", "the dense MLP's FC2 input", ("toy_fc2_recompute",),
    "no dense MLP here: toy_fc2 has nothing to wrap", "use a dense family for toy_fc2",
    sites=(("toy_site.py", "forward"),), flops="mlp", flops_share=lambda cfg: 0.25,
    activations=_drop_fc2_input, timed=("mlp.linear_fc2",), at=(("mlp.linear_fc2", ""),),
    advice_kind="embedding", advice="toy advice: the throwaway label answers the embedding's peak")


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The throwaway label in one place: its record in ``LABELS`` and its YAML in a copy of conf/."""
    conf = tmp_path / "conf"
    shutil.copytree(REPO / "conf", conf)
    (conf / "recompute" / "selective" / f"{TOY}.yaml").write_text(
        f"recompute_granularity: selective\nrecompute_modules: [{TOY}]\n")
    monkeypatch.setattr(recompute, "CONF_DIR", conf)
    monkeypatch.setattr(config_module, "CONF_DIR", conf)
    recompute.conf_options.cache_clear()
    monkeypatch.setitem(LABELS, TOY, TOY_LABEL)
    yield TOY_LABEL
    recompute.conf_options.cache_clear()


def test_validation_and_options_read_the_record(toy):
    from recipes.validate import validate

    assert f"selective/{TOY}" in recompute.options_for("standard_attn")
    assert f"selective/{TOY}" not in recompute.options_for("moe")
    validate(compose("model=standard_attn", f"recompute=selective/{TOY}"), num_gpus=0, te_available=False)
    with pytest.raises(ConfigError) as err:
        validate(compose("model=moe", f"recompute=selective/{TOY}"), num_gpus=0, te_available=False)
    assert err.value.option == f"recompute=selective/{TOY}" and toy.instead in str(err.value)


def test_the_ledger_attributes_its_checkpoint_by_its_site(toy, tmp_path, megatron_world):
    """A checkpoint opened from the label's site (a file named as its ``sites`` say) counts for it."""
    from megatron.core import tensor_parallel

    from recipes.measure.ledger import CheckpointCounter

    site = tmp_path / "toy_site.py"
    site.write_text("def forward(checkpoint, fn, x):\n    return checkpoint(fn, False, x)\n")
    spec = importlib.util.spec_from_file_location("toy_site", site)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    counter = CheckpointCounter().install()
    try:
        x = torch.ones(4, requires_grad=True)
        module.forward(tensor_parallel.checkpoint, lambda t: (t * 2).sin(), x).sum().backward()
    finally:
        counter.uninstall()
    assert counter.as_dict() == {TOY: {"forward": 1, "recompute": 1}}


def test_label_flags_resolve_and_flip(toy):
    from recipes.measure.labels import LabelError, check_resolved, labels_disabled, resolve_labels

    block = torch.nn.Module()
    block.mlp = torch.nn.Linear(2, 2)
    block.mlp.toy_fc2_recompute = True
    assert resolve_labels([block], [TOY])[TOY]["wraps"] == 1
    with labels_disabled([block], [TOY]):
        assert block.mlp.toy_fc2_recompute is False
    assert block.mlp.toy_fc2_recompute is True
    with pytest.raises(LabelError, match=toy.wraps_nothing):
        check_resolved({TOY: {"wraps": 0, "modules": []}})


def test_flops_count_its_replay(toy):
    from recipes.measure.flops import layer_forward_flops, step_flops

    cfg, control = compose("model=standard_attn", f"recompute=selective/{TOY}"), compose("model=standard_attn", "recompute=control")
    replay = step_flops(cfg, 1)["hardware"] - step_flops(control, 1)["hardware"]
    assert replay == pytest.approx(cfg["model"]["num_layers"] * 0.25 * layer_forward_flops(cfg)["mlp"])


def test_the_estimate_and_the_advice_follow_its_activations(toy):
    from recipes.measure.profile import first_label_to_try
    from recipes.predict.estimate import predict, rank_options

    cfg, control = compose("model=standard_attn", f"recompute=selective/{TOY}"), compose("model=standard_attn", "recompute=control")
    mine, base = predict(cfg, "cpu"), predict(control, "cpu")
    dropped = [t for t in base["layer_terms"] if t[0] == "mlp" and t[1] == "fc2 input"]
    assert dropped and not [t for t in mine["layer_terms"] if t[1] == "fc2 input"]
    assert base["activation_bytes"] - mine["activation_bytes"] == mine["num_layers"] * sum(t[2] for t in dropped)
    ranked = dict(rank_options(control, "cpu"))  # the predicted advice ranks every option, the toy's too
    assert ranked[f"selective/{TOY}"] < ranked["control"]

    profile = {"status": "ok", "peak_bytes": 100, "peak_phase": "forward", "timeline": {},
               "bytes_by_kind": {"embedding": 60, "parameters": 10}}
    got, why = first_label_to_try({"profile": profile, "config": {"model": {"family": "standard_attn"}}})
    assert got == f"selective/{TOY}" and toy.advice in why


def test_the_cost_model_prices_its_replay_from_the_record(toy, monkeypatch):
    """Its replay is priced by its FLOPs, or by the forward times of its ``timed`` modules where a point
    timed them, and placed at its ``at`` module; an elementwise label by its ``elementwise`` regions and
    kernels, its function at its ``at``."""
    from recipes.measure.flops import layer_forward_flops
    from recipes.predict import cost

    cfg = compose("model=standard_attn", f"recompute=selective/{TOY}")
    n, tp = cfg["model"]["num_layers"], cfg["parallel"]["tensor_model_parallel_size"]
    by_flops = n * 0.25 * layer_forward_flops(cfg)["mlp"] / tp / 100e12
    assert cost.recompute_s(cfg, 100.0, n, 1) == pytest.approx(by_flops)
    times = {"layers": list(range(1, n + 1)), "forward_ms": {"": [5.0] * n, "mlp.linear_fc2": [2.0] * n}}
    assert cost.measured_replay_s(cfg, times)[TOY] == pytest.approx(n * 2e-3)
    assert cost.recompute_s(cfg, 100.0, n, 1, module_times=times) == pytest.approx(n * 2e-3)
    (piece,) = cost._placements(cfg)  # (replayed, not replayed, at, function, kernels, covers, region kind)
    assert piece[:5] == (toy.timed, (), "mlp.linear_fc2", "", None) and piece[6] == "checkpoint"
    assert all(piece[5](g, g) for g in range(n))

    elementwise = replace(toy, flops="", timed=(), at=(("mlp", "toy_function"),), elementwise=(3, 6))
    monkeypatch.setitem(LABELS, TOY, elementwise)
    assert cost.elementwise_replays(cfg) == (3, 6)
    assert cost._placements(cfg)[0][:5] == ((), (), "mlp", "toy_function", 2.0)
    assert cost.recompute_s(cfg, 100.0, n, 1) == pytest.approx(n * 3 * cfg["estimate"]["replay_region_ms"] / 1e3)
