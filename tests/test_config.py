"""Every config composes; typos and bad combinations are refused with a message naming the fix."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from conftest import CONF, compose
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from recipes.errors import ConfigError
from recipes.recompute import option_of
from recipes.validate import validate

RECOMPUTE = sorted(
    str(p.relative_to(Path(CONF) / "recompute").with_suffix(""))
    for p in (Path(CONF) / "recompute").rglob("*.yaml")
)
FAMILIES = ["standard_attn", "mla", "moe", "gdn", "mla_moe", "gdn_moe"]


def _check(cfg: dict) -> None:
    validate(cfg, num_gpus=0, te_available=False)


def test_every_group_option_composes():
    """Each option of each group, in as few compositions as the largest group has options (the i-th
    composition takes every group's i-th option, cycling the shorter groups): a composition costs tenths
    of a second, and an option that does not compose fails the one it is in, by name."""
    groups = ("model", "size", "attention", "parallel", "launcher", "data", "logger", "offload")
    options = {group: sorted(path.stem for path in (Path(CONF) / group).glob("*.yaml")) for group in groups}
    for i in range(max(len(names) for names in options.values())):
        overrides = [f"{group}={names[i % len(names)]}" for group, names in options.items()]
        cfg = compose(*overrides)
        for group in groups:
            assert cfg[group] is not None if group != "size" else cfg["size"] is None, overrides


@pytest.mark.parametrize("option", RECOMPUTE)
def test_every_recompute_option_composes(option):
    cfg = compose(f"recompute={option}")
    assert cfg["recompute"]["recompute_granularity"] in (None, "selective", "full")
    # reports and the advisor name a point by what its values recompute; for every shipped option
    # that is the option's own name, so a new option file must follow the naming
    assert option_of(cfg) == option


def test_schema_fields_exist_in_megatron():
    """Fields passed through to megatron-core must still exist after an upgrade."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from recipes.build.model import (
        NON_TRANSFORMER_FIELDS,
        NON_TRANSFORMER_OFFLOAD_FIELDS,
        NON_TRANSFORMER_RECOMPUTE_FIELDS,
    )
    from recipes.config import ModelConfig, OffloadConfig, ParallelConfig, RecomputeConfig

    megatron = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    ours = NON_TRANSFORMER_FIELDS | NON_TRANSFORMER_OFFLOAD_FIELDS | NON_TRANSFORMER_RECOMPUTE_FIELDS
    for cls in (ModelConfig, ParallelConfig, RecomputeConfig, OffloadConfig):
        for f in dataclasses.fields(cls):
            if f.name not in ours:
                assert f.name in megatron, f"{cls.__name__}.{f.name} is not a megatron field"


@pytest.mark.parametrize("family", FAMILIES)
def test_transformer_config_builds(family):
    from recipes.build.model import build_transformer_config

    config = build_transformer_config(compose(f"model={family}", "size=h200"), on_gpu=False)
    assert config.num_layers == 8 and config.hidden_size == 2048
    assert config.recompute_modules == []  # never megatron's implicit ["core_attn"]


@pytest.mark.parametrize("override, exc", [
    ("model.hidden_sise=3", ConfigCompositionException),
    ("model.num_layers=two", ConfigCompositionException),
    ("recompute=selective/core_atn", ConfigCompositionException),
    ("attention=flash", ConfigCompositionException),
])
def test_typos_fail_at_compose_time(override, exc):
    """compose_config (estimate, advise --predict, the tools) turns Hydra's error into a ConfigError that
    keeps Hydra's words; train.py gets Hydra's own message."""
    with pytest.raises((exc, ConfigKeyError, ValidationError, ConfigError)) as err:
        compose(override)
    assert override.split("=")[0] in str(err.value)


REFUSED = [
    (["model=standard_attn", "recompute=selective/moe_act"], "recompute=selective/moe_act", "model=moe"),
    (["model=moe", "recompute=selective/mlp"], "recompute=selective/mlp", "moe_act"),
    (["model=standard_attn", "recompute=selective/mla_up_proj"], "mla_up_proj", "model=mla"),
    (["model=moe", "recompute=selective/shared_experts"], "shared_experts",
     "moe_shared_expert_intermediate_size"),
    (["model=moe", "recompute=selective/moe_act", "model.experts=sequential"], "moe_act",
     "model.experts=grouped"),
    (["recompute=selective/gdn_norm_out"], "recompute=selective/gdn_norm_out", "model=gdn"),
    (["recompute=full", "recompute.recompute_num_layers=9"], "recompute_num_layers", "between 1 and 2"),
    (["recompute=full", "recompute.recompute_method=null"], "recompute_method", "full/block"),
    (["recompute=none", "recompute.recompute_modules=[core_attn]"], "recompute_modules", "selective"),
    (["recompute=control", "recompute.distribute_saved_activations=true"],
     "distribute_saved_activations", "recompute=full"),
    (["recompute=control", "recompute.recompute_num_layers=1"], "recompute_method", "recompute=full"),
    (["attention=te"], "attention=te", "attention=sdpa"),
    (["measure.repeat=-1"], "measure.repeat", "measure.repeat=0,1,2"),
    (["model.add_bias_linear=true"], "add_bias_linear", "false"),
    (["model.normalization=BadNorm"], "model.normalization", "RMSNorm or LayerNorm"),
    (["model=moe", "model.moe_router_topk=9"], "moe_router_topk", "<= num_moe_experts"),
    (["model=moe", "model.moe_token_dispatcher_type=alltoall"], "alltoall", "allgather"),
    (["measure.start_step=9"], "measure.start_step", "between 2 and train.train_iters=8"),
    (["measure.steps=0"], "measure.steps", "positive number"),
    (["train.seq_length=0"], "train.seq_length", "positive number"),
    (["model.num_attention_heads=0"], "model.num_attention_heads", "positive number"),
    (["model.num_layers=0"], "model.num_layers", "positive number"),
    (["model.hidden_size=-64"], "model.hidden_size", "positive number"),
    (["model.ffn_hidden_size=0"], "model.ffn_hidden_size", "positive number"),
    (["model.vocab_size=0"], "model.vocab_size", "positive number"),
    (["train.micro_batch_size=0"], "train.micro_batch_size", "positive number"),
    (["model=moe", "model.num_moe_experts=0"], "model.num_moe_experts", "positive number"),
    (["model=moe", "model.moe_router_topk=0"], "model.moe_router_topk", "positive number"),
    (["model=mla", "model.kv_lora_rank=0"], "model.kv_lora_rank", "positive number"),
    (["model.num_query_groups=0"], "model.num_query_groups", "or null"),
    (["model.hidden_dropout=1.0"], "model.hidden_dropout", "in [0.0, 1.0)"),
    (["model.attention_dropout=-0.1"], "model.attention_dropout", "in [0.0, 1.0)"),
    (["train.lr=-1"], "train.lr", "> 0.0"),
    (["train.lr=0"], "train.lr", "> 0.0"),
    (["train.weight_decay=-0.1"], "train.weight_decay", ">= 0.0"),
    (["train.clip_grad=-1"], "train.clip_grad", ">= 0.0"),
    (["+model.foo=1"], "model.foo", "drop +model.foo"),
    (["+model.hiden_size=3"], "model.hiden_size", "did you mean model.hidden_size"),
    (["+bar=1"], "bar", "drop +bar"),
    (["model.num_attention_heads=3", "model.num_query_groups=null"], "hidden_size", "kv_channels"),
    (["model.num_query_groups=3"], "num_query_groups", "dividing num_attention_heads"),
    # activation offload (recipes.offload.rule_problem, recipes/validate/offload.py check_offload)
    (["offload.cpu_offloading=true"], "offload.cpu_offloading", "offload=core_attn-attn_proj"),
    (["model=moe", "recompute=selective/moe", "offload=expert_fc1"], "offload=expert_fc1",
     "recompute=selective/moe_act"),
    (["offload.fine_grained_activation_offloading=true", "offload.offload_modules=[attn_proj]"],
     "offload=attn_proj", "offload=core_attn-attn_proj"),
    (["offload=core_attn-attn_proj"], "offload=core_attn-attn_proj", "offload.emulate_on_cpu=true"),
    (["recompute=selective/core_attn", "offload=core_attn"], "offload=core_attn", "offload=qkv_linear"),
    (["recompute=full", "offload=attn_norm"], "offload=attn_norm", "offload=none with full recompute"),
    (["model=mla", "recompute=selective/mla_up_proj", "offload=qkv_linear"], "offload=qkv_linear",
     "offload=core_attn-attn_proj"),
    (["model=standard_attn", "offload=expert_fc1"], "offload=expert_fc1", "offload=attn_norm"),
    (["model=moe", "model.experts=sequential", "offload=moe_act"], "offload=moe_act", "model.experts=grouped"),
    (["model=gdn", "offload=core_attn"], "offload=core_attn", "more layers"),
    (["offload.fine_grained_activation_offloading=true", "offload.offload_modules=[fused_group_mlp]"],
     "offload=fused_group_mlp", "Transformer Engine"),
    (["offload.offload_modules=[core_attn]"], "offload.offload_modules", "offload=<option>"),
    (["offload=attn_norm", "offload.emulate_on_cpu=true", "train.train_iters=2", "measure.start_step=2"],
     "train.train_iters", "train_iters>=3"),
    (["model.bias_activation_fusion=true", "model.gated_linear_unit=false", "model.activation=gelu"],
     "model.bias_activation_fusion", "model.bias_activation_fusion=null"),
    (["model=moe", "model.bias_activation_fusion=true", "model.activation=gelu"], "model.bias_activation_fusion",
     "fused SwiGLU only"),
    (["measure.trace_step=true"], "measure.trace_step", "leave measure.trace_step=false"),
    (["measure.gpu_time=true"], "measure.gpu_time", "measure.gpu_time=null"),
    (["estimate.replay_region_ms=-0.1"], "estimate.replay_region_ms", "set estimate.replay_region_ms=0.142"),
    (["estimate.launch_us=-1"], "estimate.launch_us", "set estimate.launch_us=10"),
    (["model.compile=graph"], "model.compile", "model.compile=<one of none, attention, layer>"),
    (["model=moe", "model.compile=layer"], "model.compile", "use model.compile=attention"),
    (["model=gdn", "model.compile=attention"], "model.compile", "use model.compile=none"),
    (["model.compile=layer", "offload=attn_norm", "offload.emulate_on_cpu=true"], "model.compile",
     "offload=none"),
]


@pytest.mark.parametrize("overrides, option, fix", REFUSED, ids=[r[1] for r in REFUSED])
def test_bad_combinations_are_refused_with_the_fix(overrides, option, fix):
    with pytest.raises(ConfigError) as err:
        _check(compose(*overrides))
    assert option in str(err.value)
    assert fix in str(err.value)


def test_gpu_time_null_is_on_where_there_is_a_gpu_and_quiet_on_a_cpu():
    """sweep=moe sets measure.gpu_time=null, so the same sweep runs on a CPU (no extra step there)."""
    cfg = compose("measure.gpu_time=null")
    _check(cfg)
    assert cfg["measure"]["gpu_time"] is None


@pytest.mark.parametrize("family", FAMILIES)
def test_defaults_validate(family):
    _check(compose(f"model={family}"))


def test_offload_emulation_is_for_a_cpu_only():
    with pytest.raises(ConfigError, match="offload.emulate_on_cpu=false"):
        validate(compose("offload=core_attn-attn_proj", "offload.emulate_on_cpu=true"), num_gpus=1,
                 te_available=False)
    validate(compose("offload=core_attn-attn_proj"), num_gpus=1, te_available=False)  # a GPU: fine


def test_offload_beyond_the_host_memory_is_refused():
    """The controller checks the estimator's host bytes per rank against the node; per node they must fit."""
    from recipes.validate.offload import host_memory_problem

    cfg = compose("offload=core_attn-attn_proj", "offload.host_memory_gib=1", "launcher.nproc_per_node=2",
                  "parallel=dp2")
    assert host_memory_problem(cfg, 2**29) is None  # 2 x 0.5 GiB: fits
    option, problem, fix = host_memory_problem(cfg, 2**29 + 1)
    assert option == "offload=core_attn-attn_proj" and "offload.host_memory_gib (1.0 GiB)" in problem
    assert fix.startswith("offload fewer modules")


def test_layer_level_offload_rules_with_transformer_engine():
    te = {"num_gpus": 1, "te_available": True}
    validate(compose("offload.cpu_offloading=true"), **te)
    for overrides, problem in ((["recompute=selective/core_attn"], "recompute"), (["parallel=pp2"], "pipeline"),
                               (["offload=core_attn-attn_proj"], "both")):
        with pytest.raises(ConfigError, match=problem):
            validate(compose("offload.cpu_offloading=true", *overrides), num_gpus=2, te_available=True)


def test_every_offload_option_composes_and_names_itself():
    from recipes.offload import conf_options, option_of

    for option in conf_options():
        assert option_of(compose(f"offload={option}")) == option


def test_stored_results_without_fork_server_read_as_separate_processes():
    """A stored config written before the fork server: its points started as their own processes."""
    from recipes.config import upgrade

    old = compose()
    del old["fork_server"]
    assert upgrade(old)["fork_server"] is False and upgrade(compose())["fork_server"] is True


@pytest.mark.parametrize("overrides, on_gpu, fused", [
    ([], True, True),  # auto: megatron's fused SwiGLU on a GPU
    ([], False, False),  # auto on a CPU: no torch.compile per process, and nothing to gain
    (["model=moe"], True, True),
    (["model.activation=gelu", "model.gated_linear_unit=false"], True, False),  # no fused GELU without biases
    (["model.bias_activation_fusion=false"], True, False),
    (["model.bias_activation_fusion=true"], False, True),
])
def test_swiglu_fusion_is_auto_on_a_gpu(overrides, on_gpu, fused):
    from recipes.build.model import transformer_config_kwargs

    assert compose(*overrides)["model"]["bias_activation_fusion"] in (None, True, False)
    assert transformer_config_kwargs(compose(*overrides), on_gpu)["bias_activation_fusion"] is fused


def test_the_gpu_sizes_take_four_micro_batches_and_tiny_one():
    """Training at the h200 sizes pays the optimizer, grad norm and step syncs once per 4 micro-batches;
    tiny (the CPU suite) stays at one, so CI does not slow down."""
    for size, gbs in (("h200", 8), ("h200_long", 8), ("tiny", None)):
        train = compose(f"size={size}")["train"]
        assert train["global_batch_size"] == gbs
        assert (gbs or train["micro_batch_size"]) // train["micro_batch_size"] == (4 if gbs else 1)


def test_stored_results_keep_the_settings_they_ran_with():
    """Results written before fused SwiGLU became auto and the h200 sizes took 4 micro-batches stored
    false and null; read today, they still say so (upgrade fills only missing fields)."""
    from recipes.config import upgrade

    old = compose("size=h200", "model.bias_activation_fusion=false", "train.global_batch_size=null")
    assert upgrade(old)["model"]["bias_activation_fusion"] is False
    assert upgrade(old)["train"]["global_batch_size"] is None
    del old["model"]["bias_activation_fusion"]  # written before the field existed: it ran unfused
    assert upgrade(old)["model"]["bias_activation_fusion"] is False
    assert upgrade(compose())["model"]["bias_activation_fusion"] is None  # today's config: unchanged


def test_labels_that_need_megatrons_cpp_build_are_refused_without_a_compiler(tmp_path, monkeypatch):
    """megatron's CheckpointWithoutOutput compiles its share_storage extension at a machine's first
    recompute: on a GPU run without a C++ compiler and without the built library, those labels would
    fail at the first backward. Refused before launch, naming the label and the fix; other labels,
    megatron's own mlp replay, a built library and a CPU run (which shares in Python) pass."""
    import shutil

    from recipes.validate.share_storage import torch_swaps_storages

    def _check(cfg):
        validate(cfg, num_gpus=1, te_available=False)

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built here
    monkeypatch.delenv("CXX", raising=False)
    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "c++" else which(name, *a, **k))
    with pytest.raises(ConfigError) as err:
        _check(compose("recompute=selective/layernorm"))
    assert err.value.option == "recompute=selective/layernorm"
    assert "no C++ compiler (c++)" in str(err.value) and "apt install g++" in str(err.value)
    with pytest.raises(ConfigError, match="mlp"):
        _check(compose("recompute=selective/mlp"))
    _check(compose("recompute=selective/mlp", "recompute.mlp_replays_fc2=true"))  # CheckpointFunction: no build
    _check(compose("recompute=selective/core_attn"))
    _check(compose("recompute=full"))
    built = tmp_path / "share_storage_ext"  # torch made the directory when asked for it
    built.mkdir(exist_ok=True)
    (built / "share_storage_ext.so").write_bytes(b"")
    _check(compose("recompute=selective/layernorm"))  # built once where a compiler was: loads
    (built / "share_storage_ext.so").unlink()
    if torch_swaps_storages():
        validate(compose("recompute=selective/layernorm"), num_gpus=0, te_available=False)  # a CPU run
    from recipes.run.controller import check_point

    # a Slurm submission: the node's controller checks its own compiler before its GPUs start
    check_point(compose("recompute=selective/layernorm"), num_gpus=1, submitting=True)
    with pytest.raises(ConfigError, match="no C\\+\\+ compiler"):
        check_point(compose("recompute=selective/layernorm"), num_gpus=1)


def test_torchs_version_says_whether_it_swaps_storages(monkeypatch):
    """A controller reads ``torch_swaps_storages`` from torch's version (it imports no torch); the answer
    is what the loaded torch has."""
    import sys

    import torch

    from recipes.validate.share_storage import torch_swaps_storages

    monkeypatch.delitem(sys.modules, "torch")
    from_version = torch_swaps_storages.__wrapped__()
    monkeypatch.setitem(sys.modules, "torch", torch)
    assert from_version == hasattr(torch.UntypedStorage, "_swap_data_ptr_") == torch_swaps_storages.__wrapped__()

