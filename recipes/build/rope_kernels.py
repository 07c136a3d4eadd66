"""Triton kernels of ``recipes.build.rope`` (kept apart so the tests can load a copy under Triton's
CPU interpreter, which decides at decoration time)."""

import triton
import triton.language as tl


@triton.jit
def bf16(x):  # fp32 to the nearest bf16 (ties to even), kept in fp32: what eager's casts do,
    bits = x.to(tl.uint32, bitcast=True)  # spelled out so Triton's CPU interpreter (which
    bits = bits + ((bits >> 16) & 1) + 0x7FFF  # truncates) rounds as the GPU does
    return ((bits >> 16) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _rows(rows, B, H, st_s, st_b, st_h, D: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """This program's rows of [s, b, h]: their position s, strided source and contiguous destination
    offsets, and which exist."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    s = r // (B * H)
    bh = r % (B * H)
    return s, s * st_s + (bh // H) * st_b + (bh % H) * st_h, r * D, r < rows


@triton.jit
def _cos_sin(cos_ptr, sin_ptr, s, fs_s, j, ok, HALF: tl.constexpr):
    """cos and sin at positions ``s``, first and second half, in fp32."""
    f = s[:, None] * fs_s + j[None, :]
    return (tl.load(cos_ptr + f, mask=ok).to(tl.float32), tl.load(cos_ptr + f + HALF, mask=ok).to(tl.float32),
            tl.load(sin_ptr + f, mask=ok).to(tl.float32), tl.load(sin_ptr + f + HALF, mask=ok).to(tl.float32))


@triton.jit
def _halves(j, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Where the rotary part's two halves sit in the strided tensor: MLA de-interleaves it first
    (even dims, then odd)."""
    if INTERLEAVED:
        i1, i2 = 2 * j, 2 * j + 1
    else:
        i1, i2 = j, j + HALF
    return i1, i2


@triton.jit
def _copy_tail(src_ptr, dst_ptr, src, dst, row_ok, HALF: tl.constexpr, PASS: tl.constexpr,
               BLOCK_PASS: tl.constexpr):
    """The dims past the rotary part pass through unchanged (and so does their gradient)."""
    if PASS > 0:
        p = tl.arange(0, BLOCK_PASS)
        pok = row_ok[:, None] & (p < PASS)[None, :]
        x = tl.load(src_ptr + src[:, None] + (2 * HALF + p)[None, :], mask=pok)
        tl.store(dst_ptr + dst[:, None] + (2 * HALF + p)[None, :], x, mask=pok)


@triton.jit
def rope_fwd(t_ptr, cos_ptr, sin_ptr, out_ptr, rows, B, H, ts_s, ts_b, ts_h, fs_s,
             D: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
             PASS: tl.constexpr, BLOCK_PASS: tl.constexpr, INTERLEAVED: tl.constexpr,
             BLOCK_ROWS: tl.constexpr):
    s, src, dst, row_ok = _rows(rows, B, H, ts_s, ts_b, ts_h, D, BLOCK_ROWS)
    j = tl.arange(0, BLOCK_HALF)
    ok = row_ok[:, None] & (j < HALF)[None, :]
    i1, i2 = _halves(j, HALF, INTERLEAVED)
    x1 = tl.load(t_ptr + src[:, None] + i1[None, :], mask=ok).to(tl.float32)
    x2 = tl.load(t_ptr + src[:, None] + i2[None, :], mask=ok).to(tl.float32)
    c1, c2, s1, s2 = _cos_sin(cos_ptr, sin_ptr, s, fs_s, j, ok, HALF)
    dt = out_ptr.dtype.element_ty
    # eager: t * cos_ + cat(-x2, x1) * sin_, each product and the sum rounded to bf16
    o1 = bf16(bf16(x1 * c1) + bf16(-x2 * s1))
    o2 = bf16(bf16(x2 * c2) + bf16(x1 * s2))
    tl.store(out_ptr + dst[:, None] + j[None, :], o1.to(dt), mask=ok)
    tl.store(out_ptr + dst[:, None] + (j + HALF)[None, :], o2.to(dt), mask=ok)
    _copy_tail(t_ptr, out_ptr, src, dst, row_ok, HALF, PASS, BLOCK_PASS)


@triton.jit
def rope_bwd(g_ptr, cos_ptr, sin_ptr, dx_ptr, rows, B, H, gs_s, gs_b, gs_h, fs_s,
             D: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
             PASS: tl.constexpr, BLOCK_PASS: tl.constexpr, INTERLEAVED: tl.constexpr,
             BLOCK_ROWS: tl.constexpr):
    s, src, dst, row_ok = _rows(rows, B, H, gs_s, gs_b, gs_h, D, BLOCK_ROWS)
    j = tl.arange(0, BLOCK_HALF)
    ok = row_ok[:, None] & (j < HALF)[None, :]
    g1 = tl.load(g_ptr + src[:, None] + j[None, :], mask=ok).to(tl.float32)
    g2 = tl.load(g_ptr + src[:, None] + (j + HALF)[None, :], mask=ok).to(tl.float32)
    c1, c2, s1, s2 = _cos_sin(cos_ptr, sin_ptr, s, fs_s, j, ok, HALF)
    dt = dx_ptr.dtype.element_ty
    # autograd: g * cos_ (through t * cos_) plus the rotated half's gradient, g * sin_
    # moved back by cat's and neg's backward; each rounded, then added in bf16
    d1 = bf16(bf16(g1 * c1) + bf16(g2 * s2))
    d2 = bf16(bf16(g2 * c2) - bf16(g1 * s1))
    i1, i2 = _halves(j, HALF, INTERLEAVED)
    tl.store(dx_ptr + dst[:, None] + i1[None, :], d1.to(dt), mask=ok)
    tl.store(dx_ptr + dst[:, None] + i2[None, :], d2.to(dt), mask=ok)
    _copy_tail(g_ptr, dx_ptr, src, dst, row_ok, HALF, PASS, BLOCK_PASS)
