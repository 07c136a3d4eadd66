"""megatron's gradient-accumulation fusion without Apex: the weight gradient accumulated in fp32.

With ``gradient_accumulation_fusion`` megatron's linear layers (tensor_parallel/layers.py,
``LinearWithGradAccumulationAndAsyncCommunication.backward``) add each weight gradient into the
parameter's fp32 ``main_grad`` inside the GEMM, through Apex's ``fused_weight_gradient_mlp_cuda``
extension (``wgrad_gemm_accum_fp32``). Without Apex megatron refuses the option, and every linear of
every micro-batch writes a bf16 weight gradient that the data-parallel wrapper then adds into
``main_grad``: one more elementwise kernel a weight, reading 6 bytes and writing 4 a parameter.

torch's ``addmm`` with ``out_dtype`` (CUDA) is the same cuBLAS call Apex makes: bf16 operands, fp32
accumulator, ``beta=1`` onto ``main_grad``. ``FusedWeightGradient`` provides the extension's two
functions with it, and ``enable`` hands it to megatron's layers module. The gradient is the GEMM's
fp32 result added to ``main_grad``, not rounded to bf16 first: what megatron with Apex computes, and
not bit-identical to the unfused path.
"""

from __future__ import annotations

import torch


def _accumulate(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad += grad_output^T @ total_input`` (2-D operands, as megatron passes them)."""
    if main_grad.is_cuda:
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=main_grad.dtype, out=main_grad)
    else:  # CPU (tests): the same sum in main_grad's precision
        main_grad.addmm_(grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype))


class FusedWeightGradient:
    """Apex's ``fused_weight_gradient_mlp_cuda``, as megatron calls it."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor,
                              main_grad: torch.Tensor) -> None:
        _accumulate(total_input, grad_output, main_grad)

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor,
                              main_grad: torch.Tensor) -> None:
        _accumulate(total_input, grad_output, main_grad)


def enable() -> bool:
    """Let megatron's linear layers take ``gradient_accumulation_fusion=True``: its layers module gets
    ``FusedWeightGradient`` where Apex's extension is missing. False when Apex's own is there (nothing
    to do); True once ours is in place."""
    from megatron.core.tensor_parallel import layers

    if layers._grad_accum_fusion_available and not isinstance(
            getattr(layers, "fused_weight_gradient_mlp_cuda", None), FusedWeightGradient):
        return False  # Apex's kernel
    layers.fused_weight_gradient_mlp_cuda = FusedWeightGradient()
    layers._grad_accum_fusion_available = True
    return True


def resolve_wgrad_fusion(model: dict, on_gpu: bool, megatron_optimizer: bool) -> bool:
    """``model.gradient_accumulation_fusion``: null (auto) is on where there is an fp32 ``main_grad``
    to accumulate into (a GPU run under megatron's DistributedOptimizer)."""
    fusion = model["gradient_accumulation_fusion"]
    return (on_gpu and megatron_optimizer) if fusion is None else bool(fusion)
