"""Parameters, gradients and optimizer state per pipeline rank: what a rank holds besides its activations."""

from __future__ import annotations

from recipes.build.resolve import resolve_precision
from recipes.config import typed
from recipes.recompute import ATTENTION_KIND, chunk_layers, gdn_pattern, moe_pattern


def num_parameters(cfg: dict, stage: int) -> tuple[int, int]:
    """(dense, expert) parameters held by pipeline rank ``stage`` (one tensor-parallel rank)."""
    cfg = typed(cfg)
    m, par = cfg.model, cfg.parallel
    tp, pp, ep = (par[k] for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                   "expert_model_parallel_size"))
    vpp = par.virtual_pipeline_model_parallel_size or 1
    h, heads, V = m.hidden_size, m.num_attention_heads, m.vocab_size
    norm = (2 if m.normalization == "LayerNorm" else 1)
    glu = 2 if m.gated_linear_unit else 1
    if ATTENTION_KIND[m.family] == "mla":
        dq, ql, kvl = m.qk_head_dim + m.qk_pos_emb_head_dim, m.q_lora_rank, m.kv_lora_rank
        q = (h * ql + ql * heads * dq) // tp if ql else h * heads * dq // tp
        attn = q + (h * (kvl + m.qk_pos_emb_head_dim) + kvl * heads * (m.qk_head_dim + m.v_head_dim)
                    + heads * m.v_head_dim * h) // tp
        attn += norm * ((ql or 0) + kvl) if m.qk_layernorm else 0
    else:
        d, groups = m.kv_channels or h // heads, m.num_query_groups or heads
        attn = (h * (heads + 2 * groups) * d + heads * d * h) // tp
        attn += 2 * norm * d if m.qk_layernorm else 0
    experts, moe_mlp = 0, 0
    if m.num_moe_experts:
        fe = m.moe_ffn_hidden_size or m.ffn_hidden_size
        fs = m.moe_shared_expert_intermediate_size or 0
        moe_mlp = m.num_moe_experts * h + (glu + 1) * h * fs // tp
        experts = m.num_moe_experts // ep * (glu + 1) * h * fe
    mlp = (glu + 1) * h * m.ffn_hidden_size // tp
    chunks = [v * pp + stage for v in range(vpp)]
    split = chunk_layers(m, par)
    mine = [i for c in chunks for i in split[c]]  # this rank's global layers
    layers = len(mine)
    num_moe = sum(moe_pattern(m)[i] for i in mine)
    num_gdn = sum(gdn_pattern(m)[i] for i in mine)  # GatedDeltaNet mixers in place of attention
    gdn = 0
    if num_gdn:
        nk, nv, dk, dv = (m[k] for k in ("linear_num_key_heads", "linear_num_value_heads",
                                         "linear_key_head_dim", "linear_value_head_dim"))
        conv = 2 * nk * dk + nv * dv  # in_proj, depthwise conv, dt_bias + A_log, out_proj; out_norm over dv
        gdn = (h * (conv + nv * dv + 2 * nv) + conv * m.linear_conv_kernel_dim + 2 * nv + nv * dv * h) // tp
        gdn += norm * dv
    dense = (layers * 2 * norm * h + (layers - num_moe) * mlp + num_moe * moe_mlp
             + (layers - num_gdn) * attn + num_gdn * gdn)
    if 0 in chunks:
        dense += V // tp * h + (cfg.train.seq_length * h if m.position_embedding_type ==
                                "learned_absolute" else 0)
    if pp * vpp - 1 in chunks:
        dense += norm * h + (V // tp * h if m.untie_embeddings_and_output_weights or pp > 1 else 0)
    return dense, num_moe * experts


def static_bytes(cfg: dict, device: str, stage: int = 0) -> dict[str, int]:
    """Parameters, gradients and optimizer state on pipeline rank ``stage``.

    GPU (``train.optimizer=auto``): megatron's DistributedOptimizer with bf16 params: bf16 params,
    fp32 gradient buffer (grad_reduce_in_fp32), fp32 main params + Adam m, v sharded over the
    data-parallel size (expert parameters over the expert-data-parallel size): 6 + 12/dp bytes each.
    CPU (or ``optimizer=adamw``): torch AdamW on the params: params, grads, m, v in the param dtype.
    """
    cfg = typed(cfg)
    par, launch = cfg.parallel, cfg.launcher
    world = launch.nproc_per_node * launch.nnodes
    tp, pp, cp, ep = (par[k] for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                       "context_parallel_size", "expert_model_parallel_size"))
    etp = par.expert_tensor_parallel_size or tp
    dp, edp = max(1, world // (tp * pp * cp)), max(1, world // (ep * etp * pp))
    dense, experts = num_parameters(cfg, stage)
    params = dense + experts
    p = 2 if resolve_precision(cfg.train.precision, device == "cuda") == "bf16" else 4
    if device == "cuda" and cfg.train.optimizer == "auto":
        main = 4 * (dense // dp + experts // edp) if p == 2 else 0
        return {"num_parameters": params, "params": p * params, "grads": 4 * params,
                "optimizer": main + 8 * (dense // dp + experts // edp)}
    return {"num_parameters": params, "params": p * params, "grads": p * params, "optimizer": 2 * p * params}
