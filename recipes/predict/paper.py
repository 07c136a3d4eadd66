"""Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Table 2.

Activation bytes per transformer layer with 16-bit activations, as the paper counts them (s sequence,
b micro-batch, h hidden, a heads, t tensor-parallel size):

    no parallelism            s b h (34 + 5 a s / h)
    tensor parallel           s b h (10 + 24 / t + 5 a s / (h t))
    tensor + sequence par.    s b h / t (34 + 5 a s / h)
    tensor par. + selective   s b h (10 + 24 / t)
    tensor + seq. + selective s b h 34 / t
    full recompute            2 s b h

``recipes.predict.estimate`` reproduces each line exactly under the paper's assumptions (``paper_config``:
LayerNorm, GELU MLP of 4h, multi-head attention, dropout on attention probabilities and both
residuals, softmax in 16 bits, no RoPE, unfused attention), apart from three tensors the paper does
not count and the estimator does: the LayerNorms' fp32 mean and rstd (8 bytes per token each, 16 s b
for the two), the causal mask (s^2 bools, one per layer here) and the 4-byte mask-type tensor the
``core_attn`` checkpoint keeps. One line is better in megatron-core than in the table: full recompute
with sequence parallelism keeps only the layer input's sequence shard, 2 s b h / t (the table's
2 s b h is the tensor-parallel-only value). ``tests/test_estimate.py`` checks all of it.

Where modern models depart (each a term in ``recipes.predict.estimate``; bytes per token of one layer in bf16
unless noted, f the FFN width, with the paper's 34 h for comparison):

- SwiGLU instead of GELU: FC1 writes 2f; SiLU output, the fresh ``x_linear + 0`` and the product
  are saved too: 10 f bytes (40 h at f = 4h) against GELU's 4 f (16 h).
- No dropout: no masks (2 h + a s per token) and no dropout output (2 a s) -- but with
  ``attention_softmax_in_fp32`` the fp32 softmax output and its bf16 copy cost 6 a s, not 2.
- RoPE: q and k are rotated into fresh tensors (the paper's 4 h becomes q + k copies plus the qkv
  output, which v is a view of); cos/sin tables are tiny.
- GQA: k and v are smaller, but unfused attention expands them to all heads (full-size copies).
- Fused attention (SDPA: cuDNN/flash): no s^2 terms at all; q, k, v, output and an fp32
  logsumexp (4 a bytes per token) remain. ``core_attn`` recompute then saves almost nothing.
- MLA: compressed q (q_lora) and kv (kv_lora + rope) latents, q/k of qk + rope width per head,
  v of v_head_dim; ``mla_up_proj`` drops the expanded q/k/v.
- MoE: every token is copied top-k times (h per copy) and each copy goes through the expert MLP
  (12 f_e per copy with SwiGLU: the activation is saved once more before the router probability
  multiplies it); router scores, indices and the dispatcher's maps add O(s b E) bytes.
- The loss: the vocab-parallel cross entropy keeps an fp32 softmax over the vocab shard,
  4 V / t bytes per token, on the last pipeline stage -- often the largest single tensor.
- RMSNorm keeps its input and an fp32 rstd (CUDA); the CPU composite also keeps the normalized tensor.
"""

from __future__ import annotations


def table2(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
           recompute: str = "none") -> float:
    """Activation bytes per layer from the paper's Table 2 (``recompute``: none, selective, full)."""
    if recompute == "full":
        return 2 * s * b * h
    if recompute not in ("none", "selective"):
        raise ValueError(f"recompute must be none, selective or full, not {recompute!r}")
    attention = 0 if recompute == "selective" else 5 * a * s / h
    if sequence_parallel:
        return s * b * h / t * (34 + attention)
    return s * b * h * (10 + 24 / t + attention / t)


def paper_config(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                 recompute: str = "none", dropout: float = 0.1) -> list[str]:
    """Hydra overrides for a dense model with the paper's assumptions (one layer per stage)."""
    option = {"none": "none", "selective": "selective/core_attn", "full": "full"}[recompute]
    return [
        "model=standard_attn", "attention=unfused", f"recompute={option}",
        "model.normalization=LayerNorm", "model.gated_linear_unit=false", "model.activation=gelu",
        "model.position_embedding_type=learned_absolute", "model.num_query_groups=null",
        f"model.hidden_dropout={dropout}", f"model.attention_dropout={dropout}",
        "model.attention_softmax_in_fp32=false", "model.num_layers=1", f"model.hidden_size={h}",
        f"model.ffn_hidden_size={4 * h}", f"model.num_attention_heads={a}", f"train.seq_length={s}",
        f"train.micro_batch_size={b}", f"parallel.tensor_model_parallel_size={t}",
        f"parallel.sequence_parallel={str(sequence_parallel).lower()}", f"launcher.nproc_per_node={t}",
    ]


#: Estimator terms the paper does not count (LayerNorm statistics, causal mask, checkpointed mask type).
UNCOUNTED = ("mean, rstd (fp32)", "causal mask (bool)", "mask type (int32)")


def paper_terms_bytes(layer_terms: list[tuple[str, str, int]]) -> tuple[int, int]:
    """(bytes the paper counts, bytes it does not) of one layer's estimator terms."""
    uncounted = sum(n for _, what, n in layer_terms if what.endswith(UNCOUNTED))
    return sum(n for _, _, n in layer_terms) - uncounted, uncounted
