"""Build the megatron-core model from the frozen run config.

``build_transformer_config`` is the one place a ``TransformerConfig`` (or ``MLATransformerConfig``)
is made; nothing mutates it afterwards. ``build_layer_spec`` starts from megatron's local spec and
swaps in the chosen core attention and experts; ``build_model`` makes the ``GPTModel`` chunk(s) for
this pipeline rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from recipes.build.compat import device
from recipes.build.gdn import build_gdn_block_spec

#: Model fields that are ours or GPTModel arguments, not TransformerConfig fields.
NON_TRANSFORMER_FIELDS = {
    "family",
    "vocab_size",
    "position_embedding_type",
    "rotary_base",
    "untie_embeddings_and_output_weights",
    "experts",
    "activation",
}
#: MLATransformerConfig-only fields (passed only for family=mla).
MLA_FIELDS = {"q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"}
#: MoE fields (passed only for family=moe).
MOE_PREFIX = "moe_"
#: GatedDeltaNet fields (passed only for family=gdn, with experimental_attention_variant).
GDN_FIELDS = {"linear_attention_freq", "linear_conv_kernel_dim", "linear_key_head_dim",
              "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads"}
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu}
#: ParallelConfig fields that are not ModelParallelConfig fields.
NON_MPC_PARALLEL_FIELDS: set[str] = set()


def resolve_precision(precision: str, on_gpu: bool) -> str:
    """``auto`` means bf16 on a GPU (what real runs use) and fp32 on a CPU (exact, fast enough)."""
    if precision == "auto":
        return "bf16" if on_gpu else "fp32"
    return precision


def transformer_config_kwargs(cfg: Any, on_gpu: bool) -> dict:
    """The keyword arguments for megatron's config class, from the run config (plain dict view)."""
    model, par, rc = cfg["model"], cfg["parallel"], cfg["recompute"]
    family = model["family"]
    kwargs = {
        k: v
        for k, v in model.items()
        if k not in NON_TRANSFORMER_FIELDS
        and (family == "mla" or k not in MLA_FIELDS)
        and (family == "moe" or not k.startswith(MOE_PREFIX))
        and (family == "gdn" or k not in GDN_FIELDS)
        and k != "num_moe_experts"
    }
    if family == "moe":
        kwargs["num_moe_experts"] = model["num_moe_experts"]
    kwargs["activation_func"] = ACTIVATIONS[model["activation"]]
    kwargs.update({k: v for k, v in par.items() if k not in NON_MPC_PARALLEL_FIELDS})
    if par["expert_tensor_parallel_size"] is None:
        kwargs.pop("expert_tensor_parallel_size")
    kwargs.update(
        recompute_granularity=rc["recompute_granularity"],
        # megatron defaults recompute_modules to ["core_attn"] when None; always pass a list.
        recompute_modules=list(rc["recompute_modules"]),
        recompute_method=rc["recompute_method"],
        recompute_num_layers=rc["recompute_num_layers"],
        distribute_saved_activations=rc["distribute_saved_activations"],
    )
    precision = resolve_precision(cfg["train"]["precision"], on_gpu)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    kwargs.update(
        bf16=precision == "bf16",
        params_dtype=dtype,
        pipeline_dtype=dtype,
        transformer_impl="transformer_engine" if cfg["attention"]["backend"] == "te" else "local",
        use_cpu_initialization=not on_gpu,
        gradient_accumulation_fusion=False,  # needs apex/TE
        masked_softmax_fusion=False,
        bias_dropout_fusion=on_gpu,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        deallocate_pipeline_outputs=True,
        variable_seq_lengths=False,
        batch_p2p_comm=on_gpu,  # batched p2p calls torch.cuda.synchronize; gloo uses isend/irecv
    )
    if family == "mla":
        kwargs.update(multi_latent_attention=True, rope_type="rope", rotary_base=model["rotary_base"])
    if family == "gdn":
        kwargs.update(experimental_attention_variant="gated_delta_net")
    return kwargs


def build_transformer_config(cfg: Any, on_gpu: bool):
    """The single TransformerConfig (MLATransformerConfig for family=mla) of this run."""
    # lazy: megatron takes seconds to import; tools that never build a model skip it
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    cls = MLATransformerConfig if cfg["model"]["family"] == "mla" else TransformerConfig
    return cls(**transformer_config_kwargs(cfg, on_gpu))


def build_layer_spec(cfg: Any, config, vp_stage: int | None = None):
    """megatron's local layer spec with our core attention and (for MoE) our experts module.

    For family=gdn: the hybrid block of this (virtual) pipeline stage, GatedDeltaNet layers mixed
    with that attention layer (``recipes.build.gdn``).
    """
    backend = cfg["attention"]["backend"]
    model = cfg["model"]
    num_experts = model["num_moe_experts"] if model["family"] == "moe" else None
    if backend == "te" and model["family"] == "gdn":  # megatron's own hybrid spec (TE-only)
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_transformer_block_with_experimental_attention_variant_spec,
        )

        return get_transformer_block_with_experimental_attention_variant_spec(config, vp_stage)
    if backend == "te":
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts,
            moe_grouped_gemm=model["moe_grouped_gemm"],
            qk_layernorm=model["qk_layernorm"],
            multi_latent_attention=model["family"] == "mla",
        )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from recipes.build.attention import CORE_ATTENTION  # imports megatron: only when a model is built

    spec = get_gpt_layer_local_spec(
        num_experts=num_experts,
        moe_grouped_gemm=model["moe_grouped_gemm"],
        qk_layernorm=model["qk_layernorm"],
        multi_latent_attention=model["family"] == "mla",
        normalization=model["normalization"],
    )
    attn = spec.submodules.self_attention
    attn.submodules = dataclasses.replace(attn.submodules, core_attention=CORE_ATTENTION[backend])
    if num_experts and model["experts"] == "grouped":
        from recipes.build.experts import grouped_experts_builder  # imports megatron, as above

        moe = spec.submodules.mlp  # functools.partial(MoELayer, submodules=MoESubmodules(...))
        moe.keywords["submodules"] = dataclasses.replace(
            moe.keywords["submodules"], experts=grouped_experts_builder()
        )
    if model["family"] == "gdn":
        return build_gdn_block_spec(config, spec, vp_stage)
    return spec


def build_model(cfg: Any, config) -> list[torch.nn.Module]:
    """GPTModel chunk(s) for this pipeline rank (one per virtual stage), on this process's device."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    model_cfg = cfg["model"]
    vpp = cfg["parallel"]["virtual_pipeline_model_parallel_size"]
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=build_layer_spec(cfg, config, stage),
            vocab_size=model_cfg["vocab_size"],
            max_sequence_length=cfg["train"]["seq_length"],
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            parallel_output=True,
            share_embeddings_and_output_weights=not model_cfg["untie_embeddings_and_output_weights"],
            position_embedding_type=model_cfg["position_embedding_type"],
            rotary_base=model_cfg["rotary_base"],
            vp_stage=stage,
        )
        chunk = chunk.to(device())
        if config.bf16:
            # As Megatron-LM does: bf16 everywhere (torch norms are created in fp32 otherwise, which
            # upcasts activations and disables the fused RMSNorm), fp32 logits out of the last stage.
            from megatron.core.transformer.module import Float16Module

            chunk = Float16Module(config, chunk)
        chunks.append(chunk)
    return chunks


def num_parameters(chunks: list[torch.nn.Module]) -> int:
    """Parameters held by this rank."""
    return sum(p.numel() for c in chunks for p in c.parameters())
