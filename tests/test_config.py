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
    for group in ("model", "size", "attention", "parallel", "launcher", "data", "logger"):
        for path in (Path(CONF) / group).glob("*.yaml"):
            cfg = compose(f"{group}={path.stem}")
            assert cfg[group] is not None if group != "size" else cfg["size"] is None


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

    from recipes.build.model import NON_TRANSFORMER_FIELDS
    from recipes.config import ModelConfig, ParallelConfig, RecomputeConfig

    megatron = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    for cls in (ModelConfig, ParallelConfig, RecomputeConfig):
        for f in dataclasses.fields(cls):
            if f.name not in NON_TRANSFORMER_FIELDS:
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
]


@pytest.mark.parametrize("overrides, option, fix", REFUSED, ids=[r[1] for r in REFUSED])
def test_bad_combinations_are_refused_with_the_fix(overrides, option, fix):
    with pytest.raises(ConfigError) as err:
        _check(compose(*overrides))
    assert option in str(err.value)
    assert fix in str(err.value)


@pytest.mark.parametrize("family", FAMILIES)
def test_defaults_validate(family):
    _check(compose(f"model={family}"))
