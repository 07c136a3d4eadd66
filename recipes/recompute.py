"""The recompute vocabulary: families, attention backends, labels, ledger kinds, options.

Every other module imports these names; none re-derives them. A recompute *option* is what the
``recompute`` config group names (``none``, ``control``, ``selective/<label>[-<label>...]``, ``full``,
``full/block``): one YAML file under ``conf/recompute/``. A *label* is one of megatron-core's
``recompute_modules``. Adding a label is one YAML file there plus one ``Label`` entry here (plus its
checkpoint site in ``recipes.measure.ledger`` if megatron opens it from new code).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

from omegaconf import OmegaConf

from recipes.errors import ConfigError
from recipes.files import CONF_DIR

#: Model families (``model=``): the attention/MLP variant of the GPT model.
FAMILIES = ("standard_attn", "mla", "moe", "gdn")
#: Core-attention backends (``attention=``).
BACKENDS = ("unfused", "sdpa", "te")
#: Activation-ledger module kinds, in report order (``recipes.measure.ledger`` attributes bytes to them).
KINDS = ("embedding", "norm", "attn_proj", "core_attn", "gdn", "mlp", "moe", "other", "logits")
#: The options that recompute nothing: no recompute, and the guide's matched control (selective, []).
NO_RECOMPUTE = ("none", "control")


@dataclass(frozen=True)
class Label:
    """One selective recompute label (a megatron-core ``recompute_modules`` entry)."""

    name: str
    families: tuple[str, ...]  # families whose model has the modules it wraps
    what: str  # what it recomputes, for messages
    flags: tuple[str, ...]  # module attributes megatron (or our experts) set where it applies
    wraps_nothing: str  # the advice when it wraps no module of a built model
    instead: str = ""  # what to use on a family without its modules


LABELS: dict[str, Label] = {label.name: label for label in (
    Label("core_attn", FAMILIES, "core attention (scores, softmax, context)", ("checkpoint_core_attention",),
          "this model has no attention modules that megatron checkpoints"),
    Label("mlp", ("standard_attn", "mla", "gdn"), "the dense MLP", ("recompute_mlp",),
          "every MLP here is an MoE layer: use selective/moe_act or selective/moe",
          "on MoE layers use recompute=selective/moe_act (or selective/moe)"),
    Label("moe_act", ("moe",), "the MoE expert activation between FC1 and FC2", ("activation_recompute",),
          "no experts module here implements moe_act: use model=moe with model.experts=grouped",
          "use model=moe, or recompute=selective/mlp for a dense MLP"),
    Label("moe", ("moe",), "the whole MoE layer (router, dispatch, experts)", ("moe_layer_recompute",),
          "no MoE layer here: use selective/mlp for dense MLPs",
          "use model=moe, or recompute=selective/mlp for a dense MLP"),
    Label("shared_experts", ("moe",), "the shared experts", ("shared_experts_recompute",),
          "no shared experts here: set model.moe_shared_expert_intermediate_size",
          "use model=moe with model.moe_shared_expert_intermediate_size=<size>"),
    Label("mla_up_proj", ("mla",), "MLA's Q/KV up-projections", ("recompute_up_proj",),
          "no MLA attention here: use model=mla, or selective/core_attn",
          "use model=mla, or recompute=selective/core_attn for standard attention"),
    Label("layernorm", FAMILIES, "the input and pre-MLP norms",
          ("recompute_input_layernorm", "recompute_pre_mlp_layernorm"),
          "the norms are fused into the next linear (or absent): use another label"),
    Label("gdn_norm_out", ("gdn",), "the GatedDeltaNet gated output norm", ("recompute_norm_out",),
          "no GatedDeltaNet layers here: use model=gdn with model.linear_attention_freq>=2",
          "use model=gdn (GatedDeltaNet layers), or recompute=selective/core_attn for standard attention"),
)}

#: The guide's first selective option per family (its decision guide, step 3).
GUIDE_FIRST_LABEL = {"standard_attn": "selective/core_attn", "mla": "selective/mla_up_proj",
                     "moe": "selective/moe_act", "gdn": "selective/gdn_norm_out"}


# --- the codec: config <-> option <-> labels ----------------------------------------------------------
def labels_of(cfg: Any) -> list[str]:
    """The selective labels a run config asks for ([] when recompute is off or full).

    Read from the granularity: megatron's ``recompute_modules`` keeps a default list even when
    recompute is off, so the list alone never says whether recompute is on."""
    rc = cfg["recompute"]
    return list(rc["recompute_modules"]) if rc["recompute_granularity"] == "selective" else []


def option_of(cfg: Any) -> str:
    """What a config recomputes, named as the recompute group names it, read from the values rather
    than the Hydra choice: ``recompute=control recompute.recompute_modules=[moe_act]`` is
    ``selective/moe_act``."""
    rc = cfg["recompute"]
    gran = rc["recompute_granularity"]
    if gran == "selective":
        labels = labels_of(cfg)
        return "selective/" + "-".join(labels) if labels else "control"
    if gran == "full":
        return "full/block" if rc["recompute_method"] == "block" else "full"
    return "none"


def selective_labels(option: str | None) -> frozenset | None:
    """The labels an option recomputes, as a set (none and control: empty); None for full recompute."""
    if option in NO_RECOMPUTE:
        return frozenset()
    if option and option.startswith("selective/"):
        return frozenset(option.split("/", 1)[1].split("-"))
    return None


def is_full(option: str | None) -> bool:
    """A full-recompute option (uniform or block)."""
    return (option or "").startswith("full")


def recompute_order(option: str | None) -> tuple:
    """none, control, selective labels (narrow first), full: the guide's order of preference."""
    option = option or ""
    kind = {"none": 0, "control": 1}.get(option, 3 if is_full(option) else 2)
    return (kind, option.count("-"), option)


# --- the options, from conf/recompute/ -----------------------------------------------------------------
@cache
def conf_options() -> tuple[str, ...]:
    """Every option of the ``recompute`` group: the YAML files under ``conf/recompute/``."""
    root = CONF_DIR / "recompute"
    return tuple(sorted(str(p.relative_to(root).with_suffix("")) for p in root.rglob("*.yaml")))


def recompute_config(option: str) -> dict:
    """The ``recompute`` group's values for ``option`` (``conf/recompute/<option>.yaml``)."""
    path = CONF_DIR / "recompute" / f"{option}.yaml"
    if not path.exists():
        raise ConfigError("recompute", f"no option {option!r}", f"use one of: {', '.join(conf_options())}")
    values = {"recompute_granularity": None, "recompute_modules": [], "recompute_method": None,
              "recompute_num_layers": None, "distribute_saved_activations": False}
    values.update(OmegaConf.to_container(OmegaConf.load(path)))
    return values


def options_for(family: str) -> list[str]:
    """The options whose every label applies to ``family``, in the guide's order of preference."""
    out = []
    for option in conf_options():
        labels = selective_labels(option)
        if labels is None or all(family in LABELS[label].families for label in labels if label in LABELS):
            out.append(option)
    return sorted(out, key=recompute_order)
