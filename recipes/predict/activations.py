"""What one transformer layer keeps for backward, term by term, in megatron-core's local spec.

Each term is a tensor autograd keeps for backward in megatron-core 0.19.2 with our core attention
(``recipes.build.attention``) and experts (``recipes.build.experts``), counted the way ``recipes.measure.ledger`` counts:
unique storages (a saved view counts its whole storage), parameters excluded, outputs discarded by
output-discarding checkpoints (``layernorm``, ``mla_up_proj``, ``moe_act``) counted as 0, tensors
freed before the forward ends (the aux loss's unused top-k values) not counted. The terms were read
off an instrumented ledger (every saved tensor's shape, dtype, op and module kind) for each family,
backend and label on the CPU (fp32) and on an H200 (bf16, torch 2.11), then written symbolically.

How each recompute label changes them: ``core_attn`` keeps q, k, v (+ a 4-byte mask-type tensor)
as checkpoint inputs and drops core attention's own tensors; ``mlp`` and ``moe`` keep their input
only; ``layernorm`` drops both norms' internals and outputs and keeps their inputs; ``mla_up_proj``
drops the expanded q, k, v wherever they are saved and keeps the compressed latents, k_pos_emb and
the rotary freqs; ``moe_act`` drops the expert activation output and keeps its input and the router
probs; ``shared_experts`` drops the shared experts' tensors (their input is the router's).

Device-dependent terms (``Dims.device``): RMSNorm is torch's fused kernel on CUDA (input + fp32
rstd) and a composite on CPU (also the normalized tensor); dropout masks are bool on CUDA and
input-dtype noise on CPU; SDPA is cuDNN/flash on CUDA (q, k, v, output, fp32 logsumexp, RNG seed and
offset) and on CPU flash, or the math path (scaled q/k copies, probabilities) with dropout or with
q/v head dims that differ (MLA). Where all this departs from Korthikanti et al. 2022: ``recipes.predict.paper``.

GatedDeltaNet layers (``model=gdn``, ``gdn_terms``) run other code on each device: fla-core 0.6.0's
Triton kernels and megatron's ``torch.compile``d helpers on CUDA, ``recipes.build.gdn``'s references on
the CPU (fla's naive chunked delta rule, autograd through plain ops); their terms are written per
device from that code, and the layer pattern (``is_gdn_layer``) says which layers they apply to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from recipes.build.model import resolve_precision, resolve_swiglu_fusion
from recipes.errors import ConfigError
from recipes.measure.flops import mlp_replays_fc2
from recipes.recompute import ATTENTION_KIND, FAMILIES, MLP_KIND, gdn_pattern, labels_of, moe_pattern
from recipes.validate import validate

#: fla's chunk size: the delta rule works on chunks of this many tokens (``chunk_size=64``).
GDN_CHUNK = 64


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
    model: dict
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
    machine with one GPU per local process (whatever this machine has); "auto" for this machine."""
    validate(cfg, num_gpus=0 if _resolve_device(device) == "cpu" else max(1, cfg["launcher"]["nproc_per_node"]),
             te_available=False)


def _resolve_device(device: str) -> str:
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cuda", "cpu"):
        raise ConfigError("--device", f"unknown device {device!r}", "use cuda, cpu or auto")
    return device


def check_modeled(cfg: dict, device: str) -> None:
    """Refuse, by name, what the estimator does not model (never estimate it as something else)."""
    m, par, backend = cfg["model"], cfg["parallel"], cfg["attention"]["backend"]
    if backend == "te":
        raise ConfigError("attention=te", "the estimator does not model Transformer Engine (its fused "
                          "attention and norm+linear modules save other tensors)",
                          "estimate attention=sdpa or attention=unfused")
    if m["family"] not in FAMILIES:
        raise ConfigError("model", f"family {m['family']!r} is not modeled by the estimator",
                          f"use model=<one of {', '.join(FAMILIES)}>")
    if backend not in ("sdpa", "unfused"):
        raise ConfigError("attention", f"unknown backend {backend!r}", "use attention=sdpa or unfused")
    refuse = [
        (m["normalization"] not in ("RMSNorm", "LayerNorm"), "model.normalization",
         f"{m['normalization']!r} is not modeled", "use RMSNorm or LayerNorm"),
        (m["position_embedding_type"] not in ("rope", "learned_absolute", "none"),
         "model.position_embedding_type", f"{m['position_embedding_type']!r} is not modeled",
         "use rope, learned_absolute or none"),
        (resolve_swiglu_fusion(m, device == "cuda") and not m["gated_linear_unit"], "model.bias_activation_fusion",
         "megatron's fused GELU needs biases, which this repository refuses", "set it false"),
        (par["context_parallel_size"] > 1, "parallel.context_parallel_size",
         "context parallel needs Transformer Engine attention, which is not modeled", "use 1"),
    ]
    if MLP_KIND[m["family"]] == "moe":
        refuse += [
            (m["moe_token_dispatcher_type"] not in ("allgather", "local"), "model.moe_token_dispatcher_type",
             f"the {m['moe_token_dispatcher_type']} dispatcher is not modeled", "use local or allgather"),
            (m["moe_expert_capacity_factor"] is not None, "model.moe_expert_capacity_factor",
             "token dropping is not modeled (the estimator routes every token to top-k experts)",
             "set model.moe_expert_capacity_factor=null"),
            (m["moe_router_load_balancing_type"] not in ("aux_loss", "none"),
             "model.moe_router_load_balancing_type",
             f"{m['moe_router_load_balancing_type']!r} is not modeled", "use aux_loss or none"),
            (m["moe_shared_expert_overlap"], "model.moe_shared_expert_overlap",
             "shared-expert overlap is not modeled", "set it false"),
            ((par["expert_tensor_parallel_size"] or par["tensor_model_parallel_size"]) > 1,
             "parallel.expert_tensor_parallel_size", "expert tensor parallel > 1 is not modeled "
             "(grouped experts refuse it)", "set parallel.expert_tensor_parallel_size=1"),
        ]
    if ATTENTION_KIND[m["family"]] == "gdn":  # what was matched against a ledger: TP 1; on CUDA RMSNorm in bf16
        refuse += [
            (par["tensor_model_parallel_size"] > 1, "parallel.tensor_model_parallel_size",
             "GatedDeltaNet layers under tensor parallel are not modeled (never measured: in_proj, "
             "conv and out_proj split by head, sequence-parallel gathers)", "estimate model=gdn with "
             "tensor_model_parallel_size=1, or measure it: python train.py model=gdn parallel=tp2"),
            (device == "cuda" and m["normalization"] != "RMSNorm", "model.normalization",
             f"GDN's gated output norm as {m['normalization']} on CUDA (inside a torch.compile'd helper) "
             "is not modeled: measured with RMSNorm only", "use model.normalization=RMSNorm, or measure it"),
        ]
    for bad, option, problem, fix in refuse:
        if bad:
            raise ConfigError(option, problem, fix)
    precision = resolve_precision(cfg["train"]["precision"], device == "cuda")
    if device == "cpu" and precision != "fp32":
        raise ConfigError("train.precision", "CPU runs are modeled in fp32 only", "use precision=auto")
    if ATTENTION_KIND[m["family"]] == "gdn" and device == "cuda" and precision != "bf16":
        raise ConfigError("train.precision", "GatedDeltaNet layers on CUDA are modeled in bf16 only "
                          "(fla's kernels and megatron's compiled helpers were matched in bf16)",
                          "use train.precision=bf16 (auto), or measure it")
    if device == "cuda" and precision != "bf16" and backend == "sdpa":
        raise ConfigError("train.precision", "SDPA kernels other than cuDNN/flash (fp32) are not "
                          "modeled", "use train.precision=bf16 (auto), or attention=unfused")


def dims(cfg: dict, device: str = "auto", routed_share: float | Fraction = 1) -> Dims:
    """The per-rank sizes of ``cfg`` (validated, refused when not modeled). ``routed_share``: see
    ``Dims.routed_share``; forced to 1 without expert parallel (each rank computes every routed row)."""
    device = _resolve_device(device)
    check_modeled(cfg, device)
    validate_for(cfg, device)

    par, t = cfg["parallel"], cfg["train"]
    m = dict(cfg["model"], bias_activation_fusion=resolve_swiglu_fusion(cfg["model"], device == "cuda"))
    tp, cp = par["tensor_model_parallel_size"], par["context_parallel_size"]
    s = t["seq_length"] // cp
    heads, h = m["num_attention_heads"], m["hidden_size"]
    if ATTENTION_KIND[m["family"]] == "mla":
        dq, dv, groups = m["qk_head_dim"] + m["qk_pos_emb_head_dim"], m["v_head_dim"], heads
        rope = m["qk_pos_emb_head_dim"]
    else:
        dq = dv = m["kv_channels"] or h // heads
        groups = m["num_query_groups"] or heads
        rope = dq if m["position_embedding_type"] == "rope" else 0
    e = 2 if device == "cuda" and t["precision"] in ("auto", "bf16") else 4
    return Dims(m["family"], cfg["attention"]["backend"], device, e, 1 if device == "cuda" else e,
                s, s // tp if par["sequence_parallel"] else s, t["micro_batch_size"], h, tp,
                par["expert_model_parallel_size"], heads // tp, groups // tp, dq, dv, rope, m,
                frozenset(labels_of(cfg)), cfg["recompute"]["recompute_granularity"] == "full",
                routed_share if par["expert_model_parallel_size"] > 1 else 1,
                mlp_replays_fc2(cfg))


# --- terms: (kind, what, bytes) for one layer, one micro-batch -------------------------------------
Term = tuple[str, str, int]


def norm_terms(d: Dims, name: str, rows: int, width: int, kind: str = "norm") -> list[Term]:
    """A norm keeps its input and fp32 statistics; the CPU's composite rms_norm also the normalized
    tensor. Its output is a new storage, counted where it is consumed."""
    x = d.e * rows * width
    if d.model["normalization"] == "LayerNorm":
        return [(kind, f"{name} input", x), (kind, f"{name} mean, rstd (fp32)", 8 * rows)]
    terms = [(kind, f"{name} input", x), (kind, f"{name} rstd (fp32)", 4 * rows)]
    if d.device == "cpu":
        terms.append((kind, f"{name} normalized (composite rms_norm)", x))
    return terms


def core_attention_terms(d: Dims, q: int, k: int, v_whole: int) -> tuple[list[Term], bool]:
    """Core attention's saved tensors, and whether the context it returns is a fresh copy (counted
    where linear_proj saves it) rather than a view of a storage already counted here. ``q``/``k``/
    ``v_whole`` are the storages of the tensors it is given (v is a view of ``v_whole``)."""
    sb, probs = d.s * d.b, d.b * d.np * d.s * d.s
    rep = d.np // d.ng
    kv_expanded = d.e * sb * d.np * d.dv
    dropout = d.model["attention_dropout"] > 0
    if d.backend == "sdpa":
        if d.device == "cuda":  # cuDNN / flash: inputs, output, fp32 logsumexp, Philox seed+offset
            return [("core_attn", "q", q), ("core_attn", "k", k), ("core_attn", "v", v_whole),
                    ("core_attn", "output", d.e * sb * d.np * d.dv),
                    ("core_attn", "logsumexp (fp32)", 4 * d.b * d.np * d.s),
                    ("core_attn", "rng seed, offset", 16)], False
        if not dropout and d.dq == d.dv:  # torch's CPU flash kernel
            return [("core_attn", "q", q), ("core_attn", "k", k), ("core_attn", "v", v_whole),
                    ("core_attn", "output", d.e * sb * d.np * d.dv),
                    ("core_attn", "logsumexp (fp32)", 4 * d.b * d.np * d.s)], False
        terms = [("core_attn", "scaled q (math path)", d.e * sb * d.np * d.dq),
                 ("core_attn", "scaled k (math path)", d.e * sb * d.np * d.dq),
                 ("core_attn", "probabilities", d.e * probs),
                 ("core_attn", "v", kv_expanded if rep > 1 else v_whole)]
        if dropout:
            terms += [("core_attn", "dropout mask", d.mask * probs),
                      ("core_attn", "dropout output", d.e * probs)]
        return terms, True
    fp32_softmax = d.model["attention_softmax_in_fp32"] and d.e < 4
    terms = [("core_attn", "q", q),
             ("core_attn", "k (GQA-expanded)" if rep > 1 else "k", kv_expanded if rep > 1 else k),
             ("core_attn", "v (GQA-expanded)" if rep > 1 else "v", kv_expanded if rep > 1 else v_whole),
             ("core_attn", "causal mask (bool)", d.s * d.s),
             ("core_attn", "softmax output" + (" (fp32)" if fp32_softmax else ""),
              (4 if fp32_softmax else d.e) * probs)]
    if dropout:
        terms += [("core_attn", "dropout mask", d.mask * probs),
                  ("core_attn", "dropout output", d.e * probs)]
    elif fp32_softmax:
        terms.append(("core_attn", "probabilities cast back", d.e * probs))
    return terms, True


def mla_projection_terms(d: Dims) -> list[Term]:
    """MLA's compressed q / kv, their optional norms, the up-projection inputs and RoPE.

    The down-projection outputs are full-sequence storages (under TP they are gathered over the
    hidden dim first): q_compressed (q_lora wide) and kv_combined (kv_lora + rope wide). Under
    sequence parallel (TP > 1) kv_compressed is scattered into a fresh sequence shard while
    q_compressed stays a view of the whole, and k_pos_emb always is a view of kv_combined.
    """
    m, e, L = d.model, d.e, d.labels
    rows, sb, q_lora, kv_lora = d.s_sp * d.b, d.s * d.b, m["q_lora_rank"], m["kv_lora_rank"]
    kv_whole = e * sb * (kv_lora + m["qk_pos_emb_head_dim"])
    kv_copy = d.tp > 1 and d.s_sp < d.s
    kvc = e * rows * kv_lora if kv_copy else kv_whole  # the storage kv_compressed lives in
    terms: list[Term] = []
    if q_lora and m["qk_layernorm"]:
        terms += [("norm", "q_layernorm input (q_down output)", e * sb * q_lora)]
        terms += norm_terms(d, "q_layernorm", rows, q_lora)[1:]
        terms.append(("attn_proj", "q_up input (q_layernorm output)", e * rows * q_lora))
    elif q_lora:
        terms.append(("attn_proj", "q_up input (q_down output)", e * sb * q_lora))
    if m["qk_layernorm"]:
        terms += [("norm", "kv_layernorm input (kv_compressed)", kvc)]
        terms += norm_terms(d, "kv_layernorm", rows, kv_lora)[1:]
        terms.append(("attn_proj", "kv_up input (kv_layernorm output)", e * rows * kv_lora))
    else:
        terms.append(("attn_proj", "kv_up input (kv_compressed)", kvc))
    if "mla_up_proj" in L:  # checkpoint inputs: the compressed tensors, k_pos_emb, rotary freqs
        terms.append(("attn_proj", "mla_up_proj checkpoint: rotary freqs (fp32)", 4 * d.s * d.rope))
        if kv_copy:
            terms.append(("attn_proj", "mla_up_proj checkpoint: k_pos_emb (kv_combined)", kv_whole))
    else:
        terms.append(("attn_proj", "RoPE cos, sin (q and k)", 4 * e * d.s * d.rope))
    return terms


def attention_terms(d: Dims) -> list[Term]:
    """Input norm, projections, RoPE and core attention of one layer (standard or MLA)."""
    L, sb, sb_sp, e = d.labels, d.s * d.b, d.s_sp * d.b, d.e
    ln = "layernorm" in L
    terms: list[Term] = [("other", "input norm checkpoint input", e * sb_sp * d.h)] if ln else (
        norm_terms(d, "input norm", sb_sp, d.h) + [("attn_proj", "qkv input (norm output)", e * sb_sp * d.h)])
    m = d.model
    if d.attention_kind == "mla":
        terms += mla_projection_terms(d)
        up = "mla_up_proj" in L
        q = k = 0 if up else e * sb * d.np * d.dq  # discarded outputs count 0
        v_whole = 0 if up else e * sb * d.np * d.dv
    else:
        qkv = e * sb * (d.np + 2 * d.ng) * d.dq  # linear_qkv output; v is a view of it
        q, k, v_whole = e * sb * d.np * d.dq, e * sb * d.ng * d.dq, qkv
        if not d.rope and not m["qk_layernorm"]:  # q, k stay views of the qkv output, except that
            q, k = (q if d.np > d.ng else 0), 0   # GQA's reshape of q to heads copies it
        if m["qk_layernorm"]:  # q is a reshaped copy; k a view of the qkv output, which it claims
            terms += norm_terms(d, "q_layernorm", sb * d.np, d.dq)
            terms += [("norm", "k_layernorm input (qkv output)", qkv)]
            terms += norm_terms(d, "k_layernorm", sb * d.ng, d.dq)[1:]
            v_whole = 0
        if d.rope:
            terms.append(("attn_proj", "RoPE cos, sin (q and k)", 4 * e * d.s * d.rope))
    if "core_attn" in L:
        terms += [("attn_proj", "core_attn checkpoint: q", q), ("attn_proj", "core_attn checkpoint: k", k),
                  ("attn_proj", "core_attn checkpoint: v", v_whole),
                  ("attn_proj", "core_attn checkpoint: mask type (int32)", 4),
                  ("attn_proj", "linear_proj input (context)", e * sb * d.np * d.dv)]
    else:
        core, copy = core_attention_terms(d, q, k, v_whole)
        terms += core
        if copy:
            terms.append(("attn_proj", "linear_proj input (context)", e * sb * d.np * d.dv))
    if m["hidden_dropout"] > 0:
        terms.append(("other", "attention residual dropout mask", d.mask * sb_sp * d.h))
    return terms


def activation_terms(d: Dims, ffn: int, tokens: int, kind: str = "mlp", what: str = "",
                     expert: bool = False) -> list[Term]:
    """FC1 output through FC2 input of a (dense, shared or expert) MLP on ``tokens`` rows."""
    fused, moe_act = d.model["bias_activation_fusion"], expert and "moe_act" in d.labels
    e, glu = d.e, d.model["gated_linear_unit"]
    fc1 = e * tokens * ffn * (2 if glu else 1)
    if moe_act:  # the activation's input stays (checkpoint input), its output is discarded
        return [(kind, f"{what}fc1 output (moe_act checkpoint input)", fc1)]
    out = e * tokens * ffn
    if fused:  # bias_swiglu: keeps its input, output goes to FC2
        return [(kind, f"{what}fc1 output (fused SwiGLU input)", fc1), (kind, f"{what}fc2 input", out)]
    terms = [(kind, f"{what}fc1 output", fc1)]
    if glu:  # act(x_glu) * (x_linear + offset) saves act(x_glu) and the fresh x_linear + offset
        terms += [(kind, f"{what}activation output", out), (kind, f"{what}x_linear + offset", out)]
    if expert:  # (activation * router prob) saves the activation once more
        terms.append((kind, f"{what}activation before the router prob", out))
    return terms + [(kind, f"{what}fc2 input", out)]


def mlp_terms(d: Dims, moe: bool | None = None) -> list[Term]:
    """Pre-MLP norm and the dense MLP (or, ``moe``, the MoE layer) of one layer; ``moe`` None: the
    family's MLP kind (every layer MoE in an MoE family)."""
    moe = MLP_KIND[d.family] == "moe" if moe is None else moe
    L, sb_sp, e, m = d.labels, d.s_sp * d.b, d.e, d.model
    ln = "layernorm" in L
    terms: list[Term] = [("other", "pre-MLP norm checkpoint input", e * sb_sp * d.h)] if ln else (
        norm_terms(d, "pre-MLP norm", sb_sp, d.h))
    norm_out = 0 if ln else e * sb_sp * d.h
    if moe:
        terms += moe_terms(d, norm_out)
    elif "mlp" in L:
        terms.append(("other" if d.mlp_replays_fc2 else "mlp", "mlp checkpoint input (norm output)", norm_out))
    else:
        terms.append(("mlp", "fc1 input (norm output)", norm_out))
        terms += activation_terms(d, m["ffn_hidden_size"] // d.tp, d.s * d.b)
    if m["hidden_dropout"] > 0:
        terms.append(("other", "MLP residual dropout mask", d.mask * sb_sp * d.h))
    return terms


def balanced_rows(d: Dims) -> int:
    """Rows routed to this rank's experts in one MoE layer under balanced routing: the gathered
    tokens (``T_all``: this rank's, times EP) x top-k x the local experts' share."""
    m = d.model
    E = m["num_moe_experts"]
    return d.s_sp * d.b * d.ep * m["moe_router_topk"] * (E // d.ep) // E


def routed_rows(d: Dims) -> int:
    """Rows routed to this rank's experts in one MoE layer: ``balanced_rows`` times
    ``d.routed_share``, at most every gathered token on each of ``min(k, E_local)`` local experts
    (dropless routing). Exact for EP 1 (share 1: every routed row is computed here)."""
    balanced = balanced_rows(d)
    if d.routed_share == 1:
        return balanced
    m = d.model
    cap = d.s_sp * d.b * d.ep * min(m["moe_router_topk"], m["num_moe_experts"] // d.ep)
    return min(math.ceil(d.routed_share * balanced), cap)


def moe_terms(d: Dims, norm_out: int) -> list[Term]:
    """Router, token dispatcher (local or allgather), experts and shared experts of one MoE layer.

    Under expert parallel only the per-routed-row terms follow the routing (``routed_rows``):
    permutation indices, the permuted expert input and probs, and the experts' activations. The
    router's tensors, the local routing map and local probs are per gathered token, balanced or not
    (two H200s, ``ep2``: the ranks' ledgers summed to twice the balanced prediction, byte for byte)."""
    m, e, L = d.model, d.e, d.labels
    if "moe" in L:
        return [("moe", "moe checkpoint input (norm output)", norm_out)]
    E, k, T = m["num_moe_experts"], m["moe_router_topk"], d.s_sp * d.b
    E_local = E // d.ep
    T_all = T * d.ep  # the dispatcher gathers tokens over expert-TP (1) x EP
    n = routed_rows(d)  # routed to local experts (exact for EP 1; under EP the share decides)
    ffn = m["moe_ffn_hidden_size"] or m["ffn_hidden_size"]
    terms: list[Term] = [("moe", "router input (norm output)", norm_out),
                         ("moe", "top-k indices (int64)", 8 * T * k),
                         ("moe", "top-k probs (fp32)", 4 * T * k)]
    if m["moe_aux_loss_coeff"] > 0 and m["moe_router_load_balancing_type"] == "aux_loss":
        terms += [("moe", "aux-loss scores (fp32)", 4 * T * E),
                  ("moe", "tokens per expert (int64)", 8 * E), ("moe", "aux loss", 4)]
    terms.append(("moe", "permutation indices (int64)", 8 * n))
    if m["moe_token_dispatcher_type"] == "local":  # probs gathered by index (recipes.build.dispatch)
        terms.append(("moe", "routed probs' gather indices (int64)", 8 * n))
    else:  # allgather: masked_select keeps its input and mask
        terms += [("moe", "local routing map (bool)", E_local * T_all),
                  ("moe", "local probs", e * E_local * T_all)]
    terms += [("moe", "expert fc1 input (permuted)", e * n * d.h), ("moe", "permuted probs", e * n)]
    terms += activation_terms(d, ffn, n, "moe", "expert ", expert=True)
    if d.device == "cuda" and m["experts"] == "grouped" and e == 2 and d.h % 8 == 0 and ffn % 8 == 0:
        terms.append(("moe", "grouped-GEMM offsets (int32)", 4 * E_local))
    shared = m["moe_shared_expert_intermediate_size"]
    if shared and "shared_experts" not in L:
        terms += activation_terms(d, shared // d.tp, d.s * d.b, "moe", "shared ")
    return terms


def is_gdn_layer(d: Dims, layer: int) -> bool:
    """Whether global layer ``layer`` (0-based) is a GatedDeltaNet layer: megatron's
    ``get_linear_attention_pattern`` makes every ``linear_attention_freq``-th layer attention."""
    return bool(gdn_pattern(d.model)[layer])


def is_moe_layer(d: Dims, layer: int) -> bool:
    """Whether global layer ``layer`` has an MoE MLP (megatron's ``moe_layer_freq``; dense otherwise)."""
    return bool(moe_pattern(d.model)[layer])


def gdn_terms(d: Dims) -> list[Term]:
    """Input norm and GatedDeltaNet mixer of one GDN layer (``recipes.build.gdn``'s local spec, TP 1).

    Shapes, from megatron's ``GatedDeltaNet`` (``ssm/gated_delta_net/``): ``in_proj`` makes q, k
    (nk key heads x dk), v, the gate z (nv value heads x dv) and beta, alpha (nv each); the causal
    conv runs over q, k, v; q, k are l2-normalized and repeated to the nv value heads; the delta rule
    returns o [b, s, nv, dv]; ``_apply_gated_norm`` (the layer's norm over dv, times SiLU(z)) feeds
    ``out_proj``. On both devices ``in_proj`` (``ColumnParallelLinear``) keeps its input, the input
    norm's output, and the conv its x, a view of the whole in_proj output (fla's
    ``CausalConv1dFunction`` does not make x contiguous; on the CPU ``F.conv1d`` keeps it);
    ``out_proj`` (``RowParallelLinear``) keeps the gated output, a transposed copy. On CUDA the
    compiled ``_apply_gated_norm`` keeps o, z and the fp32 rstd (AOTAutograd's partitioner, read off
    inductor's partition in bf16). ``gdn_norm_out`` (``CheckpointWithoutOutput``) keeps o and z as
    checkpoint inputs; the norm's tensors go and out_proj's input is discarded (0).
    """
    m, e, L = d.model, d.e, d.labels
    sb, sb_sp = d.s * d.b, d.s_sp * d.b
    nv, dv = m["linear_num_value_heads"], m["linear_value_head_dim"]
    in_dim = 2 * m["linear_num_key_heads"] * m["linear_key_head_dim"] + 2 * nv * dv + 2 * nv
    terms: list[Term] = [("other", "input norm checkpoint input", e * sb_sp * d.h)] if "layernorm" in L else (
        norm_terms(d, "input norm", sb_sp, d.h) + [("gdn", "in_proj input (norm output)", e * sb_sp * d.h)])
    terms.append(("gdn", "causal_conv1d x (a view of the whole in_proj output)", e * sb * in_dim))
    terms += fla_terms(d) if d.device == "cuda" else reference_terms(d)
    o = e * sb * nv * dv
    if "gdn_norm_out" in L:  # on the CPU o is a view of the delta rule's padded output
        terms += [("gdn", "gdn_norm_out checkpoint input: o",
                   o if d.device == "cuda" else e * d.b * nv * _padded(d.s) * dv),
                  ("gdn", "gdn_norm_out checkpoint input: gate z", o)]
    elif d.device == "cuda":  # compiled _apply_gated_norm: AOTAutograd's partitioner keeps x, z, rstd
        terms += [("gdn", "gated norm input o (compiled _apply_gated_norm)", o),
                  ("gdn", "gated norm rstd (fp32)", 4 * sb * nv), ("gdn", "gate z", o)]
    else:  # eager: the norm as on the CPU (of o reshaped: a copy), y * SiLU(z) keeps y and SiLU(z)
        terms += norm_terms(d, "gated norm", sb * nv, dv, "gdn")
        terms += [("gdn", "gate z (SiLU input)", o), ("gdn", "gated norm output y", o), ("gdn", "SiLU(z)", o)]
    terms.append(("gdn", "out_proj input (gated norm output)", 0 if "gdn_norm_out" in L else o))
    if m["hidden_dropout"] > 0:
        terms.append(("other", "mixer residual dropout mask", d.mask * sb_sp * d.h))
    return terms


def fla_terms(d: Dims) -> list[Term]:
    """q, k, v to the delta rule on CUDA: fla-core 0.6.0's Triton kernels, megatron's compiled helpers.

    - ``L2NormFunction`` (fla/modules/norm/l2norm.py, eager: ``torch.compile`` breaks the graph at
      its dispatched kernel) saves its output y (q, k of nk heads) and fp32 rstd per row;
    - megatron's compiled ``_compute_g_and_beta``: the partitioner keeps alpha (softplus is
      recomputed; A_log, dt_bias are parameters) and sigmoid's output beta;
    - ``ChunkGatedDeltaRuleFunction`` (fla/ops/gated_delta_rule/chunk.py) saves q, k (repeated to nv
      heads), v, beta (beta_raw is the same tensor), g (``chunk_local_cumsum``'s fp32 output) and A
      [b, s, nv, 64] in k's dtype (``chunk_gated_delta_rule_fwd_intra``); no initial state.
    """
    m, e, sb = d.model, d.e, d.s * d.b
    nk, nv, dk, dv = (m[k] for k in ("linear_num_key_heads", "linear_num_value_heads",
                                     "linear_key_head_dim", "linear_value_head_dim"))
    return [("gdn", "l2norm output: q, k (L2NormFunction)", e * sb * 2 * nk * dk),
            ("gdn", "l2norm rstd (fp32)", 4 * sb * 2 * nk),
            ("gdn", "alpha (compiled _compute_g_and_beta)", e * sb * nv),
            ("gdn", "q (repeated to the value heads)", e * sb * nv * dk),
            ("gdn", "k (repeated to the value heads)", e * sb * nv * dk),
            ("gdn", "v", e * sb * nv * dv),
            ("gdn", "beta (sigmoid output)", e * sb * nv),
            ("gdn", "g: chunk-local cumsum of the decay (fp32)", 4 * sb * nv),
            ("gdn", f"A: (I + A)^-1 per {GDN_CHUNK}-token chunk", e * sb * nv * GDN_CHUNK)]


def _padded(s: int) -> int:
    return -(-s // GDN_CHUNK) * GDN_CHUNK


def reference_terms(d: Dims) -> list[Term]:
    """The same on the CPU (fp32): ``recipes.build.gdn``'s references, megatron's helpers run eagerly.

    ``recipes.build.gdn.causal_conv1d``: SiLU keeps ``F.conv1d``'s output before the causal slice (s + W - 1
    long); ``recipes.build.gdn.l2norm``: pow and mul keep its input (a contiguous copy of q, k), mul the
    rsqrt; ``_compute_g_and_beta``: exp and mul keep exp(A_log) and -exp(A_log) ([nv] each, per layer),
    softplus and mul the softplus input (alpha + dt_bias) and output, sigmoid its output beta.
    fla's ``naive_chunk_gated_delta_rule`` (ops/gated_delta_rule/naive.py) transposes q, k, v, beta, g to [b, nv, l, .] with l the sequence padded to whole
    64-token chunks (n of them) and keeps, besides those: its [64, 64] decay masks, k_beta k^T, the
    row-by-row inverse (a clone of row i and of the i x i block for i = 1..63) and attn + I per chunk;
    per chunk of the state recurrence q k^T, the masked scores, v_new, three decay exps and the
    state S it reads (the zero state too). Chunks after the first also keep k_cumdecay and q times
    its decay (the first reads a state that needs no gradient). The last chunk's state update is
    dropped with the final state (``output_final_state=False``), except its exps: an op that saves
    its own output keeps it alive through the ledger's hooks.
    """
    m, e, b, s, C = d.model, d.e, d.b, d.s, GDN_CHUNK
    nk, nv, dk, dv = (m[k] for k in ("linear_num_key_heads", "linear_num_value_heads",
                                     "linear_key_head_dim", "linear_value_head_dim"))
    sb, bh, l = s * b, b * nv, _padded(s)
    n = l // C
    inverse = sum(i + i * i for i in range(1, C))
    conv_dim = 2 * nk * dk + nv * dv
    return [("gdn", "conv1d output before the causal slice (SiLU input)",
             e * b * conv_dim * (s + m["linear_conv_kernel_dim"] - 1)),
            ("gdn", "l2norm input: q, k (contiguous copy)", e * sb * 2 * nk * dk),
            ("gdn", "l2norm rsqrt", e * sb * 2 * nk),
            ("gdn", "exp(A_log), -exp(A_log)", 2 * e * nv),
            ("gdn", "softplus input, output", 2 * e * sb * nv),
            ("gdn", "beta (sigmoid output)", e * sb * nv),
            ("gdn", "delta rule: q * scale, k, v, beta (transposed, padded)", e * bh * l * (2 * dk + dv + 1)),
            ("gdn", "delta rule: v*beta, k_beta, k_beta*decay_exp, decay_exp",
             e * bh * l * (dv + 2 * dk + 1)),
            ("gdn", "delta rule: decay exp and mask, k_beta k^T, attn + I", 4 * e * bh * n * C * C),
            ("gdn", "delta rule: triangular masks (bool)", 2 * C * C),
            ("gdn", "delta rule: row-by-row inverse's clones", e * bh * n * inverse),
            ("gdn", "delta rule per chunk: q k^T, masked scores", 2 * e * bh * n * C * C),
            ("gdn", "delta rule per chunk: v_new, exp(decay) x3", e * bh * n * (C * dv + 2 * C + 1)),
            ("gdn", "delta rule per chunk: state S", e * bh * n * dk * dv),
            ("gdn", "delta rule, chunks 2..n: k_cumdecay, q * exp(decay)",
             e * bh * (l * dk + (n - 1) * C * dk) if n > 1 else 0),
            ("gdn", "delta rule, chunks 1..n-1: k * exp(decay_last - decay)", e * bh * (n - 1) * C * dk)]


def layer_terms(d: Dims, gdn: bool = False, moe: bool | None = None) -> list[Term]:
    """Everything one transformer layer keeps for backward (selective or no recompute); ``gdn``:
    a GatedDeltaNet layer (``is_gdn_layer``), else an attention layer; ``moe``: an MoE MLP
    (``is_moe_layer``), else dense (None: the family's kind)."""
    return (gdn_terms(d) if gdn else attention_terms(d)) + mlp_terms(d, moe)


def global_layer_terms(d: Dims, layer: int) -> list[Term]:
    """``layer_terms`` of global layer ``layer``, its kinds read off the model's layer pattern."""
    return layer_terms(d, is_gdn_layer(d, layer), is_moe_layer(d, layer))


def embedding_terms(d: Dims) -> list[Term]:
    """Token ids (masked copies under TP), position ids, embedding dropout mask."""
    sb = d.s * d.b
    terms: list[Term] = [("embedding", "token ids (int64)", 8 * sb)] if d.tp == 1 else [
        ("embedding", "masked token ids (int64)", 8 * sb), ("embedding", "vocab-range mask (bool)", sb)]
    if d.model["position_embedding_type"] == "learned_absolute":
        terms.append(("embedding", "position ids (int64)", 8 * sb))
    if d.model["hidden_dropout"] > 0:
        terms.append(("embedding", "embedding dropout mask", d.mask * d.s_sp * d.b * d.h))
    return terms


def head_terms(d: Dims) -> list[Term]:
    """Final norm, output layer input and the vocab-parallel cross entropy (fp32 softmax)."""
    sb, sb_sp = d.s * d.b, d.s_sp * d.b
    vocab = d.model["vocab_size"] // d.tp
    return norm_terms(d, "final norm", sb_sp, d.h) + [
        ("logits", "output layer input (final norm output)", d.e * sb_sp * d.h),
        ("logits", "softmax over the vocab shard (fp32)", 4 * sb * vocab),
        ("logits", "target mask (bool)", sb), ("logits", "masked targets (int64)", 8 * sb)]
