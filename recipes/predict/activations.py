"""What one transformer layer keeps for backward, term by term, in megatron-core's local spec.

Each term is a tensor autograd keeps for backward in megatron-core 0.19.2 with our core attention
(``recipes.build.attention``) and experts (``recipes.build.experts``), counted the way ``recipes.measure.ledger`` counts:
unique storages (a saved view counts its whole storage), parameters excluded, outputs discarded by
output-discarding checkpoints (``layernorm``, ``mla_up_proj``, ``moe_act``) counted as 0, tensors
freed before the forward ends (the aux loss's unused top-k values) not counted. The terms were read
off an instrumented ledger (every saved tensor's shape, dtype, op and module kind) for each family,
backend and label on the CPU (fp32) and on an H200 (bf16, torch 2.11), then written symbolically.

How each recompute label changes them: a label whose record has ``Label.activations``
(``recipes.recompute``: ``mlp``, ``moe``, ``moe_act``, ``shared_experts``, and any new label) rewrites
the layer's terms after they are built (``layer_terms``). The rest change which storages their
neighbours' terms share, so the builders here read them: ``core_attn`` keeps q, k, v (+ a 4-byte
mask-type tensor) as checkpoint inputs and drops core attention's own tensors; ``layernorm`` drops both
norms' internals and outputs and keeps their inputs; ``mla_up_proj`` drops the expanded q, k, v
wherever they are saved and keeps the compressed latents, k_pos_emb and the rotary freqs;
``gdn_norm_out`` (``recipes.predict.gdn_terms``) keeps the norm's inputs.

Device-dependent terms (``Dims.device``): RMSNorm is torch's fused kernel on CUDA (input + fp32
rstd) and a composite on CPU (also the normalized tensor); dropout masks are bool on CUDA and
input-dtype noise on CPU; SDPA is cuDNN/flash on CUDA (q, k, v, output, fp32 logsumexp, RNG seed and
offset) and on CPU flash, or the math path (scaled q/k copies, probabilities) with dropout or with
q/v head dims that differ (MLA). Where all this departs from Korthikanti et al. 2022: ``recipes.predict.paper``.

The terms' shared pieces (the per-rank sizes ``Dims``, ``norm_terms``) are in ``recipes.predict.dims``;
GatedDeltaNet layers' (``model=gdn``) in ``recipes.predict.gdn_terms``.
"""

from __future__ import annotations

import math

from recipes.predict.dims import Dims, Term, norm_terms
from recipes.predict.gdn_terms import gdn_terms, is_gdn_layer
from recipes.recompute import LABELS, MLP_KIND, moe_pattern


def core_attention_terms(d: Dims, q: int, k: int, v_whole: int) -> tuple[list[Term], bool]:
    """Core attention's saved tensors, and whether the context it returns is a fresh copy (counted
    where linear_proj saves it) rather than a view of a storage already counted here. ``q``/``k``/
    ``v_whole`` are the storages of the tensors it is given (v is a view of ``v_whole``)."""
    sb, probs = d.s * d.b, d.b * d.np * d.s * d.s
    rep = d.np // d.ng
    kv_expanded = d.e * sb * d.np * d.dv
    dropout = d.model.attention_dropout > 0
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
    fp32_softmax = d.model.attention_softmax_in_fp32 and d.e < 4
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
    fused, e, glu = d.model.bias_activation_fusion, d.e, d.model.gated_linear_unit
    fc1 = e * tokens * ffn * (2 if glu else 1)
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
    m, e = d.model, d.e
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
    if shared:
        terms += activation_terms(d, shared // d.tp, d.s * d.b, "moe", "shared ")
    return terms


def is_moe_layer(d: Dims, layer: int) -> bool:
    """Whether global layer ``layer`` has an MoE MLP (megatron's ``moe_layer_freq``; dense otherwise)."""
    return bool(moe_pattern(d.model)[layer])


def layer_terms(d: Dims, gdn: bool = False, moe: bool | None = None) -> list[Term]:
    """Everything one transformer layer keeps for backward (selective or no recompute); ``gdn``:
    a GatedDeltaNet layer (``is_gdn_layer``), else an attention layer; ``moe``: an MoE MLP
    (``is_moe_layer``), else dense (None: the family's kind). A label with its own ``Label.activations``
    then discards its terms from the layer's."""
    terms = (gdn_terms(d) if gdn else attention_terms(d)) + mlp_terms(d, moe)
    moe = MLP_KIND[d.family] == "moe" if moe is None else moe
    kinds = ("gdn" if gdn else "mla" if d.attention_kind == "mla" else "standard", "moe" if moe else "dense")
    for label in sorted(d.labels):
        record = LABELS.get(label)
        if record is not None and record.activations is not None:
            terms = record.activations(d, kinds, terms)
    return terms


def global_layer_terms(d: Dims, layer: int) -> list[Term]:
    """``layer_terms`` of global layer ``layer``, its kinds read off the model's layer pattern."""
    return layer_terms(d, is_gdn_layer(d, layer), is_moe_layer(d, layer))


def embedding_terms(d: Dims) -> list[Term]:
    """Token ids (masked copies under TP), position ids, embedding dropout mask."""
    sb = d.s * d.b
    terms: list[Term] = [("embedding", "token ids (int64)", 8 * sb)] if d.tp == 1 else [
        ("embedding", "masked token ids (int64)", 8 * sb), ("embedding", "vocab-range mask (bool)", sb)]
    if d.model.position_embedding_type == "learned_absolute":
        terms.append(("embedding", "position ids (int64)", 8 * sb))
    if d.model.hidden_dropout > 0:
        terms.append(("embedding", "embedding dropout mask", d.mask * d.s_sp * d.b * d.h))
    return terms


def head_terms(d: Dims) -> list[Term]:
    """Final norm, output layer input and the vocab-parallel cross entropy (fp32 softmax)."""
    sb, sb_sp = d.s * d.b, d.s_sp * d.b
    vocab = d.model.vocab_size // d.tp
    return norm_terms(d, "final norm", sb_sp, d.h) + [
        ("logits", "output layer input (final norm output)", d.e * sb_sp * d.h),
        ("logits", "softmax over the vocab shard (fp32)", 4 * sb * vocab),
        ("logits", "target mask (bool)", sb), ("logits", "masked targets (int64)", 8 * sb)]
