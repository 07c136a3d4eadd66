"""Matrix FLOPs of one training step, and what each recompute label replays.

Counted from the model shape (matmuls only; elementwise work is ignored). Causal attention counts
half of the s x s products, the work a causal kernel actually does. A training step is forward +
backward = 3x the forward; recompute adds the forward FLOPs of every replayed region ("hardware
FLOPs"). Model FLOPs (no replay) are what MFU is measured against.
"""

from __future__ import annotations

from typing import Any

from recipes.config import typed
from recipes.recompute import ATTENTION_KIND, LABELS, gdn_pattern, moe_pattern
from recipes.recompute import mlp_replays_fc2 as mlp_replays_fc2  # re-exported: recipes.predict.cost reads it here


def layer_forward_flops(cfg: Any) -> dict[str, float]:
    """Forward matmul FLOPs of one transformer layer for one micro-batch, by region.

    model=gdn mixes two kinds of layer, so this is its average layer: attention's regions weighted
    by the share of attention layers, the GatedDeltaNet mixers' work (``gdn_layer_forward_flops``)
    counted in ``attn_proj`` (no selective label replays it), the MLP in every layer. Summed over
    the layers it is the model's layer work, and a label's replay over it the model's replay
    fraction (what ``recipes.analyze.advise --predict`` ranks by)."""
    cfg = typed(cfg)
    layer = attention_layer_forward_flops(cfg)
    m = cfg.model
    if ATTENTION_KIND[m.family] != "gdn":
        return layer
    layers, num_gdn = m.num_layers, num_gdn_layers(cfg)
    share = (layers - num_gdn) / layers
    return {**layer, "attn_proj": share * layer["attn_proj"] + num_gdn * gdn_layer_forward_flops(cfg) / layers,
            "core_attn": share * layer["core_attn"]}


def num_gdn_layers(cfg: Any, first: int = 0, count: int | None = None) -> int:
    """GatedDeltaNet layers among layers ``first .. first + count - 1`` (all by default) of model=gdn:
    every ``linear_attention_freq``-th layer is attention (megatron's linear attention pattern)."""
    cfg = typed(cfg)
    m = cfg.model
    count = m.num_layers - first if count is None else count
    return sum(gdn_pattern(m)[first:first + count])


def attention_layer_forward_flops(cfg: Any) -> dict[str, float]:
    """Forward matmul FLOPs of one attention (standard, MLA or MoE) layer for one micro-batch, by region."""
    cfg = typed(cfg)
    m, t = cfg.model, cfg.train
    b, s, h = t.micro_batch_size, t.seq_length, m.hidden_size
    tokens = b * s
    heads = m.num_attention_heads
    glu = 2 if m.gated_linear_unit else 1
    out: dict[str, float] = {}
    if ATTENTION_KIND[m.family] == "mla":
        dq, dv = m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim
        if m.q_lora_rank:
            q_down = 2 * tokens * h * m.q_lora_rank
            q_up = 2 * tokens * m.q_lora_rank * heads * dq
        else:
            q_down, q_up = 0.0, 2 * tokens * h * heads * dq
        kv_down = 2 * tokens * h * (m.kv_lora_rank + m.qk_pos_emb_head_dim)
        kv_up = 2 * tokens * m.kv_lora_rank * heads * (m.qk_head_dim + dv)
        out["mla_up_proj"] = q_up + kv_up
        out["attn_proj"] = q_down + kv_down + q_up + kv_up + 2 * tokens * heads * dv * h
    else:
        d = m.kv_channels or h // heads
        dq = dv = d
        groups = m.num_query_groups or heads
        out["attn_proj"] = 2 * tokens * h * (heads + 2 * groups) * d + 2 * tokens * heads * d * h
    out["core_attn"] = 0.5 * 2 * b * heads * s * s * (dq + dv)  # causal: half of QK^T and PV
    moe_share = sum(moe_pattern(m)) / m.num_layers  # MoE layers' share (moe_layer_freq); 0 if dense
    if moe_share < 1:
        out["mlp"] = (1 - moe_share) * 2 * tokens * h * m.ffn_hidden_size * (glu + 1)
    if moe_share > 0:
        ffn = m.moe_ffn_hidden_size or m.ffn_hidden_size
        experts = m.moe_router_topk * 2 * tokens * h * ffn * (glu + 1)
        shared = 0.0
        if m.moe_shared_expert_intermediate_size:
            shared = 2 * tokens * h * m.moe_shared_expert_intermediate_size * (glu + 1)
        out["shared_experts"] = moe_share * shared
        out["moe"] = moe_share * (2 * tokens * h * m.num_moe_experts + experts + shared)
    return out


def output_projection_flops(cfg: Any) -> float:
    """Forward FLOPs of an attention layer's output projection (``linear_proj``) for one micro-batch:
    the part of ``attn_proj`` after core attention."""
    cfg = typed(cfg)
    m, t = cfg.model, cfg.train
    heads = m.num_attention_heads
    dv = m.v_head_dim if ATTENTION_KIND[m.family] == "mla" else m.kv_channels or m.hidden_size // heads
    return 2 * t.micro_batch_size * t.seq_length * heads * dv * m.hidden_size


def gdn_layer_forward_flops(cfg: Any) -> float:
    """Forward FLOPs of one GatedDeltaNet layer's mixer (family=gdn), in place of attention.

    Projections are exact: in_proj makes q, k (key heads x key dim), v and the output gate z
    (value heads x value dim) and the per-head beta/alpha; out_proj maps back. The delta rule is
    counted as three [key dim x value dim] products per token and value head (read the state with
    k, update it, read it with q): an approximation of the chunked kernel's work."""
    cfg = typed(cfg)
    m, t = cfg.model, cfg.train
    tokens, h = t.micro_batch_size * t.seq_length, m.hidden_size
    nk, nv = m.linear_num_key_heads, m.linear_num_value_heads
    dk, dv = m.linear_key_head_dim, m.linear_value_head_dim
    in_proj = 2 * tokens * h * (2 * nk * dk + 2 * nv * dv + 2 * nv)
    out_proj = 2 * tokens * nv * dv * h
    return in_proj + out_proj + 3 * 2 * tokens * nv * dk * dv


def step_flops(cfg: Any, num_microbatches: int) -> dict[str, float]:
    """Model and hardware FLOPs of one optimizer step across all ranks."""
    cfg = typed(cfg)
    m, t = cfg.model, cfg.train
    layer = layer_forward_flops(cfg)
    per_layer = layer["attn_proj"] + layer["core_attn"] + layer.get("mlp", 0.0) + layer.get("moe", 0.0)
    logits = 2 * t.micro_batch_size * t.seq_length * m.hidden_size * m.vocab_size
    layers = m.num_layers
    forward = layers * per_layer + logits
    replay = layers * replayed_layer_flops(cfg, layer, per_layer)
    dp = cfg.get("_data_parallel_size", 1)
    scale = num_microbatches * dp
    return {"model": 3 * forward * scale, "hardware": (3 * forward + replay) * scale}


def replayed_layer_flops(cfg: Any, layer: dict[str, float], per_layer: float) -> float:
    """Forward FLOPs one layer replays in backward under this run's recompute policy (for model=gdn
    the average layer, as ``layer_forward_flops``: the GDN layers replay only under full and mlp)."""
    cfg = typed(cfg)
    rc = cfg.recompute
    if rc.recompute_granularity == "full":
        if rc.recompute_method == "block":
            pp = cfg.parallel.pipeline_model_parallel_size
            per_stage = cfg.model.num_layers // pp
            k = min(rc.recompute_num_layers or 0, per_stage)
            if ATTENTION_KIND[cfg.model.family] == "gdn":  # the first k layers of each stage, GDN or attention
                attention = attention_layer_forward_flops(cfg)
                attn = attention["attn_proj"] + attention["core_attn"]
                gdn = sum(num_gdn_layers(cfg, stage * per_stage, k) for stage in range(pp))
                mixers = (pp * k - gdn) * attn + gdn * gdn_layer_forward_flops(cfg)
                mlp = layer.get("mlp", 0.0) + layer.get("moe", 0.0)  # per average layer
                return (mixers + pp * k * mlp) / cfg.model.num_layers
            return per_layer * k / per_stage
        return per_layer
    if rc.recompute_granularity != "selective":
        return 0.0
    # each label's region of the layer (``Label.flops``); the elementwise labels replay no matmul
    return sum(LABELS[label].replayed_flops(layer, cfg) for label in rc.recompute_modules if label in LABELS)
