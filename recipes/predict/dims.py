"""The per-rank sizes every activation term reads (``Dims``, from a config: ``dims``), the refusals of
what the estimator does not model (``check_modeled``), and the terms' shared shape (``Term``, and a
norm's, ``norm_terms``), for ``recipes.predict.activations`` and ``recipes.predict.gdn_terms``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from fractions import Fraction

from recipes.build.resolve import resolve_precision, resolve_swiglu_fusion
from recipes.config import ModelConfig, typed
from recipes.errors import ConfigError
from recipes.recompute import ATTENTION_KIND, FAMILIES, MLP_KIND, labels_of, mlp_replays_fc2
from recipes.validate import gpu_count, validate


@dataclass(frozen=True)
class Dims:
    """Everything the terms need, per rank: sizes after tensor/context/expert partitioning."""

    family: str
    backend: str
    device: str  # cuda | cpu
    e: int  # bytes per activation element (2 bf16, 4 fp32)
    mask: int  # bytes per dropout-mask element (bool on CUDA, input dtype on CPU)
    s: int  # sequence on this rank (S / cp): attention, MLP, logits
    s_sp: int  # sequence in sequence-parallel regions (s / tp with SP): norms, residual, dropout
    b: int
    h: int
    tp: int
    ep: int
    np: int  # query heads on this rank
    ng: int  # key/value groups on this rank (MLA: = np)
    dq: int  # query/key head dim (MLA: qk_head_dim + qk_pos_emb_head_dim)
    dv: int
    rope: int  # rotary dims per head (0 without RoPE)
    model: ModelConfig  # the run's, bias_activation_fusion resolved for the device
    labels: frozenset  # selective labels in force
    full: bool
    #: Routed rows this rank's experts receive, over the balanced share (``moe_terms``). Only EP > 1
    #: departs from 1: a recorded share (``estimate --compare``: a Fraction, so rows are exact) or the
    #: bound ``estimate.moe_imbalance`` for the worst EP rank (before a run).
    routed_share: float | Fraction = 1
    #: The ``mlp`` label as megatron's layer-wide checkpoint (its input saved outside the MLP: kind
    #: other), not ``recipes.build.mlp``'s FC1-and-activation checkpoint inside it (kind mlp).
    mlp_replays_fc2: bool = False

    @property
    def attention_kind(self) -> str:
        """standard | mla | gdn (``recipes.recompute.ATTENTION_KIND``)."""
        return ATTENTION_KIND[self.family]


def validate_for(cfg: dict, device: str) -> None:
    """The validator's structural rules for a run on ``device``: a CPU machine for "cpu", for "cuda" a
    machine with one GPU per local process (whatever this machine has); "auto" for this machine. Not what
    this machine has installed (a compiler for megatron's build): the run's own controller asks that."""
    cfg = typed(cfg)
    validate(cfg, num_gpus=0 if _resolve_device(device) == "cpu" else max(1, cfg.launcher.nproc_per_node),
             te_available=False, this_machine=False)


def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if gpu_count() else "cpu"  # imports torch only where a GPU driver is loaded
    if device not in ("cuda", "cpu"):
        raise ConfigError("--device", f"unknown device {device!r}", "use cuda, cpu or auto")
    return device


def check_modeled(cfg: dict, device: str) -> None:
    """Refuse, by name, what the estimator does not model (never estimate it as something else)."""
    cfg = typed(cfg)
    m, par, backend = cfg.model, cfg.parallel, cfg.attention.backend
    if backend == "te":
        raise ConfigError("attention=te", "the estimator does not model Transformer Engine (its fused "
                          "attention and norm+linear modules save other tensors)",
                          "estimate attention=sdpa or attention=unfused")
    if m.family not in FAMILIES:
        raise ConfigError("model", f"family {m.family!r} is not modeled by the estimator",
                          f"use model=<one of {', '.join(FAMILIES)}>")
    if backend not in ("sdpa", "unfused"):
        raise ConfigError("attention", f"unknown backend {backend!r}", "use attention=sdpa or unfused")
    refuse = [
        (m.normalization not in ("RMSNorm", "LayerNorm"), "model.normalization",
         f"{m.normalization!r} is not modeled", "use RMSNorm or LayerNorm"),
        (m.position_embedding_type not in ("rope", "learned_absolute", "none"),
         "model.position_embedding_type", f"{m.position_embedding_type!r} is not modeled",
         "use rope, learned_absolute or none"),
        (resolve_swiglu_fusion(m, device == "cuda") and not m.gated_linear_unit, "model.bias_activation_fusion",
         "megatron's fused GELU needs biases, which this repository refuses", "set it false"),
        (par.context_parallel_size > 1, "parallel.context_parallel_size",
         "context parallel needs Transformer Engine attention, which is not modeled", "use 1"),
    ]
    if MLP_KIND[m.family] == "moe":
        refuse += [
            (m.moe_token_dispatcher_type not in ("allgather", "local"), "model.moe_token_dispatcher_type",
             f"the {m.moe_token_dispatcher_type} dispatcher is not modeled", "use local or allgather"),
            (m.moe_expert_capacity_factor is not None, "model.moe_expert_capacity_factor",
             "token dropping is not modeled (the estimator routes every token to top-k experts)",
             "set model.moe_expert_capacity_factor=null"),
            (m.moe_router_load_balancing_type not in ("aux_loss", "none"),
             "model.moe_router_load_balancing_type",
             f"{m.moe_router_load_balancing_type!r} is not modeled", "use aux_loss or none"),
            (m.moe_shared_expert_overlap, "model.moe_shared_expert_overlap",
             "shared-expert overlap is not modeled", "set it false"),
            ((par.expert_tensor_parallel_size or par.tensor_model_parallel_size) > 1,
             "parallel.expert_tensor_parallel_size", "expert tensor parallel > 1 is not modeled "
             "(grouped experts refuse it)", "set parallel.expert_tensor_parallel_size=1"),
        ]
    if ATTENTION_KIND[m.family] == "gdn":  # what was matched against a ledger: TP 1; on CUDA RMSNorm in bf16
        refuse += [
            (par.tensor_model_parallel_size > 1, "parallel.tensor_model_parallel_size",
             "GatedDeltaNet layers under tensor parallel are not modeled (never measured: in_proj, "
             "conv and out_proj split by head, sequence-parallel gathers)", "estimate model=gdn with "
             "tensor_model_parallel_size=1, or measure it: python train.py model=gdn parallel=tp2"),
            (device == "cuda" and m.normalization != "RMSNorm", "model.normalization",
             f"GDN's gated output norm as {m.normalization} on CUDA (inside a torch.compile'd helper) "
             "is not modeled: measured with RMSNorm only", "use model.normalization=RMSNorm, or measure it"),
        ]
    for bad, option, problem, fix in refuse:
        if bad:
            raise ConfigError(option, problem, fix)
    precision = resolve_precision(cfg.train.precision, device == "cuda")
    if device == "cpu" and precision != "fp32":
        raise ConfigError("train.precision", "CPU runs are modeled in fp32 only", "use precision=auto")
    if ATTENTION_KIND[m.family] == "gdn" and device == "cuda" and precision != "bf16":
        raise ConfigError("train.precision", "GatedDeltaNet layers on CUDA are modeled in bf16 only "
                          "(fla's kernels and megatron's compiled helpers were matched in bf16)",
                          "use train.precision=bf16 (auto), or measure it")
    if device == "cuda" and precision != "bf16" and backend == "sdpa":
        raise ConfigError("train.precision", "SDPA kernels other than cuDNN/flash (fp32) are not "
                          "modeled", "use train.precision=bf16 (auto), or attention=unfused")


def dims(cfg: dict, device: str = "auto", routed_share: float | Fraction = 1) -> Dims:
    """The per-rank sizes of ``cfg`` (validated, refused when not modeled). ``routed_share``: see
    ``Dims.routed_share``; forced to 1 without expert parallel (each rank computes every routed row)."""
    cfg = typed(cfg)
    device = _resolve_device(device)
    check_modeled(cfg, device)
    validate_for(cfg, device)

    par, t = cfg.parallel, cfg.train
    m = dataclasses.replace(cfg.model, bias_activation_fusion=resolve_swiglu_fusion(cfg.model, device == "cuda"))
    tp, cp = par.tensor_model_parallel_size, par.context_parallel_size
    s = t.seq_length // cp
    heads, h = m.num_attention_heads, m.hidden_size
    if ATTENTION_KIND[m.family] == "mla":
        dq, dv, groups = m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim, heads
        rope = m.qk_pos_emb_head_dim
    else:
        dq = dv = m.kv_channels or h // heads
        groups = m.num_query_groups or heads
        rope = dq if m.position_embedding_type == "rope" else 0
    e = 2 if device == "cuda" and t.precision in ("auto", "bf16") else 4
    return Dims(m.family, cfg.attention.backend, device, e, 1 if device == "cuda" else e,
                s, s // tp if par.sequence_parallel else s, t.micro_batch_size, h, tp,
                par.expert_model_parallel_size, heads // tp, groups // tp, dq, dv, rope, m,
                frozenset(labels_of(cfg)), cfg.recompute.recompute_granularity == "full",
                routed_share if par.expert_model_parallel_size > 1 else 1,
                mlp_replays_fc2(cfg))


# --- terms: (kind, what, bytes) for one layer, one micro-batch -------------------------------------
Term = tuple[str, str, int]


def norm_terms(d: Dims, name: str, rows: int, width: int, kind: str = "norm") -> list[Term]:
    """A norm keeps its input and fp32 statistics; the CPU's composite rms_norm also the normalized
    tensor. Its output is a new storage, counted where it is consumed."""
    x = d.e * rows * width
    if d.model.normalization == "LayerNorm":
        return [(kind, f"{name} input", x), (kind, f"{name} mean, rstd (fp32)", 8 * rows)]
    terms = [(kind, f"{name} input", x), (kind, f"{name} rstd (fp32)", 4 * rows)]
    if d.device == "cpu":
        terms.append((kind, f"{name} normalized (composite rms_norm)", x))
    return terms
