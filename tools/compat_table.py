"""The compatibility table in docs/compatibility.md, generated from the validation rules.

Each row composes a real config from concrete overrides (``recipes.config.compose_config``) and runs
``recipes.validate.validate`` on it; the table's "refused option", "why" and "fix" columns are the
``ConfigError`` it raises, word for word, so the doc cannot drift from the rules. A row whose
overrides are no longer refused, or are refused for another option, stops the script: the rule
changed, so edit its row here.

    python tools/compat_table.py          # rewrite the section between the markers
    python tools/compat_table.py --check  # exit 1 if docs/compatibility.md differs (make check-data)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: import the repository's recipes

import generated  # noqa: E402  (tools/, beside this script)
from generated import replace_section  # noqa: E402

from recipes.config import compose_config  # noqa: E402
from recipes.errors import ConfigError  # noqa: E402
from recipes.validate import validate  # noqa: E402
from recipes.validate.offload import host_memory_problem  # noqa: E402

DOC = ROOT / "docs" / "compatibility.md"
BEGIN = "<!-- BEGIN GENERATED: compatibility -->"


@dataclass(frozen=True)
class Row:
    """One refused combination: what it is, overrides that trigger it, and the option it must name."""

    combination: str
    overrides: tuple[str, ...]
    option: str
    num_gpus: int = 1  # the machine validate assumes: 1 = one GPU, 0 = a CPU
    te_available: bool = False  # whether Transformer Engine imports there
    planned_host_gib: float | None = None  # the host memory offload is predicted to hold per rank


ROWS = (
    Row(
        "`moe_act` (or `moe`, `shared_experts`) on a dense model",
        ("model=standard_attn", "recompute=selective/moe_act"),
        "recompute=selective/moe_act",
    ),
    Row("`mlp` on an all-MoE model", ("model=moe", "recompute=selective/mlp"), "recompute=selective/mlp"),
    Row(
        "`mla_up_proj` without MLA",
        ("model=standard_attn", "recompute=selective/mla_up_proj"),
        "recompute=selective/mla_up_proj",
    ),
    Row(
        "`gdn_norm_out` without GatedDeltaNet layers",
        ("model=standard_attn", "recompute=selective/gdn_norm_out"),
        "recompute=selective/gdn_norm_out",
    ),
    Row(
        "`shared_experts` without shared experts",
        ("model=moe", "recompute=selective/shared_experts"),
        "recompute=selective/shared_experts",
    ),
    Row(
        "`shared_experts` with shared-expert overlap",
        (
            "model=moe",
            "model.moe_shared_expert_intermediate_size=2048",
            "model.moe_shared_expert_overlap=true",
            "recompute=selective/shared_experts",
        ),
        "recompute=selective/shared_experts",
    ),
    Row(
        "`moe_act` on megatron's `SequentialMLP`",
        ("model=moe", "model.experts=sequential", "recompute=selective/moe_act"),
        "recompute=selective/moe_act",
    ),
    Row(
        "`layernorm` with Transformer Engine layers",
        ("attention=te", "recompute=selective/layernorm"),
        "recompute=selective/layernorm",
        te_available=True,
    ),
    Row("GatedDeltaNet with an activation other than SiLU", ("model=gdn", "model.activation=gelu"), "model.activation"),
    Row(
        "full recompute without a method",
        ("recompute=full", "recompute.recompute_method=null"),
        "recompute.recompute_method",
    ),
    Row(
        "full recompute over more layers than a stage holds",
        ("recompute=full", "recompute.recompute_num_layers=3"),
        "recompute.recompute_num_layers",
    ),
    Row(
        "`recompute_method`/`recompute_num_layers` outside full recompute",
        ("recompute=selective/mlp", "recompute.recompute_num_layers=1"),
        "recompute.recompute_method",
    ),
    Row(
        "`distribute_saved_activations` outside full recompute",
        ("recompute=selective/mlp", "recompute.distribute_saved_activations=true"),
        "recompute.distribute_saved_activations",
    ),
    Row(
        "`distribute_saved_activations` with sequence parallel",
        ("parallel=tp2", "recompute=full", "recompute.distribute_saved_activations=true"),
        "recompute.distribute_saved_activations",
        num_gpus=2,
    ),
    Row(
        "whole-`moe` or full recompute with expert-parallel overlap",
        ("model=moe", "recompute=selective/moe", "parallel.overlap_moe_expert_parallel_comm=true"),
        "parallel.overlap_moe_expert_parallel_comm",
    ),
    Row("biases in the linear layers", ("model.add_bias_linear=true",), "model.add_bias_linear"),
    Row(
        "a fused activation other than SwiGLU",
        ("model.bias_activation_fusion=true", "model.gated_linear_unit=false", "model.activation=gelu"),
        "model.bias_activation_fusion",
    ),
    Row("`attention=te` without Transformer Engine", ("attention=te",), "attention=te"),
    Row(
        "the alltoall token dispatcher on a CPU",
        ("model=moe", "model.moe_token_dispatcher_type=alltoall"),
        "model.moe_token_dispatcher_type",
        num_gpus=0,
    ),
    Row(
        "the local token dispatcher (`model=moe`'s) under expert parallel",
        ("model=moe", "parallel.expert_model_parallel_size=2", "launcher.nproc_per_node=2"),
        "model.moe_token_dispatcher_type",
        num_gpus=2,
    ),
    Row(
        "the local token dispatcher with token dropping",
        ("model=moe", "model.moe_expert_capacity_factor=1.25"),
        "model.moe_token_dispatcher_type",
    ),
    Row(
        "context parallel (`parallel=cp2`)",
        ("parallel=cp2", "attention=te"),
        "parallel.context_parallel_size",
        num_gpus=2,
        te_available=True,
    ),
    Row("layer-level `cpu_offloading` without Transformer Engine", ("offload.cpu_offloading=true",),
        "offload.cpu_offloading"),
    Row("`attn_proj` offload without `core_attn`",
        ("offload.fine_grained_activation_offloading=true", "offload.offload_modules=[attn_proj]"),
        "offload=attn_proj"),
    Row("expert offload (`expert_fc1`, `moe_act`) inside whole-`moe` recompute",
        ("model=moe", "recompute=selective/moe", "offload=expert_fc1-moe_act"), "offload=expert_fc1-moe_act"),
    Row("`core_attn` offload under `core_attn` recompute (megatron skips the offload point)",
        ("recompute=selective/core_attn", "offload=core_attn-attn_proj"), "offload=core_attn-attn_proj"),
    Row("offload with full recompute", ("recompute=full", "offload=attn_norm"), "offload=attn_norm"),
    Row("`qkv_linear` offload under `mla_up_proj` recompute",
        ("model=mla", "recompute=selective/mla_up_proj", "offload=qkv_linear"), "offload=qkv_linear"),
    Row("an offload point the model does not have", ("model=standard_attn", "offload=expert_fc1"),
        "offload=expert_fc1"),
    Row("an offload point in one layer only (megatron keeps the last one on the device)",
        ("model=gdn", "offload=core_attn"), "offload=core_attn"),
    Row("expert offload on megatron's `SequentialMLP`",
        ("model=moe", "model.experts=sequential", "offload=expert_fc1-moe_act"), "offload=expert_fc1-moe_act"),
    Row("offload on a CPU-only run (nothing to relieve), unless emulated for tests",
        ("offload=core_attn-attn_proj",), "offload=core_attn-attn_proj", num_gpus=0),
    Row("offload whose predicted host copies exceed the node's host memory",
        ("offload=core_attn-attn_proj", "offload.host_memory_gib=1"), "offload=core_attn-attn_proj",
        planned_host_gib=2.0),
    Row("gradient-accumulation fusion without megatron's fp32 `main_grad` (a CPU run, or `train.optimizer=adamw`)",
        ("model.gradient_accumulation_fusion=true",), "model.gradient_accumulation_fusion", num_gpus=0),
    Row("the fused RoPE on a CPU-only run (its kernels run on a GPU)",
        ("model.apply_rope_fusion=true",), "model.apply_rope_fusion", num_gpus=0),
    Row("the fused RoPE inside `torch.compile`'d layers (inductor fuses RoPE itself)",
        ("model.apply_rope_fusion=true", "model.compile=layer"), "model.apply_rope_fusion"),
    Row("the fused RoPE on a model without rotary embeddings",
        ("model.apply_rope_fusion=true", "model.position_embedding_type=learned_absolute"), "model.apply_rope_fusion"),
    Row("a size or count below 1 (any of them: heads, layers, hidden, ffn, vocabulary, experts, top-k...)",
        ("model.num_attention_heads=0",), "model.num_attention_heads"),
    Row("a value outside its range (dropouts in [0, 1), lr > 0, weight decay and clipping >= 0...)",
        ("model.hidden_dropout=1.0",), "model.hidden_dropout"),
    Row("a key the schema lacks, added with `+` (Hydra checks the others at compose time)",
        ("+model.hiden_size=64",), "model.hiden_size"),
)


def refusal(row: Row) -> ConfigError:
    """The ConfigError that validate raises for the row's config (SystemExit if it raises none, or
    names another option)."""
    cfg = compose_config(list(row.overrides))
    try:
        validate(cfg, num_gpus=row.num_gpus, te_available=row.te_available)
        # then the host copies, as the controller's check_point checks them once the rules pass
        problem = host_memory_problem(cfg, int(row.planned_host_gib * 2**30)) if row.planned_host_gib else None
        if problem:
            raise ConfigError(*problem)
    except ConfigError as err:
        if err.option != row.option:
            raise SystemExit(
                f"{' '.join(row.overrides)}: refused for {err.option!r}, not {row.option!r}: "
                f"{err.problem}\nedit this row in {Path(__file__).name}"
            ) from err
        return err
    raise SystemExit(f"{' '.join(row.overrides)}: no longer refused; drop or edit this row in {Path(__file__).name}")


def _cell(text: str) -> str:
    """Message text as one markdown table cell (``<size>`` would otherwise read as an HTML tag)."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;").replace("\n", " ")


def machine(row: Row) -> str:
    """The machine a row assumes, in words."""
    where = "a CPU" if row.num_gpus == 0 else f"{row.num_gpus} GPU" + ("s" if row.num_gpus > 1 else "")
    planned = f", {row.planned_host_gib:g} GiB of host copies predicted" if row.planned_host_gib else ""
    return where + (", TE installed" if row.te_available else "") + planned


#: the longest table cell the docs allow (tools/check_links.py); a longer message becomes a numbered note
MAX_CELL = 200


def table() -> str:
    """The generated section: the markdown table, one line per row, then the messages too long for a cell."""
    lines = ["| combination | example | machine | refused option | why | fix |", "|---|---|---|---|---|---|"]
    notes: list[str] = []

    def short(text: str) -> str:
        cell = _cell(text)
        if len(cell) <= MAX_CELL:
            return cell
        notes.append(cell)
        return f"see note {len(notes)} below the table"

    for row in ROWS:
        err = refusal(row)
        lines.append(
            f"| {_cell(row.combination)} | `{' '.join(row.overrides)}` | {machine(row)} | "
            f"`{_cell(err.option)}` | {short(err.problem)} | {short(err.fix)} |"
        )
    if notes:
        lines += ["", "Notes (messages too long for a table cell, word for word):", ""]
        lines += [f"{n}. {text}" for n, text in enumerate(notes, 1)]
    return "\n".join(lines)


def render(doc: str) -> str:
    """The doc with the section between the markers replaced by the current table."""
    return replace_section(doc, BEGIN, table(), DOC)


def main(argv: list[str] | None = None) -> int:
    return generated.main(DOC, render, "is out of date with recipes/validate/: run `make docs`",
                          f"the compatibility table matches the rules ({len(ROWS)} rows)", f" ({len(ROWS)} rows)",
                          argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
