"""Each key a setting of the schema and each value on its own: sizes at least 1, numbers in their range."""

from __future__ import annotations

import dataclasses
import difflib

from recipes.config import RecipeConfig
from recipes.errors import ConfigError, check


def check_keys(cfg) -> None:
    """Every key is a field of the schema. Hydra refuses unknown keys at compose time, except those
    added with ``+`` (``+model.foo=1``): megatron would fail on them in the worker, or ignore them."""
    for section, value in cfg.items():
        fields = {f.name: f for f in dataclasses.fields(RecipeConfig)}
        if section not in fields:
            _unknown(section, list(fields))
        schema = fields[section].default_factory if fields[section].default_factory is not dataclasses.MISSING else None
        if isinstance(value, dict) and dataclasses.is_dataclass(schema):
            known = [f.name for f in dataclasses.fields(schema)]
            for key in value:
                if key not in known:
                    _unknown(f"{section}.{key}", known)


def _unknown(key: str, known: list[str]) -> None:
    near = difflib.get_close_matches(key.split(".")[-1], known, n=1)
    hint = f" (did you mean {key.rsplit('.', 1)[0] + '.' if '.' in key else ''}{near[0]}?)" if near else ""
    raise ConfigError(key, "is not a setting of this schema (added with +, so Hydra did not check it; megatron "
                      "would fail on it in the worker or ignore it)", f"drop +{key}{hint}")


#: Sizes and counts that must be at least 1 (None, where the schema allows it, means "not set").
POSITIVE = {
    "model": ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
              "kv_channels", "vocab_size", "rotary_base", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
              "qk_pos_emb_head_dim", "v_head_dim", "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size",
              "moe_shared_expert_intermediate_size", "linear_attention_freq", "linear_conv_kernel_dim",
              "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads"),
    "train": ("train_iters", "micro_batch_size", "global_batch_size", "seq_length"),
    "measure": ("start_step", "steps"),
    "parallel": ("expert_tensor_parallel_size",),
    "data": ("eval_iters",),
    "launcher": ("cpu_cores_per_rank",),
}
#: (section, key, lowest, highest, whether the lowest is allowed, whether the highest is, the fix's example)
RANGES = (
    ("model", "hidden_dropout", 0.0, 1.0, True, False, "0.1"),
    ("model", "attention_dropout", 0.0, 1.0, True, False, "0.1"),
    ("model", "init_method_std", 0.0, float("inf"), False, False, "0.02"),
    ("model", "moe_aux_loss_coeff", 0.0, float("inf"), True, False, "0.01"),
    ("train", "lr", 0.0, float("inf"), False, False, "1e-4"),
    ("train", "weight_decay", 0.0, float("inf"), True, False, "0.01"),
    ("train", "clip_grad", 0.0, float("inf"), True, False, "1.0"),
    ("train", "seed", 0, 2**32 - 1, True, True, "1234"),
    ("data", "eval_interval", 0, float("inf"), True, False, "0 (off) or 10"),
    ("train", "manual_gc_interval", 0, float("inf"), True, False, "100 (0: never during training)"),
    ("data", "num_workers", 0, float("inf"), True, False, "0"),
    ("measure", "peak_tflops", 0.0, float("inf"), False, False, "989"),
    ("launcher", "master_port", 0, 65535, True, True, "0 (a free port)"),
)


def check_values(cfg) -> None:
    """Each value on its own: positive sizes and counts, numbers inside their range (before any rule
    divides by them: ``num_attention_heads=0`` must be refused, not raise ZeroDivisionError)."""
    for section, keys in POSITIVE.items():
        for key in keys:
            value = cfg[section].get(key)
            check(value is None or value >= 1, f"{section}.{key}", f"{value} is not a size or count (it must be "
                   "at least 1)", f"set {section}.{key} to a positive number"
                   + (", or null" if value is not None and _optional(section, key) else ""))
    for section, key, low, high, low_ok, high_ok, example in RANGES:
        value = cfg[section].get(key)
        inside = (low <= value if low_ok else low < value) and (value <= high if high_ok else value < high)
        if high == float("inf"):
            bounds = f"{'>=' if low_ok else '>'} {low}"
        else:
            bounds = f"in {'[' if low_ok else '('}{low}, {high}{']' if high_ok else ')'}"
        check(value is not None and inside, f"{section}.{key}", f"{value} is not {bounds}",
               f"set {section}.{key} {bounds}, e.g. {section}.{key}={example}")
    pos = cfg["model"]["position_embedding_type"]
    check(pos in ("rope", "learned_absolute", "none"), "model.position_embedding_type",
           f"unknown position embedding {pos!r}", "use rope, learned_absolute or none")


def _optional(section: str, key: str) -> bool:
    factory = next(f.default_factory for f in dataclasses.fields(RecipeConfig) if f.name == section)
    field = next(f for f in dataclasses.fields(factory) if f.name == key)
    return "Optional" in str(field.type)
