"""The model and its attention backend: families, normalizations, activations, fusions, heads, experts."""

from __future__ import annotations

from recipes.config import COMPILE_SCOPES, typed
from recipes.errors import check
from recipes.recompute import ATTENTION_KIND, BACKENDS, FAMILIES, MLP_KIND, layer_kinds


def check_model(cfg) -> None:
    cfg = typed(cfg)
    m = cfg.model
    check(m.family in FAMILIES, "model", f"unknown family {m.family!r}",
           f"use model=<one of {', '.join(FAMILIES)}>")
    check(not m.add_bias_linear, "model.add_bias_linear",
           "biases break megatron-core 0.19.2's selective mlp recompute (infinite recursion in "
           "backward) and MoE (in-place error, mlp.py:354)", "keep model.add_bias_linear=false")
    check(m.normalization in ("RMSNorm", "LayerNorm"), "model.normalization",
           f"unknown normalization {m.normalization!r}", "use model.normalization=RMSNorm or LayerNorm")
    check(m.activation in ("silu", "gelu"), "model.activation",
           f"unknown activation {m.activation!r}", "use model.activation=silu or gelu")
    check(not m.bias_activation_fusion or m.gated_linear_unit, "model.bias_activation_fusion",
           f"megatron's fused {m.activation} without a gated linear unit needs biases, which "
           "model.add_bias_linear=false leaves out (its MLP asserts)",
           "set model.bias_activation_fusion=null (auto: fused SwiGLU only) or false")
    check(not m.bias_activation_fusion or MLP_KIND[m.family] != "moe" or m.experts != "grouped"
           or m.activation == "silu", "model.bias_activation_fusion",
           f"the grouped experts fuse SwiGLU only, not gated {m.activation}",
           "set model.bias_activation_fusion=null (auto: fused SwiGLU only) or false")
    check(m.compile in COMPILE_SCOPES, "model.compile", f"unknown scope {m.compile!r}",
           f"use model.compile=<one of {', '.join(COMPILE_SCOPES)}>")
    check(m.compile != "layer" or MLP_KIND[m.family] != "moe", "model.compile",
           "a compiled MoE layer stops at a device-side assert in torch._grouped_mm on a GPU (torch 2.11, "
           "the H200 run in docs/speed.md)", "use model.compile=attention (the experts stay eager) or none")
    check(m.compile == "none" or ATTENTION_KIND[m.family] != "gdn", "model.compile",
           "the GatedDeltaNet layers' fla Triton kernels are not compiled or checked under torch.compile",
           "use model.compile=none with this family")
    heads, groups = m.num_attention_heads, m.num_query_groups or m.num_attention_heads
    check(heads % groups == 0, "model.num_query_groups",
           f"{heads} attention heads are not divisible into {groups} query groups",
           "pick num_query_groups dividing num_attention_heads")
    if m.kv_channels is None and ATTENTION_KIND[m.family] != "mla":
        check(m.hidden_size % heads == 0, "model.hidden_size",
               f"hidden_size {m.hidden_size} is not divisible by {heads} heads",
               "set model.kv_channels or a hidden size divisible by the head count")
    head_dim = m.kv_channels or m.hidden_size // heads
    if ATTENTION_KIND[m.family] == "mla":  # only the decoupled rope part of a head rotates
        check(m.qk_pos_emb_head_dim % 2 == 0, "model.qk_pos_emb_head_dim", f"{m.qk_pos_emb_head_dim} is odd: "
              "rotary embedding turns pairs of dimensions", "set model.qk_pos_emb_head_dim to an even number, e.g. 64")
    elif m.position_embedding_type == "rope":
        check(head_dim % 2 == 0, "model.kv_channels" if m.kv_channels else "model.hidden_size",
              f"a head of {head_dim} dimensions is odd: rotary embedding turns pairs of dimensions",
              "pick kv_channels (or hidden_size / num_attention_heads) even, e.g. model.kv_channels=64")
    layer_kinds(m)  # the layer pattern reads (moe_layer_freq, linear_attention_freq), or ConfigError
    if MLP_KIND[m.family] == "moe":
        check(bool(m.num_moe_experts), "model.num_moe_experts", f"model={m.family} needs experts",
               "set model.num_moe_experts (e.g. 8)")
        check(m.moe_router_topk <= m.num_moe_experts, "model.moe_router_topk",
               f"top-{m.moe_router_topk} of {m.num_moe_experts} experts",
               "use moe_router_topk <= num_moe_experts")
        check(m.experts in ("grouped", "sequential"), "model.experts",
               f"unknown experts module {m.experts!r}", "use model.experts=grouped or sequential")
        check(m.moe_token_dispatcher_type in ("local", "allgather", "alltoall"),
               "model.moe_token_dispatcher_type", f"{m.moe_token_dispatcher_type!r} is not "
               "supported here", "use local (expert parallel 1, no host syncs), allgather (any device "
               "and layout) or alltoall (GPU)")
        balancing = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "quantile_balancing", "none")
        check(m.moe_router_load_balancing_type in balancing, "model.moe_router_load_balancing_type",
               f"{m.moe_router_load_balancing_type!r} is not one of megatron's router load-balancing types "
               "(megatron would silently balance with none)", f"use one of {', '.join(balancing)}")
        factor = m.moe_expert_capacity_factor
        check(factor is None or factor > 0, "model.moe_expert_capacity_factor",
               f"{factor} is not a capacity (tokens per expert over the balanced share)",
               "use null (no token dropping) or a factor > 0, e.g. 1.25")
        check(factor is None or m.moe_token_dispatcher_type != "local", "model.moe_token_dispatcher_type",
               f"the local dispatcher needs every token routed to exactly top-k experts, but "
               f"model.moe_expert_capacity_factor={factor} drops tokens (their count is then known "
               "only on the device)", "use model.moe_token_dispatcher_type=allgather to drop tokens, "
               "or model.moe_expert_capacity_factor=null")
    if ATTENTION_KIND[m.family] == "gdn":
        freq = m.linear_attention_freq
        check(freq is not None and (not isinstance(freq, int) or freq >= 2), "model.linear_attention_freq",
               f"{freq} leaves no GatedDeltaNet layers (every N-th layer is standard attention)",
               "use model.linear_attention_freq=4 (3 GDN : 1 attention), or model=standard_attn")
        kh, vh = m.linear_num_key_heads, m.linear_num_value_heads
        check(vh % kh == 0, "model.linear_num_value_heads",
               f"{vh} GDN value heads are not a multiple of {kh} key heads",
               "pick linear_num_value_heads as a multiple of linear_num_key_heads")
        check(m.activation in ("silu", "swish"), "model.activation",
               f"megatron's GatedDeltaNet runs its causal conv with the model's activation, and fla's "
               f"kernel asserts SiLU on a GPU: {m.activation!r} would fail in the first forward",
               f"use model.activation=silu for model={m.family}")


def check_attention(cfg, te_available: bool) -> None:
    cfg = typed(cfg)
    backend = cfg.attention.backend
    check(backend in BACKENDS, "attention", f"unknown backend {backend!r}",
           f"use attention=<one of {', '.join(BACKENDS)}>")
    if backend == "te":
        check(te_available, "attention=te", "Transformer Engine is not installed (it does not "
               "import here)", "use attention=sdpa (flash/cuDNN through PyTorch) or attention=unfused")
