"""The auto values of the model config that the estimator and the validator resolve as the run will,
without importing torch or megatron (a refusal answers before either loads). ``recipes.build.model``
uses the same functions when it builds the model."""

from __future__ import annotations


def resolve_precision(precision: str, on_gpu: bool) -> str:
    """``auto`` means bf16 on a GPU (what real runs use) and fp32 on a CPU (exact, fast enough)."""
    if precision == "auto":
        return "bf16" if on_gpu else "fp32"
    return precision


def resolve_swiglu_fusion(model: dict, on_gpu: bool) -> bool:
    """``model.bias_activation_fusion``: null (auto) is megatron's fused SwiGLU (``bias_swiglu_impl``,
    in the grouped experts ``weighted_bias_swiglu_impl``) on a GPU for a SwiGLU model, the one fusion
    megatron-core has without biases or Transformer Engine; off on a CPU, where its ``torch.compile``
    costs seconds per process and gains nothing. On the H200 it saves two of the five [tokens, ffn]
    tensors per MLP and 2.5 ms of elementwise kernels per dense step (docs/evidence/h200.md)."""
    fusion = model["bias_activation_fusion"]
    if fusion is None:
        return on_gpu and model["gated_linear_unit"] and model["activation"] == "silu"
    return bool(fusion)
