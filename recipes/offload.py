"""The offload vocabulary: megatron-core's fine-grained offload points, the ``offload`` options, the rules.

Activation offload is the other way to take saved activations off the device: instead of dropping
them and replaying the forward (recompute), a module's tensors saved for backward are copied to host
memory after its forward, on a copy stream, and copied back before its backward. megatron-core calls
the points ``offload_modules``; this project calls one a *module* and a YAML file under
``conf/offload/`` an *option* (``none``, ``<module>[-<module>...]``), as ``recipes.recompute`` does for
recompute. Adding a module is one YAML file there plus one ``OffloadModule`` entry here.

``rule_problem`` is the one home of the rules between offload, recompute and the model; the validator
refuses with it and the advisor skips the combinations it names.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

from omegaconf import OmegaConf

from recipes.config import OffloadConfig
from recipes.errors import ConfigError
from recipes.files import CONF_DIR
from recipes.recompute import Label, family_model, layer_kinds


@dataclass(frozen=True)
class OffloadModule:
    """One of megatron-core's ``offload_modules``: a point whose saved tensors go to the host."""

    name: str
    needs: str  # the layer part it sits in, as ``Label.needs``: any | attention | moe
    what: str  # what it moves, for messages and docs
    kind: str  # the activation-ledger kind those tensors count under
    te_only: str = ""  # why it cannot run without Transformer Engine, if it cannot

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


MODULES: dict[str, OffloadModule] = {m.name: m for m in (
    OffloadModule("attn_norm", "any", "the input norm's input (the layer input)", "norm"),
    OffloadModule("qkv_linear", "attention", "the QKV projection's input (the input norm's output)", "attn_proj"),
    OffloadModule("core_attn", "attention", "what core attention saves (q, k, v, its output; unfused "
                  "attention also its scores and probabilities)", "core_attn"),
    OffloadModule("attn_proj", "attention", "the output projection's input (core attention's output)", "attn_proj"),
    OffloadModule("mlp_norm", "any", "the pre-MLP norm's input", "norm"),
    OffloadModule("expert_fc1", "moe", "the routed experts' FC1 input (the permuted tokens)", "moe"),
    OffloadModule("moe_act", "moe", "the routed experts' activation input (FC1's output)", "moe"),
    OffloadModule("fused_group_mlp", "moe", "the whole fused grouped MLP's input", "moe",
                  te_only="it needs Transformer Engine's op fuser (use_transformer_engine_op_fuser)"),
)}
#: Offload points inside the routed experts: whole-``moe`` recompute checkpoints around them.
INSIDE_MOE = frozenset({"expert_fc1", "moe_act", "fused_group_mlp"})
#: The guide's offload choice per family, mirroring ``recompute.GUIDE_FIRST_LABEL``: the attention
#: point that also moves what fused (SDPA) attention keeps, where core_attn recompute saves nothing.
GUIDE_FIRST_OFFLOAD = {"standard_attn": "core_attn-attn_proj", "mla": "core_attn-attn_proj",
                       "moe": "expert_fc1-moe_act", "gdn": "attn_norm-mlp_norm",
                       "mla_moe": "core_attn-attn_proj", "gdn_moe": "expert_fc1-moe_act"}


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
    if "layernorm" in recompute_labels and "qkv_linear" in modules and _get(model, "family") in ("standard_attn", "moe"):
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
