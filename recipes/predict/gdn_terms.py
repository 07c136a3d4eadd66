"""What a GatedDeltaNet layer (``model=gdn``) keeps for backward, term by term, counted as
``recipes.predict.activations`` counts an attention layer.

GatedDeltaNet layers (``model=gdn``, ``gdn_terms``) run other code on each device: fla-core 0.6.0's
Triton kernels and megatron's ``torch.compile``d helpers on CUDA, ``recipes.build.gdn``'s references on
the CPU (fla's naive chunked delta rule, autograd through plain ops); their terms are written per
device from that code, and the layer pattern (``is_gdn_layer``) says which layers they apply to.
"""

from __future__ import annotations

from recipes.predict.dims import Dims, Term, norm_terms
from recipes.recompute import gdn_pattern

#: fla's chunk size: the delta rule works on chunks of this many tokens (``chunk_size=64``).
GDN_CHUNK = 64


def is_gdn_layer(d: Dims, layer: int) -> bool:
    """Whether global layer ``layer`` (0-based) is a GatedDeltaNet layer: megatron's
    ``get_linear_attention_pattern`` makes every ``linear_attention_freq``-th layer attention."""
    return bool(gdn_pattern(d.model)[layer])


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
