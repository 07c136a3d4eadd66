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

from recipes.build import rope
from recipes.build.compat import device
from recipes.build.gdn import gdn_layer_spec
from recipes.build.resolve import resolve_precision, resolve_swiglu_fusion
from recipes.build.wgrad import enable as enable_wgrad_fusion
from recipes.build.wgrad import resolve_wgrad_fusion
from recipes.config import typed
from recipes.recompute import ATTENTION_KIND, MLP_KIND, layer_kinds, moe_pattern

#: Model fields that are ours or GPTModel arguments, not TransformerConfig fields.
NON_TRANSFORMER_FIELDS = {
    "family",
    "apply_rope_fusion",  # ours (recipes.build.rope); megatron's needs Transformer Engine
    "vocab_size",
    "position_embedding_type",
    "rotary_base",
    "untie_embeddings_and_output_weights",
    "experts",
    "activation",
    "compile",
}
#: MLATransformerConfig-only fields (passed only for MLA families: mla, mla_moe).
MLA_FIELDS = {"q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"}
#: MoE fields (passed only for MoE families: moe, mla_moe, gdn_moe).
MOE_PREFIX = "moe_"
#: GatedDeltaNet fields (passed only for gdn, gdn_moe, with experimental_attention_variant).
GDN_FIELDS = {"linear_attention_freq", "linear_conv_kernel_dim", "linear_key_head_dim",
              "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads"}
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu}
#: OffloadConfig fields that are ours, not TransformerConfig fields.
NON_TRANSFORMER_OFFLOAD_FIELDS = {"host_memory_gib", "emulate_on_cpu"}
#: ParallelConfig fields that are not ModelParallelConfig fields.
NON_MPC_PARALLEL_FIELDS: set[str] = set()
#: RecomputeConfig fields that are ours (``transformer_config_kwargs`` passes megatron's by name).
NON_TRANSFORMER_RECOMPUTE_FIELDS = {"mlp_replays_fc2"}


def resolve_rope_fusion(model: dict, on_gpu: bool) -> bool:
    """``model.apply_rope_fusion``: null (auto) is this project's fused RoPE (``recipes.build.rope``,
    bit-identical to megatron's unfused one) on a GPU for a RoPE model when Triton imports; off on a
    CPU, where the kernels do not run, and under ``model.compile`` (inductor fuses RoPE itself and was
    not measured with the kernels inside its graphs). megatron's own fusion (TransformerConfig's
    ``apply_rope_fusion``) needs Transformer Engine and stays off."""
    fusion = model["apply_rope_fusion"]
    if fusion is None:
        return (on_gpu and model["position_embedding_type"] == "rope" and model["compile"] == "none"
                and rope.triton_available())
    return bool(fusion)


def transformer_config_kwargs(cfg: Any, on_gpu: bool) -> dict:
    """The keyword arguments for megatron's config class, from the run config: its sections' fields by
    megatron's names (``dataclasses.asdict``: lists copied, never shared with the config)."""
    cfg = typed(cfg)
    model, par, rc = cfg.model, cfg.parallel, cfg.recompute
    attention, mlp = ATTENTION_KIND[model.family], MLP_KIND[model.family]
    kwargs = {
        k: v
        for k, v in dataclasses.asdict(model).items()
        if k not in NON_TRANSFORMER_FIELDS
        and (attention == "mla" or k not in MLA_FIELDS)
        and (mlp == "moe" or not k.startswith(MOE_PREFIX))
        and (attention == "gdn" or k not in GDN_FIELDS)
        and k != "num_moe_experts"
    }
    if mlp == "moe":
        kwargs["num_moe_experts"] = model.num_moe_experts
        kwargs["moe_layer_freq"] = moe_pattern(model)  # a per-layer list, whatever form the config used
        if model.moe_token_dispatcher_type == "local":
            # megatron's config knows allgather, alltoall and flex; our MoE layers replace allgather's
            # dispatcher with the local one (recipes.build.dispatch).
            kwargs["moe_token_dispatcher_type"] = "allgather"
    kwargs["activation_func"] = ACTIVATIONS[model.activation]
    kwargs["bias_activation_fusion"] = resolve_swiglu_fusion(model, on_gpu)
    kwargs.update({k: v for k, v in dataclasses.asdict(par).items() if k not in NON_MPC_PARALLEL_FIELDS})
    if par.expert_tensor_parallel_size is None:
        kwargs.pop("expert_tensor_parallel_size")
    kwargs.update(
        recompute_granularity=rc.recompute_granularity,
        # megatron defaults recompute_modules to ["core_attn"] when None; always pass a list.
        recompute_modules=list(rc.recompute_modules),
        recompute_method=rc.recompute_method,
        recompute_num_layers=rc.recompute_num_layers,
        distribute_saved_activations=rc.distribute_saved_activations,
    )
    kwargs.update({k: v for k, v in dataclasses.asdict(cfg.offload).items() if k not in NON_TRANSFORMER_OFFLOAD_FIELDS})
    precision = resolve_precision(cfg.train.precision, on_gpu)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    kwargs.update(
        bf16=precision == "bf16",
        params_dtype=dtype,
        pipeline_dtype=dtype,
        transformer_impl="transformer_engine" if cfg.attention.backend == "te" else "local",
        use_cpu_initialization=not on_gpu,
        gradient_accumulation_fusion=resolve_wgrad_fusion(model, on_gpu, megatron_optimizer(cfg, on_gpu)),
        masked_softmax_fusion=False,
        bias_dropout_fusion=on_gpu,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        deallocate_pipeline_outputs=True,
        variable_seq_lengths=False,
        batch_p2p_comm=on_gpu,  # batched p2p calls torch.cuda.synchronize; gloo uses isend/irecv
        # train.deterministic: megatron's deterministic code paths (the embedding's gradient by indexing, not
        # F.embedding's atomics); torch's half is recipes.run.world.use_deterministic
        deterministic_mode=bool(cfg.train.deterministic),
    )
    if attention == "mla":
        kwargs.update(multi_latent_attention=True, rope_type="rope", rotary_base=model.rotary_base)
    if attention == "gdn":
        kwargs.update(experimental_attention_variant="gated_delta_net")
    return kwargs


def build_transformer_config(cfg: Any, on_gpu: bool):
    """The single TransformerConfig (MLATransformerConfig for family=mla) of this run."""
    cfg = typed(cfg)
    # lazy: megatron takes seconds to import; tools that never build a model skip it
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    cls = MLATransformerConfig if ATTENTION_KIND[cfg.model.family] == "mla" else TransformerConfig
    kwargs = transformer_config_kwargs(cfg, on_gpu)
    if kwargs["gradient_accumulation_fusion"]:
        enable_wgrad_fusion()  # before megatron's linear layers check for Apex's kernel
    return cls(**kwargs)


def megatron_optimizer(cfg: Any, on_gpu: bool) -> bool:
    """Whether the run trains under megatron's DistributedOptimizer (fp32 ``main_grad`` buffers) rather
    than torch's AdamW (``train.optimizer``)."""
    cfg = typed(cfg)
    return on_gpu and cfg.train.optimizer == "auto"


def build_layer_spec(cfg: Any, config, vp_stage: int | None = None):
    """megatron's local layer spec with our core attention and (for MoE) our experts module.

    A model whose layers all have the same kind (standard or MLA attention, dense or MoE MLP) gets one
    layer spec, as megatron's own recipes do; a layer pattern (GatedDeltaNet hybrids, ``moe_layer_freq``
    with dense layers) gets this (virtual) pipeline stage's block, one spec per layer (``build_block_spec``).
    """
    cfg = typed(cfg)
    backend = cfg.attention.backend
    model = cfg.model
    attention = ATTENTION_KIND[model.family]
    kinds = layer_kinds(model)
    num_experts = model.num_moe_experts if MLP_KIND[model.family] == "moe" else None
    if backend == "te" and attention == "gdn":  # megatron's own hybrid spec (TE-only)
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_transformer_block_with_experimental_attention_variant_spec,
        )

        return with_dispatcher(cfg, get_transformer_block_with_experimental_attention_variant_spec(config, vp_stage))
    if backend == "te":
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_decoder_block_spec,
            get_gpt_layer_with_transformer_engine_spec,
        )

        if len(set(kinds)) > 1:  # moe_layer_freq with dense layers: megatron's block
            return with_dispatcher(cfg, get_gpt_decoder_block_spec(config, use_transformer_engine=True,
                                                                   vp_stage=vp_stage))
        return with_dispatcher(cfg, get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts,
            moe_grouped_gemm=model.moe_grouped_gemm,
            qk_layernorm=model.qk_layernorm,
            multi_latent_attention=attention == "mla",
        ))
    specs = {}
    for mixer, mlp in sorted(set(kinds)):
        spec = local_layer_spec(cfg, num_experts if mlp == "moe" else None)
        specs[(mixer, mlp)] = gdn_layer_spec(spec) if mixer == "gdn" else spec
    if len(specs) == 1 and attention != "gdn":
        return next(iter(specs.values()))
    return build_block_spec(config, [specs[k] for k in kinds], vp_stage)


def local_layer_spec(cfg: Any, num_experts: int | None):
    """One local (no Transformer Engine) layer: our core attention; for MoE (``num_experts``) our
    grouped experts unless ``model.experts=sequential``."""
    cfg = typed(cfg)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from recipes.build.attention import CORE_ATTENTION  # imports megatron: only when a model is built

    model = cfg.model
    spec = get_gpt_layer_local_spec(
        num_experts=num_experts,
        moe_grouped_gemm=model.moe_grouped_gemm,
        qk_layernorm=model.qk_layernorm,
        multi_latent_attention=ATTENTION_KIND[model.family] == "mla",
        normalization=model.normalization,
    )
    attn = spec.submodules.self_attention
    attn.submodules = dataclasses.replace(attn.submodules, core_attention=CORE_ATTENTION[cfg.attention.backend])
    if not num_experts and not cfg.recompute.mlp_replays_fc2:
        from recipes.build.mlp import use_replay_mlp  # imports megatron, as above

        spec = use_replay_mlp(spec)
    if num_experts and model.experts == "grouped":
        from recipes.build.experts import grouped_experts_builder  # imports megatron, as above

        moe = spec.submodules.mlp  # functools.partial(MoELayer, submodules=MoESubmodules(...))
        moe.keywords["submodules"] = dataclasses.replace(
            moe.keywords["submodules"], experts=grouped_experts_builder()
        )
    return with_dispatcher(cfg, spec)


def with_dispatcher(cfg: Any, spec):
    """``spec`` with the local token dispatcher in its MoE layers when the run asks for it
    (``model.moe_token_dispatcher_type=local``); megatron's dispatchers need nothing."""
    cfg = typed(cfg)
    if MLP_KIND[cfg.model.family] != "moe" or cfg.model.moe_token_dispatcher_type != "local":
        return spec
    from recipes.build.dispatch import use_local_dispatcher  # imports megatron, as above

    return use_local_dispatcher(spec)


def build_block_spec(config, layer_specs: list, vp_stage: int | None = None):
    """The block of this (virtual) pipeline stage from one spec per global layer (``layer_specs``,
    indexed as ``recipes.recompute.layer_kinds``): megatron's own layer offset and count per stage."""
    from megatron.core.transformer.transformer_block import (
        LayerNormImpl,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    # the final norm as megatron picks it for a single layer spec (transformer_block._get_block_submodules)
    return TransformerBlockSubmodules(layer_specs=layer_specs[offset:offset + num_layers], layer_norm=LayerNormImpl)


def build_model(cfg: Any, config) -> list[torch.nn.Module]:
    """GPTModel chunk(s) for this pipeline rank (one per virtual stage), on this process's device."""
    cfg = typed(cfg)
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    model_cfg = cfg.model
    vpp = cfg.parallel.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=build_layer_spec(cfg, config, stage),
            vocab_size=model_cfg.vocab_size,
            max_sequence_length=cfg.train.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            parallel_output=True,
            share_embeddings_and_output_weights=not model_cfg.untie_embeddings_and_output_weights,
            position_embedding_type=model_cfg.position_embedding_type,
            rotary_base=model_cfg.rotary_base,
            vp_stage=stage,
        )
        chunk = chunk.to(device())
        if config.bf16:
            # As Megatron-LM does: bf16 everywhere (torch norms are created in fp32 otherwise, which
            # upcasts activations and disables the fused RMSNorm), fp32 logits out of the last stage.
            from megatron.core.transformer.module import Float16Module

            chunk = Float16Module(config, chunk)
        chunks.append(chunk)
    if not cfg.recompute.mlp_replays_fc2:
        from recipes.build.mlp import replay_mlps

        replay_mlps(chunks)
    if resolve_rope_fusion(model_cfg, config.use_cpu_initialization is False):
        rope.install()
    else:
        rope.uninstall()
    compile_layers(chunks, model_cfg.compile)
    return chunks


def compile_layers(chunks: list[torch.nn.Module], scope: str) -> int:
    """``model.compile``: ``torch.compile`` each ``TransformerLayer``'s forward (``layer``) or its
    ``self_attention``'s (``attention``), in place, the per-block compile torchtitan applies; returns how
    many. Per layer, not the whole model: the pipeline schedule, the loss and megatron's hooks stay
    eager, and every layer of one kind shares one compiled graph."""
    if scope == "none":
        return 0
    import torch._dynamo
    from megatron.core.transformer.transformer_layer import TransformerLayer

    count = 0
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, TransformerLayer):
                target = module.self_attention if scope == "attention" else module
                target.forward = torch.compile(target.forward)
                count += 1
    # dynamo specializes each layer (its layer_number) and each grad mode (a recompute's replay): at
    # its default limit of 8 graphs per function, the 9th layer on would silently run eager
    limit = 2 * count + 8
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                           4 * limit)
    return count


def num_parameters(chunks: list[torch.nn.Module]) -> int:
    """Parameters held by this rank."""
    return sum(p.numel() for c in chunks for p in c.parameters())
