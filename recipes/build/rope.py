"""Fused rotary position embedding without Transformer Engine, bit-identical to megatron's unfused one.

megatron-core fuses RoPE only through Transformer Engine (``apply_rope_fusion`` asserts without it).
Its unfused path (``rope_utils._apply_rotary_pos_emb_bshd``) makes, for each of q and k, in every
layer: a negation, a ``cat`` for the rotated half, two broadcast multiplications, an addition and one
more ``cat`` (with the empty pass-through part), each a full pass over the tensor; backward as many.
On an H200 at the h200 size those kernels take several percent of a training step.

``fused_rotary_pos_emb`` does the same arithmetic in one Triton kernel each way. Every value is
rounded where eager rounds it: ``bf16(bf16(t*cos) + bf16(rotate_half(t)*sin))`` forward, and the
two gradient paths autograd takes (through ``t*cos`` and through the rotated half) rounded and added
the same way backward, so outputs and input gradients are bit-identical to megatron's
(``tests/test_rope.py``, on a CPU under Triton's interpreter). ``cos`` and ``sin`` are computed by the
same torch calls as megatron's and are the only tensors kept for backward, as eager's two
multiplications keep them: the activation ledger does not change.

Covered: the bshd layout (any strides, the last dimension contiguous), rotate-half and MLA's
interleaved input (``mla_rotary_interleaved``), any ``mscale``, a pass-through tail (rotary dims
fewer than the head dim). Anything else (``rotary_interleaved``, the packed thd layout, a tensor on
a CPU) takes megatron's unfused code. ``install`` swaps it in for the process
(``model.apply_rope_fusion``, ``recipes.build.model``).

Deterministic as it stands (``train.deterministic`` changes nothing here): each program writes its own
rows once, with no atomics and no sum across programs, and ``cos``/``sin`` take no gradient.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.cache
def _kernels(interpret: bool):
    """The forward and backward kernels; ``interpret``: a copy of them under Triton's CPU interpreter
    (the tests' way to run them without a GPU)."""
    if not interpret:
        from recipes.build import rope_kernels

        return rope_kernels.rope_fwd, rope_kernels.rope_bwd
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        path = os.path.join(os.path.dirname(__file__), "rope_kernels.py")
        spec = importlib.util.spec_from_file_location("recipes.build._rope_kernels_interpreted", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.rope_fwd, module.rope_bwd
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


def _launch(kernel, x: torch.Tensor, cos_: torch.Tensor, sin_: torch.Tensor, interleaved: bool) -> torch.Tensor:
    import triton

    S, B, H, D = x.shape
    rot = cos_.shape[-1]
    out = torch.empty((S, B, H, D), dtype=x.dtype, device=x.device)
    rows, half, tail = S * B * H, rot // 2, D - rot
    block_rows = max(1, min(64, 4096 // triton.next_power_of_2(max(half, tail, 1))))
    grid = (triton.cdiv(rows, block_rows),)
    kernel[grid](x, cos_, sin_, out, rows, B, H, x.stride(0), x.stride(1), x.stride(2), cos_.stride(0),
                 D=D, HALF=half, BLOCK_HALF=triton.next_power_of_2(half), PASS=tail,
                 BLOCK_PASS=triton.next_power_of_2(max(tail, 1)), INTERLEAVED=interleaved,
                 BLOCK_ROWS=block_rows)
    return out


class FusedRotaryPosEmb(torch.autograd.Function):
    """``t`` [s, b, h, d] with RoPE applied from ``cos_``/``sin_`` [s, 1, 1, rot] (t's dtype)."""

    @staticmethod
    def forward(ctx, t, cos_, sin_, interleaved: bool, interpret: bool):
        fwd, _ = _kernels(interpret)
        ctx.save_for_backward(cos_, sin_)
        ctx.interleaved, ctx.interpret = interleaved, interpret
        return _launch(fwd, t, cos_, sin_, interleaved)

    @staticmethod
    def backward(ctx, grad):
        cos_, sin_ = ctx.saved_tensors
        _, bwd = _kernels(ctx.interpret)
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        return _launch(bwd, grad, cos_, sin_, ctx.interleaved), None, None, None, None


def fusable(t: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool, interpret: bool = False) -> bool:
    """Whether ``fused_rotary_pos_emb`` covers this call (else megatron's unfused code runs)."""
    return (not rotary_interleaved and (t.is_cuda or interpret) and t.dim() == 4 and freqs.dim() == 4
            and t.stride(-1) == 1 and freqs.stride(-1) == 1
            and freqs.shape[1] == freqs.shape[2] == 1 and freqs.shape[0] == t.shape[0]
            and freqs.shape[-1] % 2 == 0 and freqs.shape[-1] <= t.shape[-1]
            and t.dtype == torch.bfloat16)  # the kernels round as bf16 does


def fused_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, mla_rotary_interleaved: bool = False,
                         mscale: float = 1.0, interpret: bool = False) -> torch.Tensor:
    """megatron's ``_apply_rotary_pos_emb_bshd`` (rotate-half) in one kernel each way."""
    # the same torch calls as megatron's, so cos_ and sin_ carry the same bits (x * 1.0 is x: two
    # kernels fewer per call at the usual mscale)
    cos_, sin_ = torch.cos(freqs), torch.sin(freqs)
    if mscale != 1.0:
        cos_, sin_ = cos_ * mscale, sin_ * mscale
    cos_, sin_ = cos_.to(t.dtype), sin_.to(t.dtype)
    return FusedRotaryPosEmb.apply(t, cos_, sin_, mla_rotary_interleaved, interpret)


_ORIGINAL: dict[str, object] = {}


def triton_available() -> bool:
    """Whether Triton imports (the kernels' compiler; torch's CUDA wheels bring it on Linux)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def install(interpret: bool = False) -> bool:
    """Route megatron's unfused bshd RoPE through ``fused_rotary_pos_emb`` where it applies, for the
    rest of the process (``uninstall`` restores it). False when Triton is missing. ``interpret``: on
    CPU tensors too, under Triton's interpreter (the tests' whole-model check)."""
    if not triton_available():
        return False
    from megatron.core.models.common.embeddings import rope_utils

    uninstall()  # installing again (another ``interpret``) wraps megatron's function, not the last wrapper
    original = _ORIGINAL["bshd"] = rope_utils._apply_rotary_pos_emb_bshd

    @functools.wraps(original)
    def apply_bshd(t, freqs, rotary_interleaved=False, mla_rotary_interleaved=False, mscale=1.0,
                   multi_latent_attention=None):
        if multi_latent_attention is None and fusable(t, freqs, rotary_interleaved, interpret):
            return fused_rotary_pos_emb(t, freqs, mla_rotary_interleaved, mscale, interpret)
        return original(t, freqs, rotary_interleaved=rotary_interleaved,
                        mla_rotary_interleaved=mla_rotary_interleaved, mscale=mscale,
                        multi_latent_attention=multi_latent_attention)

    rope_utils._apply_rotary_pos_emb_bshd = apply_bshd
    return True


def uninstall() -> None:
    """Put megatron's unfused RoPE back."""
    if "bshd" in _ORIGINAL:
        from megatron.core.models.common.embeddings import rope_utils

        rope_utils._apply_rotary_pos_emb_bshd = _ORIGINAL.pop("bshd")
