"""The offload vocabulary: megatron-core's fine-grained offload points, the ``offload`` options, the rules.

Activation offload is the other way to take saved activations off the device: instead of dropping
them and replaying the forward (recompute), a module's tensors saved for backward are copied to host
memory after its forward, on a copy stream, and copied back before its backward. megatron-core calls
the points ``offload_modules``; this project calls one a *module* and a YAML file under
``conf/offload/`` an *option* (``none``, ``<module>[-<module>...]``), as ``recipes.recompute`` does for
recompute. Adding a module is one YAML file there plus one ``OffloadModule`` entry here: the entry
carries what validation and the estimator need (the layer part it sits in, the ledger terms saved
inside it, the timed module whose marks its group commits and reloads at, its place in a layer's
forward), and they loop over ``MODULES``.

``rule_problem`` is the one home of the rules between offload, recompute and the model; the validator
refuses with it and the advisor skips the combinations it names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from omegaconf import OmegaConf

from recipes.config import OffloadConfig
from recipes.errors import ConfigError
from recipes.files import CONF_DIR
from recipes.recompute import ATTENTION_KIND, FAMILIES, Label, family_model, layer_kinds


@dataclass(frozen=True)
class OffloadModule:
    """One of megatron-core's ``offload_modules``: a point whose saved tensors go to the host, and every
    fact about it that validation and the estimator use: they loop over ``MODULES`` and keep no table of
    their own, so a new module is one YAML file under ``conf/offload/`` plus one entry here."""

    name: str
    needs: str  # the layer part it sits in, as ``Label.needs``: any | attention | moe (the routed experts)
    what: str  # what it moves, for messages and docs
    kind: str  # the activation-ledger kind those tensors count under
    te_only: str = ""  # why it cannot run without Transformer Engine, if it cannot
    #: Whether a ledger term (kind, what, bytes) of ``recipes.predict.activations`` is saved inside its
    #: point, given the layer's ``Dims`` (``recipes.predict.offload.point_of``: the first module in
    #: ``MODULES`` order whose ``saves`` says so; None: the estimator does not model the module).
    saves: Callable[[tuple, Any], bool] | None = None
    #: The timed module (``recipes.measure.moduletime``) at whose forward end its group commits and at
    #: whose backward start it reloads (``recipes.predict.copies``).
    mark: str = ""
    #: Where its module starts and ends in a layer's forward, as two of ``recipes.predict.copies``'
    #: FLOP boundaries: start, qkv, core_attn, attention, fc1, end (modules sharing a ``mark`` split
    #: its measured span by these).
    span: tuple[str, str] | None = None

    def applies(self, model: Any) -> bool:
        """Whether a model (its ``model`` config) has this point, layer pattern included."""
        return Label(self.name, self.needs, "", (), "").applies(model)

    def num_layers(self, model: Any) -> int:
        """How many of the model's layers have this point."""
        return sum(self.in_layer(kind) for kind in layer_kinds(model))

    def in_layer(self, kind: tuple[str, str]) -> bool:
        """Whether a layer of this kind ((mixer, MLP) as ``layer_kinds`` gives) has this point."""
        mixer, mlp = kind
        return {"any": True, "attention": mixer in ("standard", "mla"), "moe": mlp == "moe"}[self.needs]


# --- the ledger terms each point saves (``OffloadModule.saves``), by the names the estimator gives them
_QKV_TERMS = ("qkv input (norm output)", "q_layernorm", "k_layernorm", "q_up input", "kv_up input",
              "kv_layernorm", "mla_up_proj checkpoint")


def _saves_qkv(term: tuple, d: Any) -> bool:
    """The QKV computation's tensors; MLA applies RoPE inside it."""
    return term[1].startswith(_QKV_TERMS) or (d.attention_kind == "mla" and term[1].startswith("RoPE"))


def _saves_moe_act(term: tuple, d: Any) -> bool:
    """The routed experts' tensors from FC1's output through the activation, and the probs it weighs by."""
    return term[1] == "permuted probs" or (term[1].startswith("expert ") and "fc2 input" not in term[1])


#: In the order a layer's forward reaches them (``recipes.predict.offload`` groups them so).
MODULES: dict[str, OffloadModule] = {m.name: m for m in (
    OffloadModule("attn_norm", "any", "the input norm's input (the layer input)", "norm",
                  saves=lambda t, d: t[1].startswith("input norm"), mark="input_layernorm", span=("start", "start")),
    OffloadModule("qkv_linear", "attention", "the QKV projection's input (the input norm's output)", "attn_proj",
                  saves=_saves_qkv, mark="self_attention.linear_qkv", span=("start", "qkv")),
    OffloadModule("core_attn", "attention", "what core attention saves (q, k, v, its output; unfused "
                  "attention also its scores and probabilities)", "core_attn",
                  saves=lambda t, d: t[0] == "core_attn", mark="self_attention.core_attention", span=("qkv", "core_attn")),
    OffloadModule("attn_proj", "attention", "the output projection's input (core attention's output)", "attn_proj",
                  saves=lambda t, d: t[1] == "linear_proj input (context)", mark="self_attention.linear_proj",
                  span=("core_attn", "attention")),
    OffloadModule("mlp_norm", "any", "the pre-MLP norm's input", "norm",
                  saves=lambda t, d: t[1].startswith("pre-MLP norm"), mark="pre_mlp_layernorm",
                  span=("attention", "attention")),
    # megatron commits expert_fc1 after FC1 and moe_act after FC2: both at the experts' marks
    OffloadModule("expert_fc1", "moe", "the routed experts' FC1 input (the permuted tokens)", "moe",
                  saves=lambda t, d: t[1] == "expert fc1 input (permuted)", mark="mlp.experts", span=("attention", "fc1")),
    OffloadModule("moe_act", "moe", "the routed experts' activation input (FC1's output)", "moe",
                  saves=_saves_moe_act, mark="mlp.experts", span=("fc1", "end")),
    OffloadModule("fused_group_mlp", "moe", "the whole fused grouped MLP's input", "moe",
                  te_only="it needs Transformer Engine's op fuser (use_transformer_engine_op_fuser)"),
)}
#: Offload points inside the routed experts (``needs`` moe): whole-``moe`` recompute checkpoints around them.
INSIDE_MOE = frozenset(name for name, module in MODULES.items() if module.needs == "moe")
#: The guide's offload choice per family (``recompute.Family.first_offload``).
GUIDE_FIRST_OFFLOAD = {name: family.first_offload for name, family in FAMILIES.items()}


# --- the codec: config <-> option <-> modules ---------------------------------------------------------
def modules_of(cfg: Any) -> list[str]:
    """The fine-grained offload modules a run config asks for ([] when fine-grained offload is off)."""
    off = cfg.get("offload") or {}
    return list(off.get("offload_modules") or []) if off.get("fine_grained_activation_offloading") else []


def option_of(cfg: Any) -> str:
    """What a config offloads, named as the ``offload`` group names it (``none`` when nothing)."""
    modules = modules_of(cfg)
    return "-".join(modules) if modules else "none"


def option_modules(option: str | None) -> list[str]:
    """The modules an option names, in its order ([] for ``none``)."""
    return [] if option in (None, "", "none") else option.split("-")


@cache
def conf_options() -> tuple[str, ...]:
    """Every option of the ``offload`` group: the YAML files under ``conf/offload/``."""
    root = CONF_DIR / "offload"
    return tuple(sorted(p.stem for p in root.glob("*.yaml")))


def offload_config(option: str) -> dict:
    """The ``offload`` group's values for ``option`` (``conf/offload/<option>.yaml``) over the schema
    defaults the file leaves out."""
    path = CONF_DIR / "offload" / f"{option}.yaml"
    if not path.exists():
        raise ConfigError("offload", f"no option {option!r}", f"use one of: {', '.join(conf_options())}")
    values = OmegaConf.to_container(OmegaConf.structured(OffloadConfig))
    values.update(OmegaConf.to_container(OmegaConf.load(path)))
    return values


def options_for(model: Any) -> list[str]:
    """The offload options whose every module applies to a model (a family name or a ``model`` config),
    ``none`` first, then fewer modules first."""
    model = family_model(model) if isinstance(model, str) else model
    out = [o for o in conf_options() if all(MODULES[m].applies(model) for m in option_modules(o))]
    return sorted(out, key=lambda o: (o != "none", len(option_modules(o)), o))


# --- the rules ---------------------------------------------------------------------------------------
def rule_problem(modules: list[str], recompute_labels: frozenset | None, model: Any, pp: int = 1,
                 option: str = "offload") -> tuple[str, str, str] | None:
    """Why these offload ``modules`` cannot run with a recompute (its selective labels, ``None`` for full
    recompute) on ``model`` at pipeline size ``pp``, as (option, problem, fix); None when they can.
    The rules are megatron-core 0.19.2's own (transformer_config.py) and the silent no-ops it would
    accept."""
    name = f"{option}={'-'.join(modules)}"
    for module in modules:
        if module not in MODULES:
            return ("offload.offload_modules", f"unknown offload module {module!r}",
                    f"use modules from: {', '.join(m for m in MODULES if not MODULES[m].te_only)}")
        info = MODULES[module]
        if info.te_only:
            return (name, f"{module} cannot run without Transformer Engine: {info.te_only}",
                    "use offload=expert_fc1-moe_act for the routed experts")
        if not info.applies(model):
            usable = [f"offload={o}" for o in options_for(model) if o != "none"]
            return (name, f"{module} offloads {info.what}, but model={_get(model, 'family')} has none "
                    "(megatron-core would accept it and move nothing)",
                    f"use one that applies: {', '.join(usable[:4])}" if usable else "use offload=none")
        if pp == 1 and info.num_layers(model) == 1:
            return (name, f"model={_get(model, 'family')} has {module} in one layer only, and megatron's "
                    "manager keeps the last layer's group of each module on the device after its first "
                    "step (so that backward does not wait for it): it would move nothing",
                    "offload a module more layers have (offload=attn_norm-mlp_norm), or use more layers")
    if "attn_proj" in modules and "core_attn" not in modules:
        return (name, "attn_proj cannot be offloaded alone: its input is core attention's output, which "
                "core attention's backward needs on the device (megatron-core raises)",
                f"use offload={'-'.join(['core_attn'] + list(modules))}, which offloads both")
    if INSIDE_MOE & set(modules) and _get(model, "experts", "grouped") != "grouped":
        return (name, "model.experts=sequential (megatron's SequentialMLP) has no offload points: "
                "expert_fc1/moe_act would move nothing", "use model.experts=grouped (the default)")
    if recompute_labels is None:
        return (name, "full recompute keeps only each layer's input, outside every offload point, and "
                "replays the layer's offload points inside backward, which megatron's manager does not "
                "expect (on a CPU with emulated copy streams the run crashed)",
                "use recompute=none or a selective option with offload, or offload=none with full recompute")
    if "moe" in recompute_labels and INSIDE_MOE & set(modules):
        inside = sorted(INSIDE_MOE & set(modules))
        return (name, f"{'/'.join(inside)} sit inside the whole-MoE checkpoint of recompute=selective/moe, "
                "which keeps nothing inside it (megatron-core asserts)",
                "use recompute=selective/moe_act with offload, or drop the expert modules from offload")
    if "layernorm" in recompute_labels and "qkv_linear" in modules and ATTENTION_KIND.get(_get(model, "family")) == "standard":
        return (name, "layernorm recompute discards the input norm's output, the one tensor qkv_linear offloads "
                "in standard attention: it would copy it to the host and save nothing",
                "use offload=attn_norm (the norm's input, which the layernorm checkpoint keeps) with layernorm recompute")
    if "mla_up_proj" in recompute_labels and "qkv_linear" in modules:
        return (name, "MLA's up-projection checkpoint sits inside the qkv_linear offload point, and its "
                "replay reads its saved tensors before the manager has a backward group (megatron-core "
                "0.19.2 fails in backward)", "use offload=core_attn-attn_proj with mla_up_proj recompute")
    if "core_attn" in recompute_labels and "core_attn" in modules:
        return (name, "core attention recompute replaces the offload point: megatron-core enters the "
                "core_attn offload only when it does not checkpoint core attention (a silent no-op)",
                "use recompute=none/control with offload=core_attn-attn_proj, or offload=qkv_linear with "
                "core_attn recompute")
    return None


def layer_offload_problem(cpu_offloading: bool, te_available: bool, recompute_on: bool, pp: int,
                          fine_grained: bool) -> tuple[str, str, str] | None:
    """Megatron's layer-level ``cpu_offloading`` (Transformer Engine's offload context), as (option,
    problem, fix), or None when it can run."""
    if not cpu_offloading:
        return None
    option = "offload.cpu_offloading"
    if not te_available:
        return (option, "layer-level CPU offloading is Transformer Engine's offload context, and Transformer "
                "Engine is not installed (megatron-core's TransformerBlock asserts)",
                "use fine-grained offload, which runs without it: offload=core_attn-attn_proj (or another "
                "conf/offload option)")
    if fine_grained:
        return (option, "layer-level and fine-grained offload cannot both be on (megatron-core asserts)",
                "use one: offload.cpu_offloading=false, or offload=none")
    if recompute_on:
        return (option, "layer-level CPU offloading does not work with activation recompute (megatron-core "
                "refuses)", "use recompute=none, or fine-grained offload, which composes with selective recompute")
    if pp > 1:
        return (option, "layer-level CPU offloading has no pipeline-parallel support (megatron-core refuses)",
                "use fine-grained offload (it supports PP and VPP), or pipeline_model_parallel_size=1")
    return None


def _get(model: Any, key: str, default: Any = None) -> Any:
    return model.get(key, default) if hasattr(model, "get") else getattr(model, key, default)
