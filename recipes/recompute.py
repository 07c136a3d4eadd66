"""The recompute vocabulary: families, attention backends, labels, ledger kinds, options.

Every other module imports these names; none re-derives them. A model *family* (``model=``) is one YAML
file under ``conf/model/`` plus one ``Family`` entry here. A recompute *option* is what the
``recompute`` config group names (``none``, ``control``, ``selective/<label>[-<label>...]``, ``full``,
``full/block``): one YAML file under ``conf/recompute/``. A *label* is one of megatron-core's
``recompute_modules``. Adding a label is one YAML file there plus one ``Label`` entry here: the entry
carries what measure/ and predict/ need (its checkpoint sites, the FLOPs it replays, the activations it
discards, the modules the cost model times, its advice), and they loop over ``LABELS``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from omegaconf import OmegaConf

from recipes.errors import ConfigError
from recipes.files import CONF_DIR


@dataclass(frozen=True)
class Family:
    """One model family (``model=<name>``, ``conf/model/<name>.yaml``): an attention kind x an MLP kind,
    which is all the builder, the validator, the FLOPs and the estimator dispatch on (through
    ``ATTENTION_KIND``/``MLP_KIND`` and ``layer_kinds``), and the guide's first choices for it."""

    name: str
    #: Token mixer: standard (MHA/GQA), mla (Multi-Latent Attention), gdn (GatedDeltaNet layers with
    #: every ``linear_attention_freq``-th layer standard attention).
    attention: str
    #: MLP: dense, or moe on the layers ``moe_layer_freq`` picks (the rest dense).
    mlp: str
    #: The guide's first selective option (its decision guide, step 3; ``guide_order``).
    first_label: str
    #: The guide's offload option (``recipes.offload``): the attention point that also moves what fused
    #: (SDPA) attention keeps, where core_attn recompute saves nothing; the experts' for MoE.
    first_offload: str
    #: Measured on the GPU (docs/evidence/h200.md): checks/ hold every (family, option) pair to a row.
    measured: bool = False


#: Model families (``model=``). ``mla_moe`` (DeepSeek-V2/V3, Moonlight, Kimi) and ``gdn_moe`` (Qwen3-Next)
#: compose the measured four.
FAMILIES: dict[str, Family] = {family.name: family for family in (
    Family("standard_attn", "standard", "dense", "selective/core_attn", "core_attn-attn_proj", measured=True),
    Family("mla", "mla", "dense", "selective/mla_up_proj", "core_attn-attn_proj", measured=True),
    Family("moe", "standard", "moe", "selective/moe_act", "expert_fc1-moe_act", measured=True),
    Family("gdn", "gdn", "dense", "selective/gdn_norm_out", "attn_norm-mlp_norm", measured=True),
    Family("mla_moe", "mla", "moe", "selective/mla_up_proj-moe_act", "core_attn-attn_proj"),
    Family("gdn_moe", "gdn", "moe", "selective/gdn_norm_out-moe_act", "expert_fc1-moe_act"),
)}
#: Views of ``FAMILIES`` the other modules read: the measured families, each family's kinds.
BASE_FAMILIES = tuple(name for name, family in FAMILIES.items() if family.measured)
ATTENTION_KIND = {name: family.attention for name, family in FAMILIES.items()}
MLP_KIND = {name: family.mlp for name, family in FAMILIES.items()}
#: Core-attention backends (``attention=``).
BACKENDS = ("unfused", "sdpa", "te")
#: Activation-ledger module kinds, in report order (``recipes.measure.ledger`` attributes bytes to them).
KINDS = ("embedding", "norm", "attn_proj", "core_attn", "gdn", "mlp", "moe", "other", "logits")
#: The options that recompute nothing: no recompute, and the guide's matched control (selective, []).
NO_RECOMPUTE = ("none", "control")


@dataclass(frozen=True)
class Label:
    """One selective recompute label (a megatron-core ``recompute_modules`` entry) and every fact about it
    that measure/ and predict/ use: they loop over ``LABELS`` and keep no table of their own, so a new
    label is one YAML file under ``conf/recompute/selective/`` plus one entry here."""

    name: str
    needs: str  # the layer part it wraps: any | attention (standard or MLA) | mla | gdn | dense | moe | shared
    what: str  # what it recomputes, for messages
    flags: tuple[str, ...]  # module attributes megatron (or our experts) set where it applies
    wraps_nothing: str  # the advice when it wraps no module of a built model
    instead: str = ""  # what to use on a family without its modules
    #: Where the ledger sees it: the (file name, function; None: any) of the code that opens its checkpoint
    #: (``recipes.measure.ledger``).
    sites: tuple[tuple[str, str | None], ...] = ()
    #: A module that must sit beside a flag for the flag to count (``recipes.measure.labels``).
    owner_attr: str = ""
    #: Replayed through megatron's ``CheckpointWithoutOutput`` (else ``tensor_parallel.checkpoint``, as full
    #: recompute is), unless the ``recompute`` option named by ``checkpoint_if`` is set.
    without_output: bool = False
    checkpoint_if: str = ""
    #: The FLOPs it replays: a region of ``recipes.measure.flops.layer_forward_flops`` ("": elementwise work
    #: only), times ``flops_share(cfg)`` (default all of it).
    flops: str = ""
    flops_share: Callable[[Any], float] | None = None
    #: The activation terms it discards (``recipes.predict.activations.layer_terms``): given the layer's
    #: ``Dims``, its (mixer, MLP) kinds and its terms without this label, its terms with it. None: the term
    #: builders handle the label themselves (the older labels, whose checkpoints share storages with
    #: their neighbours' terms).
    activations: Callable[[Any, tuple[str, str], list], list] | None = None
    #: The cost model (``recipes.predict.cost``): the modules whose forward its replay runs (``timed``) less
    #: the ones inside those it does not run (``untimed``; a callable of the run config where that
    #: depends on it), and where backward runs it: (module at whose backward start it replays, the
    #: function an elementwise replay runs there; "" for a matmul label). ``elementwise``: (checkpoint
    #: regions, kernels; None: the MLP activation's) per layer it covers, for a label without a matmul.
    timed: tuple[str, ...] = ()
    untimed: tuple[str, ...] | Callable[[Any], tuple[str, ...]] = ()
    at: tuple[tuple[str, str], ...] = ()
    elementwise: tuple[int, int | None] | None = None
    #: (module, class, method) its replay runs where that is not a timed module (``recipes.measure.regions``).
    region_function: tuple[str, str, str] | None = None
    #: Its advice for a peak (``recipes.measure.timeline.first_label_to_try``): the ledger kind whose
    #: activations it answers, when (given ``{"model", "attention"}`` of the run), and why.
    advice_kind: str = ""
    advice_when: Callable[[dict], bool] | None = None
    advice: str | Callable[[dict], str] = ""

    @property
    def families(self) -> tuple[str, ...]:
        """The families whose default layer pattern has its modules (every layer MoE for MoE families)."""
        return tuple(f for f in FAMILIES if self.applies(family_model(f)))

    def applies(self, model: Any) -> bool:
        """Whether a model (its ``model`` config) has a module this label wraps, layer pattern included."""
        kinds = layer_kinds(model)
        mixers, mlps = {k[0] for k in kinds}, {k[1] for k in kinds}
        return {"any": True, "attention": bool(mixers & {"standard", "mla"}), "mla": "mla" in mixers,
                "gdn": "gdn" in mixers, "dense": "dense" in mlps, "moe": "moe" in mlps,
                "shared": "moe" in mlps and bool(_get(model, "moe_shared_expert_intermediate_size"))}[self.needs]

    def covers(self, model: Any) -> list[bool]:
        """Per global layer, whether the label wraps a module there (its ``needs`` against the pattern)."""
        shared = bool(_get(model, "moe_shared_expert_intermediate_size"))
        return [{"any": True, "attention": mixer in ("standard", "mla"), "mla": mixer == "mla", "gdn": mixer == "gdn",
                 "dense": mlp == "dense", "moe": mlp == "moe", "shared": mlp == "moe" and shared}[self.needs]
                for mixer, mlp in layer_kinds(model)]

    def replayed_flops(self, layer: dict[str, float], cfg: Any) -> float:
        """Forward FLOPs it replays in one layer whose regions' FLOPs are ``layer``."""
        if not self.flops:
            return 0.0
        return layer.get(self.flops, 0.0) * (self.flops_share(cfg) if self.flops_share else 1.0)

    def untimed_modules(self, cfg: Any) -> tuple[str, ...]:
        """``untimed`` for a run config."""
        return self.untimed(cfg) if callable(self.untimed) else self.untimed

    def advice_for(self, run: dict) -> str | None:
        """Why to try it for a peak its ``advice_kind`` dominates; None where it is not the advice."""
        if not self.advice_kind or (self.advice_when and not self.advice_when(run)):
            return None
        return self.advice(run) if callable(self.advice) else self.advice


def mlp_replays_fc2(cfg: Any) -> bool:
    """Whether the ``mlp`` label is megatron's whole-MLP checkpoint (``recompute.mlp_replays_fc2``, and
    Transformer Engine's spec, which ``recipes.build.mlp`` does not replace)."""
    return bool(cfg["recompute"].get("mlp_replays_fc2", False)) or cfg["attention"]["backend"] == "te"


def mlp_replay_share(cfg: Any) -> float:
    """The share of the dense MLP's FLOPs its ``mlp`` label replays: all of them with megatron's
    whole-MLP checkpoint (``mlp_replays_fc2``), FC1's alone otherwise (``recipes.build.mlp``: FC1 is
    glu x FC2's size)."""
    if mlp_replays_fc2(cfg):
        return 1.0
    glu = 2 if cfg["model"]["gated_linear_unit"] else 1
    return glu / (glu + 1)


def _core_attn_advice(run: dict) -> str:
    backend = (run.get("attention") or {}).get("backend")
    return "recompute core attention" + ("" if backend == "unfused" else f"; with {backend} attention the "
                                         "backend already rematerializes scores, so compare it against the control")


def _experts(run: dict) -> str | None:
    return (run.get("model") or {}).get("experts")


# --- the activations some labels discard (``Label.activations``): transforms of one layer's terms ---
# A term is (ledger kind, what, bytes) as ``recipes.predict.activations`` builds it; these read the sizes
# they keep off the terms they replace, so the builders stay label-free for them.
def _index(terms: list, what: str) -> int | None:
    return next((i for i, t in enumerate(terms) if t[1].startswith(what)), None)


def _mlp_activations(d: Any, kinds: tuple[str, str], terms: list) -> list:
    """A dense MLP keeps its input (the norm output) for the checkpoint, outside the MLP (kind other)
    under megatron's whole-MLP checkpoint; FC1 through FC2's input are discarded."""
    i = _index(terms, "fc1 input (norm output)") if kinds[1] == "dense" else None
    if i is None:
        return terms
    kept = ("other" if d.mlp_replays_fc2 else "mlp", "mlp checkpoint input (norm output)", terms[i][2])
    return terms[:i] + [kept] + [t for t in terms[i + 1:] if t[0] != "mlp"]


def _moe_activations(d: Any, kinds: tuple[str, str], terms: list) -> list:
    """An MoE layer keeps its input (the router's, the norm output); router, dispatch and experts' go."""
    i = _index(terms, "router input (norm output)") if kinds[1] == "moe" else None
    if i is None:
        return terms
    return terms[:i] + [("moe", "moe checkpoint input (norm output)", terms[i][2])] + [
        t for t in terms[i + 1:] if t[0] != "moe"]


def _moe_act_activations(d: Any, kinds: tuple[str, str], terms: list) -> list:
    """The experts keep FC1's output (the activation's input, with the router probs) and discard the
    activation's output and everything it saves through FC2's input."""
    i = _index(terms, "expert fc1 output") if kinds[1] == "moe" else None
    j = _index(terms, "expert fc2 input")
    if i is None or j is None:
        return terms
    return terms[:i] + [("moe", "expert fc1 output (moe_act checkpoint input)", terms[i][2])] + terms[j + 1:]


def _shared_experts_activations(d: Any, kinds: tuple[str, str], terms: list) -> list:
    """The shared experts' tensors go (their input is the router's, which stays)."""
    return [t for t in terms if not (t[0] == "moe" and t[1].startswith("shared "))]


#: MLA's attention modules outside its ``mla_up_proj`` checkpoint: the rest of ``self_attention``'s
#: forward is the up projections, RoPE and the q/k/v assembly the label replays.
MLA_OUTSIDE_UP_PROJ = ("self_attention.core_attention", "self_attention.linear_proj",
                       "self_attention.linear_q_proj", "self_attention.linear_q_down_proj",
                       "self_attention.linear_kv_down_proj", "self_attention.q_layernorm",
                       "self_attention.kv_layernorm")

# Elementwise replays on CUDA with the local spec (megatron-core 0.19.2 and recipes/build): layernorm is
# two CheckpointWithoutOutput regions of one kernel each (torch's fused RMSNorm; the CPU's composite runs
# six); moe_act one region, the experts' activation x probs (the activation's kernels); gdn_norm_out one
# region, the gated output norm (norm, silu of the gate, product, cast; approximate).
LABELS: dict[str, Label] = {label.name: label for label in (
    Label("core_attn", "attention", "core attention (scores, softmax, context)", ("checkpoint_core_attention",),
          "this model has no attention modules that megatron checkpoints",
          sites=(("attention.py", "_checkpointed_attention_forward"),), flops="core_attn",
          timed=("self_attention.core_attention",), at=(("self_attention.core_attention", ""),),
          advice_kind="core_attn", advice=_core_attn_advice),
    Label("mlp", "dense", "the dense MLP", ("recompute_mlp",),
          "every MLP here is an MoE layer: use selective/moe_act or selective/moe",
          "on MoE layers use recompute=selective/moe_act (or selective/moe); model.moe_layer_freq "
          "with dense layers (e.g. [0]*1+[1]*3) gives mlp something to wrap",
          sites=(("transformer_layer.py", "_forward_mlp"), ("mlp.py", "forward")),  # mlp.py: recipes/build/mlp.py
          without_output=True, checkpoint_if="mlp_replays_fc2", flops="mlp", flops_share=mlp_replay_share,
          activations=_mlp_activations,
          timed=("mlp",), untimed=lambda cfg: () if mlp_replays_fc2(cfg) else ("mlp.linear_fc2",), at=(("mlp", ""),),
          advice_kind="mlp", advice="recompute the dense MLP (costs more compute than a narrow label)"),
    Label("moe_act", "moe", "the MoE expert activation between FC1 and FC2", ("activation_recompute",),
          "no experts module here implements moe_act: use model=moe with model.experts=grouped",
          "use an MoE family (model=moe, mla_moe, gdn_moe), or recompute=selective/mlp for a dense MLP",
          sites=(("experts.py", None),), without_output=True, activations=_moe_act_activations,
          at=(("mlp.experts", "moe_act"),),
          elementwise=(1, None), region_function=("recipes.build.experts", "GroupedExperts", "activation"),
          advice_kind="moe", advice_when=lambda run: _experts(run) != "sequential",
          advice="the expert intermediate activation is the narrow boundary"),
    Label("moe", "moe", "the whole MoE layer (router, dispatch, experts)", ("moe_layer_recompute",),
          "no MoE layer here: use selective/mlp for dense MLPs",
          "use an MoE family (model=moe, mla_moe, gdn_moe), or recompute=selective/mlp for a dense MLP",
          sites=(("transformer_layer.py", "_forward_mlp_partial_cudagraphs"), ("moe_layer.py", "forward")),
          flops="moe", activations=_moe_activations, timed=("mlp",), at=(("mlp", ""),),
          advice_kind="moe", advice_when=lambda run: _experts(run) == "sequential",
          advice="moe_act is a no-op with sequential experts, so recompute the MoE layer"),
    Label("shared_experts", "shared", "the shared experts", ("shared_experts_recompute",),
          "no shared experts here: set model.moe_shared_expert_intermediate_size",
          "use an MoE family with model.moe_shared_expert_intermediate_size=<size>",
          sites=(("moe_layer.py", "shared_experts_compute"),), owner_attr="shared_experts",
          activations=_shared_experts_activations,
          flops="shared_experts", timed=("mlp.shared_experts",), at=(("mlp.shared_experts", ""),)),
    Label("mla_up_proj", "mla", "MLA's Q/KV up-projections", ("recompute_up_proj",),
          "no MLA attention here: use model=mla, or selective/core_attn",
          "use model=mla or model=mla_moe, or recompute=selective/core_attn for standard attention",
          sites=(("multi_latent_attention.py", None),), without_output=True, flops="mla_up_proj",
          timed=("self_attention",), untimed=MLA_OUTSIDE_UP_PROJ, at=(("self_attention.core_attention", ""),),
          advice_kind="attn_proj", advice_when=lambda run: ATTENTION_KIND.get(run["model"].get("family")) == "mla",
          advice="MLA's expanded Q/K/V up-projections dominate"),
    Label("layernorm", "any", "the input and pre-MLP norms",
          ("recompute_input_layernorm", "recompute_pre_mlp_layernorm"),
          "the norms are fused into the next linear (or absent): use another label",
          # megatron registers the norms' recompute on the attention's and the MLP's outputs
          sites=(("transformer_layer.py", "_forward_attention"), ("transformer_layer.py", "_forward_pre_mlp_layernorm")),
          without_output=True, at=(("self_attention", "input_layernorm"), ("mlp", "pre_mlp_layernorm")),
          elementwise=(2, 2), advice_kind="norm", advice="norm outputs are material; discard and recompute them"),
    Label("gdn_norm_out", "gdn", "the GatedDeltaNet gated output norm", ("recompute_norm_out",),
          "no GatedDeltaNet layers here: use model=gdn with model.linear_attention_freq>=2",
          "use model=gdn or gdn_moe (GatedDeltaNet layers), or recompute=selective/core_attn for standard attention",
          sites=(("gdn.py", "forward"),), without_output=True, elementwise=(1, 4),  # megatron's ssm/gated_delta_net
          advice_kind="gdn", advice="recompute the GatedDeltaNet gated output norm (the guide's GDN label; the "
          "delta-rule tensors stay: full covers them)"),
)}

def replays_without_output(label: str, recompute: Any) -> bool:
    """Whether a label (of a run's ``recompute`` config) replays through ``CheckpointWithoutOutput``
    (transformer_layer.py's norms, multi_latent_attention.py's up-projections, gdn.py's output norm,
    recipes.build.experts' moe_act, recipes.build.mlp's mlp) rather than ``tensor_parallel.checkpoint``."""
    record = LABELS.get(label)
    return bool(record and record.without_output and not (record.checkpoint_if and recompute.get(record.checkpoint_if)))


#: The guide's first selective option per family (``Family.first_label``).
GUIDE_FIRST_LABEL = {name: family.first_label for name, family in FAMILIES.items()}


# --- the layer pattern: which layers are GDN / attention, dense / MoE ---------------------------------
def _get(model: Any, key: str, default: Any = None) -> Any:
    return model.get(key, default) if hasattr(model, "get") else getattr(model, key, default)


def family_model(family: str) -> dict:
    """A model config with the family's default pattern (MoE on every layer; shared experts counted as
    possible: whether a model has them is its own config's business, ``Label.applies``)."""
    return {"family": family, "num_layers": 4, "moe_layer_freq": 1, "linear_attention_freq": 4,
            "moe_shared_expert_intermediate_size": 1}


def parse_pattern(value: Any, num_layers: int, what: str = "model.moe_layer_freq") -> list[int]:
    """A per-layer 0/1 list (see ``_parse_pattern``), cached: the estimator asks once per layer."""
    key = tuple(value) if isinstance(value, (list, tuple)) else value
    return list(_parse_pattern(key, num_layers, what))


@cache
def _parse_pattern(value: Any, num_layers: int, what: str) -> tuple[int, ...]:
    """A per-layer 0/1 list from megatron's int-or-list fields, or Megatron-LM's command-line string
    form ``"([0]*3+[1]*58)"`` (DeepSeek-V3's first_k_dense_replace=3). Refused when its length is not
    ``num_layers``."""
    if isinstance(value, str):
        body = value.replace(" ", "").strip("()")
        parts = body.split("+") if body else []
        out: list[int] = []
        for part in parts:
            match = re.fullmatch(r"\[([01](?:,[01])*)\](?:\*(\d+))?", part)
            if not match:
                raise ConfigError(what, f"cannot read the pattern {value!r}",
                                  "write an int N (MoE every N-th layer), a 0/1 list, or \"([0]*3+[1]*58)\"")
            out += [int(x) for x in match.group(1).split(",")] * int(match.group(2) or 1)
        value = out
    if isinstance(value, int):
        return tuple(1 if i % value == 0 else 0 for i in range(num_layers)) if value >= 1 else (0,) * num_layers
    value = tuple(int(x) for x in value)
    if len(value) != num_layers or set(value) - {0, 1}:
        raise ConfigError(what, f"a pattern of {len(value)} entries for {num_layers} layers (0/1 each)",
                          f"give one 0/1 per layer ({num_layers}), e.g. \"([0]*1+[1]*{max(0, num_layers - 1)})\"")
    return value


def moe_pattern(model: Any) -> list[int]:
    """Per layer, 1 for an MoE MLP and 0 for a dense one (megatron's ``moe_layer_freq``: an int N
    puts MoE on layers 0, N, 2N...; a list is per layer). All 0 for a dense family."""
    n = _get(model, "num_layers")
    if MLP_KIND.get(_get(model, "family"), "dense") != "moe":
        return [0] * n
    return parse_pattern(_get(model, "moe_layer_freq", 1), n)


def gdn_pattern(model: Any) -> list[int]:
    """Per layer, 1 for GatedDeltaNet and 0 for standard attention (megatron's
    ``get_linear_attention_pattern``: every ``linear_attention_freq``-th layer is attention)."""
    n = _get(model, "num_layers")
    if ATTENTION_KIND.get(_get(model, "family")) != "gdn":
        return [0] * n
    freq = _get(model, "linear_attention_freq")
    if isinstance(freq, int) and not isinstance(freq, bool):
        return [0 if (i + 1) % freq == 0 else 1 for i in range(n)] if freq >= 1 else [1] * n
    return parse_pattern(freq, n, "model.linear_attention_freq")


def layer_kinds(model: Any) -> list[tuple[str, str]]:
    """(token mixer, MLP) per layer: mixer standard | mla | gdn, MLP dense | moe."""
    attention = ATTENTION_KIND.get(_get(model, "family"), "standard")
    gdn, moe = gdn_pattern(model), moe_pattern(model)
    return [("gdn" if g else ("mla" if attention == "mla" else "standard"), "moe" if e else "dense")
            for g, e in zip(gdn, moe)]


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


def guide_order(option: str | None, family: str | None) -> tuple:
    """``recompute_order`` with the family's first label (``GUIDE_FIRST_LABEL``: the guide's decision
    guide, step 3) and its parts ahead of the other selective options: for grouped MoE ``moe_act``
    before ``layernorm``, where both replay no matmul."""
    kind, dashes, name = recompute_order(option)
    first = selective_labels(GUIDE_FIRST_LABEL.get(family or "", "")) or frozenset()
    labels = selective_labels(option) or frozenset()
    return (kind, 0 if kind == 2 and labels and labels <= first else 1, dashes, name)


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


def options_for(family_or_model: str | Any) -> list[str]:
    """The options whose every label applies, in the guide's order of preference. A family name uses
    its default pattern; a ``model`` config its own (``mlp`` applies to an MoE model's dense layers)."""
    model = family_model(family_or_model) if isinstance(family_or_model, str) else family_or_model
    out = []
    for option in conf_options():
        labels = selective_labels(option)
        if labels is None or all(LABELS[label].applies(model) for label in labels if label in LABELS):
            out.append(option)
    return sorted(out, key=recompute_order)


def chunk_layers(model: Any, parallel: Any) -> list[range]:
    """Global layers of each model chunk (index: virtual stage * pp + pipeline stage), as megatron splits
    them: evenly, or with ``num_layers_in_first/last_pipeline_stage`` (no interleaving) the rest evenly
    over the middle stages. Refused (``ConfigError``) where the stages cannot split the depth."""
    n, pp = _get(model, "num_layers"), _get(parallel, "pipeline_model_parallel_size")
    vpp = _get(parallel, "virtual_pipeline_model_parallel_size") or 1
    first, last = (_get(parallel, f"num_layers_in_{k}_pipeline_stage") for k in ("first", "last"))
    if first is None and last is None:
        if n % (pp * vpp):
            raise ConfigError("model.num_layers", f"{n} layers do not split into {pp} stage(s) x {vpp} "
                              "virtual stage(s)", f"set model.num_layers to a multiple of {pp * vpp}, shrink "
                              "PP/VPP, or give parallel.num_layers_in_first/last_pipeline_stage")
        per = n // (pp * vpp)
        return [range(c * per, (c + 1) * per) for c in range(pp * vpp)]
    if vpp > 1 or pp < 2:
        raise ConfigError("parallel.num_layers_in_first_pipeline_stage", "uneven stages are modeled "
                          "for pipeline parallel without interleaving", "drop the virtual stages, or split evenly")
    sizes = [first, *([None] * (pp - 2)), last]
    middle = n - (first or 0) - (last or 0)
    free = sum(s is None for s in sizes)
    if middle < 0 or free == 0 and middle or free and middle % free:
        given = f"parallel.num_layers_in_{'last' if last is not None else 'first'}_pipeline_stage"  # the one set
        raise ConfigError(given, f"model.num_layers={n} minus {first or 0} first and {last or 0} last "
                          f"leave {middle} for {free} other stage(s)", "pick parallel.num_layers_in_first/last_pipeline"
                          "_stage leaving a multiple of the other stages, or change model.num_layers")
    sizes = [s if s is not None else middle // free for s in sizes]
    starts = [sum(sizes[:i]) for i in range(pp)]
    return [range(a, a + k) for a, k in zip(starts, sizes)]
