"""Each key a setting of the schema and each value on its own: sizes at least 1, numbers in their range."""

from __future__ import annotations

import dataclasses
import difflib

from recipes.config import RecipeConfig, typed
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


def check_bool_overrides(overrides: list[str]) -> None:
    """A switch given a number or a word OmegaConf still converts (``train.fused_adam=2`` reads as true):
    only true/false (or yes/no, on/off, 1/0)."""
    sections = {f.name: f.default_factory for f in dataclasses.fields(RecipeConfig)
                if f.default_factory is not dataclasses.MISSING}
    for item in overrides:
        key, _, value = item.lstrip("+").partition("=")
        section, _, name = key.partition(".")
        schema = sections.get(section) if name else None
        field = next((f for f in dataclasses.fields(schema) if f.name == name), None) if schema else None
        if field is None or str(field.type).replace("Optional[bool]", "bool") != "bool" or "," in value:
            continue  # not a switch, or a sweep's list (each point's value comes here on its own)
        check(value.strip().lower() in ("true", "false", "yes", "no", "on", "off", "1", "0", "null", "none"), key,
              f"{value!r} is not true or false", f"set {key}=true or {key}=false")


def _unknown(key: str, known: list[str]) -> None:
    near = difflib.get_close_matches(key.split(".")[-1], known, n=1)
    hint = f" (did you mean {key.rsplit('.', 1)[0] + '.' if '.' in key else ''}{near[0]}?)" if near else ""
    raise ConfigError(key, "is not a setting of this schema (added with +, so Hydra did not check it; megatron "
                      "would fail on it in the worker or ignore it)", f"drop +{key}{hint}")


INF = float("inf")
#: Sizes and counts that must be at least 1 (None, where the schema allows it, means "not set").
POSITIVE = {
    "model": ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
              "kv_channels", "vocab_size", "rotary_base", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
              "qk_pos_emb_head_dim", "v_head_dim", "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size",
              "moe_shared_expert_intermediate_size", "linear_attention_freq", "linear_conv_kernel_dim",
              "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads"),
    "train": ("train_iters", "micro_batch_size", "global_batch_size", "seq_length", "exit_interval",
              "lr_decay_iters", "lr_wsd_decay_iters"),
    "measure": ("start_step", "steps"),
    "parallel": ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "expert_model_parallel_size", "expert_tensor_parallel_size", "virtual_pipeline_model_parallel_size",
                 "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"),
    "data": ("eval_iters",),
    "launcher": ("nproc_per_node", "nnodes", "cpu_cores_per_rank"),
    "cluster": ("gpus_per_node", "nodes"),
}
#: The domain of every other number: (section, key, lowest, highest, whether the lowest is allowed, whether
#: the highest is, the fix's example). Section None: a top-level key. None passes where the schema allows it
#: (Optional: "not set"); NaN and infinity are outside every range here.
RANGES = (
    ("model", "hidden_dropout", 0.0, 1.0, True, False, "0.1"),
    ("model", "attention_dropout", 0.0, 1.0, True, False, "0.1"),
    ("model", "init_method_std", 0.0, INF, False, False, "0.02"),
    ("model", "moe_aux_loss_coeff", 0.0, INF, True, False, "0.01"),
    ("model", "moe_expert_capacity_factor", 0.0, INF, False, False, "1.25 (or null: no token dropping)"),
    ("train", "lr", 0.0, INF, False, False, "1e-4"),
    ("train", "min_lr", 0.0, INF, True, False, "0.0"),
    ("train", "lr_warmup_iters", 0, INF, True, False, "0 (no warm-up) or 100"),
    ("train", "lr_warmup_init", 0.0, INF, True, False, "0.0"),
    ("train", "weight_decay", 0.0, INF, True, False, "0.01"),
    ("train", "start_weight_decay", 0.0, INF, True, False, "0.01 (or null)"),
    ("train", "end_weight_decay", 0.0, INF, True, False, "0.1 (or null)"),
    ("train", "clip_grad", 0.0, INF, True, False, "1.0"),
    ("train", "seed", 0, 2**32 - 1, True, True, "1234"),
    ("train", "log_interval", 0, INF, True, False, "0 (no progress lines) or 100"),
    ("train", "manual_gc_interval", 0, INF, True, False, "100 (0: never during training)"),
    ("data", "eval_interval", 0, INF, True, False, "0 (off) or 10"),
    ("data", "num_workers", 0, INF, True, False, "0"),
    ("measure", "peak_tflops", 0.0, INF, False, False, "989"),
    ("measure", "memory_fraction", 0.0, 1.0, False, True, "0.5 (or null: no cap)"),
    ("measure", "memory_budget_gib", 0.0, INF, False, False, "40 (or null: no cap)"),
    ("measure", "repeat", 0, INF, True, False, "0,1,2 (-m: one process per repetition)"),
    ("offload", "min_offloaded_tensor_size", 0, INF, True, False, "1048576"),
    ("offload", "activation_offload_fraction", 0.0, 1.0, False, True, "1.0"),
    ("offload", "cpu_offloading_num_layers", 0, INF, True, False, "0"),
    ("offload", "host_memory_gib", 0.0, INF, False, False, "512 (or null: this machine's available memory)"),
    ("cluster", "host_memory_gib", 0.0, INF, False, False, "512 (or null: offload's, else the GPU profile's node)"),
    ("checkpoint", "interval", 0, INF, True, False, "0 (only at the end and on a signal) or 500"),
    ("checkpoint", "keep_last", 0, INF, True, False, "3 (0: keep all)"),
    ("estimate", "moe_imbalance", 1.0, INF, True, False, "1.5"),
    ("estimate", "mfu", 0.0, 1.0, False, True, "0.38"),
    ("estimate", "host_link_gb_s", 0.0, INF, False, False, "50"),
    ("estimate", "offload_ms_per_group", 0.0, INF, True, False, "0.072"),
    ("estimate", "offload_ms_per_gib", 0.0, INF, True, False, "2.98"),
    ("estimate", "hbm_gb_s", 0.0, INF, False, False, "3000"),
    ("estimate", "replay_region_ms", 0.0, INF, True, False, "0.142"),
    ("estimate", "launch_us", 0.0, INF, True, False, "10"),
    ("launcher", "master_port", 0, 65535, True, True, "0 (a free port)"),
    (None, "lock_wait_s", 0.0, INF, True, False, "1800 (0: skip a busy point at once)"),
)


def check_values(cfg) -> None:
    """Each value on its own: positive sizes and counts, numbers inside their range (before any rule
    divides by them: ``num_attention_heads=0`` must be refused, not raise ZeroDivisionError)."""
    cfg = typed(cfg)
    for section, keys in POSITIVE.items():
        for key in keys:
            value = getattr(getattr(cfg, section), key)
            check(value is None or value >= 1, f"{section}.{key}", f"{value} is not a size or count (it must be "
                   "at least 1)", f"set {section}.{key} to a positive number"
                   + (", or null" if value is not None and _optional(section, key) else ""))
    for section, key, low, high, low_ok, high_ok, example in RANGES:
        name = f"{section}.{key}" if section else key
        value = getattr(getattr(cfg, section) if section else cfg, key)
        if value is None and section and _optional(section, key):
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        inside = number and (low <= value if low_ok else low < value) and (value <= high if high_ok else value < high)
        if high == INF:
            bounds = f"{'>=' if low_ok else '>'} {low}"
        else:
            bounds = f"in {'[' if low_ok else '('}{low}, {high}{']' if high_ok else ')'}"
        finite = not number or value - value == 0  # NaN and infinity are not
        check(inside, name, f"{value} is not {'a finite number ' if not finite else ''}{bounds}",
              f"set {name}={example}; it must be {bounds}")
    check_split(cfg.data.split)
    if cfg.cluster.gpu:  # a typo'd profile: refused here too, not only by the planner
        from recipes.hardware import load_profile

        load_profile(cfg.cluster.gpu)
    pos = cfg.model.position_embedding_type
    check(pos in ("rope", "learned_absolute", "none"), "model.position_embedding_type",
           f"unknown position embedding {pos!r}", "use rope, learned_absolute or none")


def check_split(split: str) -> None:
    """``data.split``: megatron's train,valid,test weights, three numbers >= 0 that do not sum to 0 (mock data
    splits by it too)."""
    parts = str(split).split(",")
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        weights = []
    check(len(weights) == 3 and all(w >= 0 and w != INF for w in weights) and sum(weights) > 0, "data.split",
          f"{split!r} is not three weights train,valid,test (numbers >= 0, not all 0)",
          "set data.split=98,2,0 (megatron's train,valid,test weights)")


def _optional(section: str, key: str) -> bool:
    factory = next(f.default_factory for f in dataclasses.fields(RecipeConfig) if f.name == section)
    field = next(f for f in dataclasses.fields(factory) if f.name == key)
    return "Optional" in str(field.type)
