"""One entry per concept: a throwaway label, defined once (its ``Label`` record and its YAML file, in the
fixture below), flows through validation, the checkpoint ledger, the label flags, the FLOPs, the
activation estimate, the cost model and the advice; a throwaway offload module (its ``OffloadModule``
record and YAML) through validation, the estimate and the copies; a throwaway family (its ``Family``
record and YAML) through validation, the options and the estimate. Each check fails if that layer keeps
a private table the record does not reach."""

from __future__ import annotations

import importlib.util
import shutil
from dataclasses import replace

import pytest
import torch
from conftest import REPO, compose

from recipes import config as config_module
from recipes import offload as offload_module
from recipes import recompute
from recipes.errors import ConfigError
from recipes.offload import MODULES, OffloadModule
from recipes.recompute import LABELS, Family, Label

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


def conf_with(tmp_path, monkeypatch, owner, option: str, text: str) -> None:
    """A copy of conf/ with one more option file (``option``, e.g. ``offload/x.yaml``), read by ``owner``
    (the module whose ``conf_options`` lists the group) and by Hydra's composition."""
    conf = tmp_path / "conf"
    shutil.copytree(REPO / "conf", conf)
    (conf / option).write_text(text)
    monkeypatch.setattr(owner, "CONF_DIR", conf)
    monkeypatch.setattr(config_module, "CONF_DIR", conf)
    owner.conf_options.cache_clear()


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The throwaway label in one place: its record in ``LABELS`` and its YAML in a copy of conf/."""
    conf_with(tmp_path, monkeypatch, recompute, f"recompute/selective/{TOY}.yaml",
              f"recompute_granularity: selective\nrecompute_modules: [{TOY}]\n")
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
    from recipes.measure.timeline import first_label_to_try
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


# --- one entry per offload module: a throwaway module, its record and its YAML ------------------------
TOY_MODULE = "toy_fc2_input"
TOY_OFFLOAD = OffloadModule(
    TOY_MODULE, "any", "the dense MLP's FC2 input", "mlp",
    saves=lambda t, d: t[0] == "mlp" and t[1] == "fc2 input", mark="mlp.linear_fc2", span=("fc1", "end"))
EMULATED = ("offload.emulate_on_cpu=true", "offload.min_offloaded_tensor_size=0")


@pytest.fixture
def toy_offload(tmp_path, monkeypatch):
    """The throwaway offload module in one place: its record in ``MODULES`` and its YAML in a copy of conf/."""
    conf_with(tmp_path, monkeypatch, offload_module, f"offload/{TOY_MODULE}.yaml",
              f"fine_grained_activation_offloading: true\noffload_modules: [{TOY_MODULE}]\n")
    monkeypatch.setitem(MODULES, TOY_MODULE, TOY_OFFLOAD)
    yield TOY_OFFLOAD
    offload_module.conf_options.cache_clear()


def test_an_offload_module_flows_through_validation_the_estimate_and_the_copies(toy_offload):
    """Validation takes it where it applies; the estimator moves the terms its ``saves`` names to the
    host as its own group; the copies place it by its ``span`` (FLOPs) or its ``mark`` (a timeline)."""
    from recipes.predict.copies import flop_positions, offload_positions, timeline_offload_costs
    from recipes.predict.estimate import predict
    from recipes.validate import validate

    assert TOY_MODULE in offload_module.options_for("standard_attn")
    cfg = compose("model=standard_attn", f"offload={TOY_MODULE}", *EMULATED)
    validate(cfg, num_gpus=0, te_available=False)
    assert offload_module.rule_problem([TOY_MODULE], frozenset(), cfg["model"]) is None
    moved, base = predict(cfg, "cpu"), predict(compose("model=standard_attn", *EMULATED), "cpu")
    fc2 = sum(t[2] for t in base["layer_terms"] if t[0] == "mlp" and t[1] == "fc2 input")
    groups = moved["offload_groups_per_layer"]
    assert fc2 and [[p for p, _ in layer] for layer in groups] == [[TOY_MODULE]] * len(groups)
    assert [n for layer in groups for _, n in layer] == [fc2] * (len(groups) - 1) + [0]  # the last layer's kept
    assert moved["host_terms_per_layer"][0] == {TOY_MODULE: 1}

    flops = flop_positions(cfg)
    assert flops[TOY_MODULE] == (flops["expert_fc1"][1], 1.0)  # from FC1's end (the fc1 boundary) to the layer's
    names = ["1::pre", "1:mlp.linear_fc2:pre", "1:mlp.linear_fc2:end", "1::end"]
    timed = {"layers": [1], "forward_ms": {}, "marks": {"names": names, "host_ms": [0.0] * 4,
                                                        "gpu_ms": [0.0, 7.0, 2.0, 1.0]}}
    assert offload_positions(cfg, timed)[TOY_MODULE] == pytest.approx((0.7, 0.9))
    names = ["1::pre", "1:mlp.linear_fc2:pre", "1:mlp.linear_fc2:end", "1:mlp.linear_fc2:bwd", "1::end"]
    marks = {"names": names, "host_ms": [0.0, 1.0, 2.0, 3.0, 4.0], "gpu_ms": [0.0] * 5,
             "offload_ms": {"group": 1.0, "tensor": 0.0}}
    assert timeline_offload_costs([{TOY_MODULE: 1}], {"layers": [1], "forward_ms": {}, "marks": marks}) is not None


def test_an_offload_module_is_refused_where_its_layer_part_is_missing(toy_offload, monkeypatch):
    from recipes.validate import validate

    monkeypatch.setitem(MODULES, TOY_MODULE, replace(toy_offload, needs="moe"))
    assert TOY_MODULE not in offload_module.options_for("standard_attn")
    with pytest.raises(ConfigError) as err:
        validate(compose("model=standard_attn", f"offload={TOY_MODULE}", *EMULATED), num_gpus=0, te_available=False)
    assert toy_offload.what in str(err.value)


# --- one entry per family: a throwaway family, its record and its YAML ---------------------------------
TOY_FAMILY = Family("toy_family", "standard", "moe", "selective/moe_act", "expert_fc1-moe_act")


@pytest.fixture
def toy_family(tmp_path, monkeypatch):
    """The throwaway family in one place: its record in ``FAMILIES`` (and the kinds read from it) and its
    YAML, model=moe's with its name, in a copy of conf/."""
    conf = tmp_path / "conf"
    shutil.copytree(REPO / "conf", conf)
    moe = (conf / "model" / "moe.yaml").read_text()
    (conf / "model" / "toy_family.yaml").write_text(moe.replace("family: moe", "family: toy_family"))
    monkeypatch.setattr(config_module, "CONF_DIR", conf)
    monkeypatch.setitem(recompute.FAMILIES, TOY_FAMILY.name, TOY_FAMILY)
    for view, value in ((recompute.ATTENTION_KIND, TOY_FAMILY.attention), (recompute.MLP_KIND, TOY_FAMILY.mlp),
                        (recompute.GUIDE_FIRST_LABEL, TOY_FAMILY.first_label),
                        (offload_module.GUIDE_FIRST_OFFLOAD, TOY_FAMILY.first_offload)):
        monkeypatch.setitem(view, TOY_FAMILY.name, value)
    yield TOY_FAMILY


def test_a_family_flows_through_validation_the_options_and_the_estimate(toy_family):
    """A family is its kinds: validated, offered options and predicted as model=moe, its twin."""
    from recipes.measure.flops import step_flops
    from recipes.predict.estimate import predict
    from recipes.validate import validate

    toy, moe = compose("model=toy_family", "recompute=selective/moe_act"), compose("model=moe", "recompute=selective/moe_act")
    assert toy["model"]["family"] == "toy_family"
    validate(toy, num_gpus=0, te_available=False)
    assert recompute.options_for("toy_family") == recompute.options_for("moe")
    assert offload_module.options_for("toy_family") == offload_module.options_for("moe")
    assert "toy_family" in LABELS["moe_act"].families and "toy_family" not in LABELS["mlp"].families
    assert recompute.layer_kinds(toy["model"]) == recompute.layer_kinds(moe["model"])
    assert predict(toy, "cpu")["peak_bytes"] == predict(moe, "cpu")["peak_bytes"]
    assert step_flops(toy, 1) == step_flops(moe, 1)
    assert recompute.guide_order("selective/moe_act", "toy_family") < recompute.guide_order("selective/layernorm", "toy_family")


def test_every_family_record_names_options_that_exist():
    """The guide's first options per family are options of the family (``Family.first_label``,
    ``first_offload``)."""
    for name, family in recompute.FAMILIES.items():
        assert family.first_label in recompute.options_for(name)
        assert family.first_offload in offload_module.options_for(name)


def test_every_module_a_record_names_is_timed():
    """The cost model and the copies read the forward marks of the modules the records name: each is one
    ``recipes.measure.moduletime.TIMED`` times (a new one goes there too)."""
    from recipes.measure.moduletime import TIMED
    from recipes.measure.regions import REGION_FUNCTIONS

    named = {m for label in LABELS.values() for m in (*label.timed, *label.untimed_modules(
        compose("model=standard_attn", "recompute=control")), *(at for at, _ in label.at))}
    named |= {fn for label in LABELS.values() for _, fn in label.at if fn and fn not in REGION_FUNCTIONS}
    named |= {m.mark for m in MODULES.values() if m.mark}
    assert named - set(TIMED) == set()
