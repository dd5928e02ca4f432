"""Batch-1 matrix-vector products, y = W x, with the passes around them fused in.

One kernel serves every linear of a decode step; constexpr flags choose the fusions:
- NORM: RMSNorm of x folded in. y = rstd * W (x * g), and rstd is a scalar, so the sum of
  squares accumulates in the same loop that streams W; no separate pass, no normalised copy.
- SWIGLU: the gate and up projections of the same rows in one pass, silu(W_g x) * (W_u x);
  with GELU, gelu_tanh(W_g x) * (W_u x) (Gemma's GeGLU).
- ACCUMULATE: y is added to `out` (the fp32 residual stream) with atomics.
- A split along K (SPLIT_K programs per row block), for when N alone cannot fill the GPU. A
  plain accumulating product adds each split's partial sums straight into `out`. Any other
  product (REDUCE: one that stores, normalises or gates) adds them into fp32 partials
  (SplitPartials) with a count of the splits arrived per row block; the last split to arrive
  finishes the block (norm, activation, bias, store) and leaves partials and count at zero for
  the next launch. Either way the partial sums land in no fixed order: fp32 results are not
  bit-identical from run to run (differences of fp32 rounding).
- BIAS: y += b (Qwen2's q/k/v bias).
- SCALE: y *= s[row] (fp8 weights with one scale per output row; W is converted to fp32 as
  it is read).
- BLOCKS: each 32 weights along a row times their own scale (GGUF Q8_0 blocks: int8 weights,
  an fp16 scale per block, [N, K / 32]), applied to W's tile as it is read.
Each program owns BLOCK_N rows and one K-split; W is read once, in rows of BLOCK_K elements.

int4 weights (floorline.engine.quant.Int4Weight) and GGUF Q4_1 blocks (Q4_1Weight: the same
words, a minimum per group in place of the zero point) have a kernel of their own with the same
fusions, `_gemv_int4_kernel`, and fp8 weights a second one on the tensor cores,
`_gemv_fp8_dots_kernel` (GemvConfig.dots): see their docstrings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from floorline.engine.kernels.arrival import meet_in_partials
from floorline.engine.kernels.e4m3 import e4m3, row_powers, split_e4m3
from floorline.engine.kernels.launch import pdl_options
from floorline.engine.quant import BLOCK, Fp8Weight, Int4Words, Q4_1Weight, Q8_0Weight, dense


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int = 4
    split_k: int = 1
    num_stages: int = 3
    words: int = 1  # int4: consecutive word positions of a group that one thread holds
    dots: bool = False  # fp8: the tensor-core kernel (_gemv_fp8_dots_kernel)

    def fits(self, k: int) -> bool:
        # a split smaller than a block would leave programs with no work
        return self.split_k == 1 or k >= self.split_k * self.block_k


class SplitPartials:
    """Zeroed fp32 partial sums and int32 arrival counts where the K-splits of a product that
    does not simply accumulate meet (see the module docstring), one pair per product shape.
    Launches of one shape share it: each leaves it at zero, and a launch waits for the one
    before it to finish. Buffers are never freed or replaced, so that a CUDA graph that
    captured a launch keeps pointing at live memory."""

    def __init__(self):
        self._buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, n: int, blocks: int, device, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """For a product of `n` outputs per row of x in `blocks` blocks (`rows`: the rows
        product's padded rows of x, floorline.engine.kernels.rows)."""
        key = (n, blocks, rows, str(device))
        if key not in self._buffers:  # gate and up sums, then each block's sums of squares
            self._buffers[key] = (torch.zeros(rows * (2 * n + blocks), dtype=torch.float32,
                                              device=device),
                                  torch.zeros(blocks, dtype=torch.int32, device=device))
        return self._buffers[key]


@triton.jit
def _program(N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """This program's row block and K-split: their indices, its rows (and which are within N),
    its span of K [k_lo, k_hi) and its rows' offsets in W."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * span
    k_hi = tl.minimum(k_lo + span, K)
    return pid_n, pid_k, rows, row_ok, k_lo, k_hi, rows.to(tl.int64)[:, None] * K


@triton.jit
def _tile(w_ptr, row_base, row_ok, cols, k_hi, EVEN: tl.constexpr):
    """A matrix's tile of the program's rows at `cols` (EVEN: no masks; else zero past k_hi
    and N)."""
    if EVEN:
        return tl.load(w_ptr + row_base + cols[None, :])
    return tl.load(w_ptr + row_base + cols[None, :],
                   mask=row_ok[:, None] & (cols < k_hi)[None, :], other=0.0)


@triton.jit
def _scaled_blocks(w, s_ptr, rows, row_ok, k0, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   EVEN: tl.constexpr):
    """W's tile in fp32, each run of 32 along K times its block's scale (s [N, K / 32])."""
    G: tl.constexpr = BLOCK_K // 32
    g = k0 // 32 + tl.arange(0, G)
    at = rows.to(tl.int64)[:, None] * (K // 32) + g[None, :]
    if EVEN:
        s = tl.load(s_ptr + at)
    else:
        s = tl.load(s_ptr + at, mask=row_ok[:, None] & (g < K // 32)[None, :], other=0.0)
    s = tl.reshape(tl.broadcast_to(s.to(tl.float32)[:, :, None], (BLOCK_N, G, 32)),
                   (BLOCK_N, BLOCK_K))
    return w.to(tl.float32) * s


@triton.jit
def _block(x_ptr, w_ptr, norm_ptr, row_base, row_ok, cols, k_hi, squares, NORM: tl.constexpr,
           EVEN: tl.constexpr):
    """x's block at `cols` in fp32 and W's tile there; with NORM, x's squares added into
    `squares` and x times the norm's weight."""
    if EVEN:
        x = tl.load(x_ptr + cols).to(tl.float32)
    else:
        x = tl.load(x_ptr + cols, mask=cols < k_hi, other=0.0).to(tl.float32)
    w = _tile(w_ptr, row_base, row_ok, cols, k_hi, EVEN)
    if NORM:
        squares += x * x
        if EVEN:
            x *= tl.load(norm_ptr + cols).to(tl.float32)
        else:
            x *= tl.load(norm_ptr + cols, mask=cols < k_hi, other=0.0).to(tl.float32)
    return x, w, squares


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, up_ptr, bias_ptr, norm_ptr, scale_ptr, up_scale_ptr, out_ptr,
                 part_ptr, count_ptr, N, K, eps, NORM: tl.constexpr, SWIGLU: tl.constexpr,
                 BIAS: tl.constexpr, SCALE: tl.constexpr, GELU: tl.constexpr,
                 ACCUMULATE: tl.constexpr, REDUCE: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN: tl.constexpr,
                 PDL: tl.constexpr, BLOCKS: tl.constexpr):
    pid_n, pid_k, rows, row_ok, k_lo, k_hi, row_base = _program(N, K, BLOCK_N, BLOCK_K, SPLIT_K)
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    squares = tl.zeros((BLOCK_K,), tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x, w, squares = _block(x_ptr, w_ptr, norm_ptr, row_base, row_ok, cols, k_hi, squares,
                               NORM, EVEN)
        if BLOCKS:
            w = _scaled_blocks(w, scale_ptr, rows, row_ok, k0, K, BLOCK_N, BLOCK_K, EVEN)
        acc += w.to(tl.float32) * x[None, :]
        if SWIGLU:
            u = _tile(up_ptr, row_base, row_ok, cols, k_hi, EVEN)
            if BLOCKS:
                u = _scaled_blocks(u, up_scale_ptr, rows, row_ok, k0, K, BLOCK_N, BLOCK_K, EVEN)
            acc_up += u.to(tl.float32) * x[None, :]
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    y = tl.sum(acc, axis=1)
    y_up = tl.sum(acc_up, axis=1)
    if SCALE:
        y *= tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
        if SWIGLU:
            y_up *= tl.load(up_scale_ptr + rows, mask=row_ok, other=0.0)
    _epilogue(y, y_up, tl.sum(squares, axis=0), rows, row_ok, pid_n, pid_k, bias_ptr, out_ptr,
              part_ptr, count_ptr, N, K, eps, NORM, SWIGLU, BIAS, ACCUMULATE, GELU, REDUCE,
              SPLIT_K)


@triton.jit
def _gemv_fp8_dots_kernel(x_ptr, w_ptr, up_ptr, bias_ptr, norm_ptr, scale_ptr, up_scale_ptr,
                          out_ptr, part_ptr, count_ptr, N, K, eps, NORM: tl.constexpr,
                          SWIGLU: tl.constexpr, BIAS: tl.constexpr, GELU: tl.constexpr,
                          ACCUMULATE: tl.constexpr, REDUCE: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN: tl.constexpr,
                          PDL: tl.constexpr, EXACT: tl.constexpr):
    """fp8 weights on the tensor cores: W's [BLOCK_N, BLOCK_K] tile is the dot's A operand as
    loaded (no conversion; the summed dimension is contiguous, as 8-bit operands need), x its
    B operand: each block of x scaled by a power of two and cut into three e4m3 parts, x ~ hi
    + mid / 16 + lo / 256 (twelve significant bits: a bf16 x exactly, within e4m3's range),
    columns 0-2 of a [BLOCK_K, 16] tile whose other columns are zero. Each block's [BLOCK_N, 16]
    dot is unscaled into fp32 sums; the tiles stream through shared memory in Triton's software
    pipeline."""
    pid_n, pid_k, rows, row_ok, k_lo, k_hi, row_base = _program(N, K, BLOCK_N, BLOCK_K, SPLIT_K)
    j = tl.arange(0, 16)[:, None]  # x's columns in the dot: 0 hi, 1 mid, 2 lo
    fp8 = w_ptr.dtype.element_ty
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((BLOCK_N, 16), tl.float32)
    acc_up = tl.zeros((BLOCK_N, 16), tl.float32)
    squares = tl.zeros((BLOCK_K,), tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x, w, squares = _block(x_ptr, w_ptr, norm_ptr, row_base, row_ok, cols, k_hi, squares,
                               NORM, EVEN)
        up, down = row_powers(tl.max(tl.abs(x), axis=0))
        x *= up
        hi, mid = split_e4m3(x, fp8, EXACT)
        hi, mid = hi.to(tl.float32), mid.to(tl.float32)
        lo = e4m3(((x - hi) * 16.0 - mid) * 16.0, fp8, EXACT).to(tl.float32)
        xt = tl.trans(tl.where(j == 0, hi[None, :], tl.where(j == 1, mid[None, :],
                                                            tl.where(j == 2, lo[None, :], 0.0))
                               ).to(fp8))
        acc += tl.dot(w, xt) * down
        if SWIGLU:
            u = _tile(up_ptr, row_base, row_ok, cols, k_hi, EVEN)
            acc_up += tl.dot(u, xt) * down
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    c = tl.arange(0, 16)
    parts = tl.where(c < 3, tl.exp2(-4.0 * c.to(tl.float32)), 0.0)
    y = tl.sum(acc * parts[None, :], axis=1) * tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
    y_up = tl.sum(acc_up * parts[None, :], axis=1)
    if SWIGLU:
        y_up *= tl.load(up_scale_ptr + rows, mask=row_ok, other=0.0)
    _epilogue(y, y_up, tl.sum(squares, axis=0), rows, row_ok, pid_n, pid_k, bias_ptr, out_ptr,
              part_ptr, count_ptr, N, K, eps, NORM, SWIGLU, BIAS, ACCUMULATE, GELU, REDUCE,
              SPLIT_K)


@triton.jit
def _epilogue(y, y_up, sum_squares, rows, row_ok, pid_n, pid_k, bias_ptr, out_ptr, part_ptr,
              count_ptr, N, K, eps, NORM: tl.constexpr, SWIGLU: tl.constexpr,
              BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, GELU: tl.constexpr,
              REDUCE: tl.constexpr, SPLIT_K: tl.constexpr):
    """What every kernel here does with a block of dot products: finish it, or with REDUCE add
    it to the block's partials, and finish the block if this is the last of its splits to
    arrive."""
    if REDUCE:
        last, y, y_up, sum_squares = meet_in_partials(
            y, y_up, sum_squares, rows, row_ok, pid_n, part_ptr, part_ptr + N, part_ptr + 2 * N,
            count_ptr + pid_n, SWIGLU, NORM, SPLIT_K)
        if last:  # the block's sums are whole: finished as a first (and only) split would be
            _finish(y, y_up, sum_squares, rows, row_ok, 0, bias_ptr, out_ptr, K, eps, NORM,
                    SWIGLU, BIAS, ACCUMULATE, GELU)
    else:
        _finish(y, y_up, sum_squares, rows, row_ok, pid_k, bias_ptr, out_ptr, K, eps, NORM,
                SWIGLU, BIAS, ACCUMULATE, GELU)


@triton.jit
def _finish(y, y_up, sum_squares, rows, row_ok, pid_k, bias_ptr, out_ptr, K, eps,
            NORM: tl.constexpr, SWIGLU: tl.constexpr, BIAS: tl.constexpr,
            ACCUMULATE: tl.constexpr, GELU: tl.constexpr):
    """The rest of the fusions on split `pid_k`'s dot products. Only a plain accumulating
    product reaches here with a part of K; its bias goes in with the first split."""
    if NORM:  # whole: this program saw all of x, or the splits' squares were summed
        rstd = tl.rsqrt(sum_squares / K + eps)
        y *= rstd
        y_up *= rstd
    if SWIGLU and GELU:  # tanh-approximated GELU: 0.5 y (1 + tanh(u)) = y sigmoid(2u)
        y = y * tl.sigmoid(1.5957691216057308 * (y + 0.044715 * y * y * y)) * y_up
    elif SWIGLU:
        y = y * tl.sigmoid(y) * y_up
    if BIAS:
        b = tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        y += tl.where(pid_k == 0, b, 0.0)
    if ACCUMULATE:
        tl.atomic_add(out_ptr + rows, y, mask=row_ok, sem="relaxed")
    else:
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _load_x(x_ptr, norm_ptr, at, ok, NORM: tl.constexpr, EVEN: tl.constexpr):
    """x at `at` in fp32, times the norm's weight when NORM; and x's squares (for the norm)."""
    if EVEN:
        x = tl.load(x_ptr + at).to(tl.float32)
    else:
        x = tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32)
    squares = x * x
    if NORM:
        if EVEN:
            x *= tl.load(norm_ptr + at).to(tl.float32)
        else:
            x *= tl.load(norm_ptr + at, mask=ok, other=0.0).to(tl.float32)
    return x, squares


@triton.jit
def _load_int4(w_ptr, s_ptr, z_ptr, words_at, meta_at, ok, EVEN: tl.constexpr,
               MIN: tl.constexpr):
    """A tile of words, and scale (fp32) and zero point (int32) of their groups; with MIN the
    groups' minimums (fp32) in place of zero points."""
    if EVEN:
        words = tl.load(w_ptr + words_at)
        s = tl.load(s_ptr + meta_at)
        z = tl.load(z_ptr + meta_at)
    else:
        words = tl.load(w_ptr + words_at, mask=ok, other=0)
        s = tl.load(s_ptr + meta_at, mask=ok, other=0.0)
        z = tl.load(z_ptr + meta_at, mask=ok, other=0)
    # both returns in branches: Triton compiles the code after a return nested in an if
    if MIN:
        return words, s.to(tl.float32), z.to(tl.float32)
    else:
        return words, s.to(tl.float32), z.to(tl.int32)


@triton.jit
def _load_groups(w_ptr, s_ptr, z_ptr, up_ptr, up_s_ptr, up_z_ptr, words_base, meta_base, groups,
                 g_hi, block_ok, W: tl.constexpr, SWIGLU: tl.constexpr, EVEN: tl.constexpr,
                 MIN: tl.constexpr):
    """The gate's (or only) tile of `groups` and, with SWIGLU, the up matrix's (else the gate's
    again, unread)."""
    ok = (groups < g_hi) & block_ok
    words_at = words_base + groups * (W * 4)
    meta_at = meta_base + groups * 4
    words, s, z = _load_int4(w_ptr, s_ptr, z_ptr, words_at, meta_at, ok, EVEN, MIN)
    if SWIGLU:
        words_up, s_up, z_up = _load_int4(up_ptr, up_s_ptr, up_z_ptr, words_at, meta_at, ok, EVEN,
                                          MIN)
    else:
        words_up, s_up, z_up = words, s, z
    return words, s, z, words_up, s_up, z_up


@triton.jit
def _rounded(v):
    """v (|v| < 2^22) rounded to the nearest integer (ties to even), as int32: adding 1.5 * 2^23
    leaves the integer in the low bits of the float."""
    return (v + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000


@triton.jit
def _x_integers(x_ptr, norm_ptr, x_at, W: tl.constexpr, ok, squares, NORM: tl.constexpr,
                EVEN: tl.constexpr):
    """The group's eight runs of x at the tile's positions as integers: each chunk's x times the
    power of two that puts its largest |x| in [2^13, 2^14), rounded, so that they fit 16 bits
    whatever x's magnitude (the residual stream is normalised only after the product). Also
    that power's inverse, the integers' sum per position and the norm's squares."""
    x0, sq0 = _load_x(x_ptr, norm_ptr, x_at, ok, NORM, EVEN)
    x1, sq1 = _load_x(x_ptr, norm_ptr, x_at + W, ok, NORM, EVEN)
    x2, sq2 = _load_x(x_ptr, norm_ptr, x_at + 2 * W, ok, NORM, EVEN)
    x3, sq3 = _load_x(x_ptr, norm_ptr, x_at + 3 * W, ok, NORM, EVEN)
    x4, sq4 = _load_x(x_ptr, norm_ptr, x_at + 4 * W, ok, NORM, EVEN)
    x5, sq5 = _load_x(x_ptr, norm_ptr, x_at + 5 * W, ok, NORM, EVEN)
    x6, sq6 = _load_x(x_ptr, norm_ptr, x_at + 6 * W, ok, NORM, EVEN)
    x7, sq7 = _load_x(x_ptr, norm_ptr, x_at + 7 * W, ok, NORM, EVEN)
    if NORM:
        squares += ((sq0 + sq1) + (sq2 + sq3)) + ((sq4 + sq5) + (sq6 + sq7))
    big = tl.maximum(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)),
                                tl.maximum(tl.abs(x2), tl.abs(x3))),
                     tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)),
                                tl.maximum(tl.abs(x6), tl.abs(x7))))
    # the exponent field e of the chunk's largest |x| (at least 2^-100, so that both powers
    # below stay normal floats); scale = 2^(13 - e), unscale = 2^(e - 13), built from their bits
    e = tl.maximum(tl.expand_dims(tl.max(big, axis=3), 3).to(tl.int32, bitcast=True) & 0x7F800000,
                   27 << 23)
    scale = (((140 << 23) - e) + (127 << 23)).to(tl.float32, bitcast=True)  # 267 << 23 > int32
    unscale = (e - (13 << 23)).to(tl.float32, bitcast=True)
    i0, i1 = _rounded(x0 * scale), _rounded(x1 * scale)
    i2, i3 = _rounded(x2 * scale), _rounded(x3 * scale)
    i4, i5 = _rounded(x4 * scale), _rounded(x5 * scale)
    i6, i7 = _rounded(x6 * scale), _rounded(x7 * scale)
    i_sum = ((i0 + i1) + (i2 + i3)) + ((i4 + i5) + (i6 + i7))
    return i0, i1, i2, i3, i4, i5, i6, i7, unscale, i_sum, squares


@triton.jit
def _dots(words, i0, i1, i2, i3, i4, i5, i6, i7, ASM: tl.constexpr):
    """Per word, the sum over its nibbles j of q_j times x's integer i_j, exact in int32. On the
    GPU two integer dot-product instructions (dp2a) per four nibbles: the even nibbles masked
    into bytes 0..3, the odd ones shifted down and masked, each byte pair against two 16-bit
    integers packed in a register. The interpreter runs the same sum a nibble at a time."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 e, o;
            and.b32 e, $1, 0x0f0f0f0f;
            shr.u32 o, $1, 4;
            and.b32 o, o, 0x0f0f0f0f;
            dp2a.lo.s32.u32 $0, $2, e, 0;
            dp2a.hi.s32.u32 $0, $3, e, $0;
            dp2a.lo.s32.u32 $0, $4, o, $0;
            dp2a.hi.s32.u32 $0, $5, o, $0;
            }""",
            constraints="=r,r,r,r,r,r",
            args=[words, (i0 & 0xFFFF) | (i2 << 16), (i4 & 0xFFFF) | (i6 << 16),
                  (i1 & 0xFFFF) | (i3 << 16), (i5 & 0xFFFF) | (i7 << 16)],
            dtype=tl.int32, is_pure=True, pack=1)
    else:
        d = (words & 15) * i0 + ((words >> 4) & 15) * i1
        d += ((words >> 8) & 15) * i2 + ((words >> 12) & 15) * i3
        d += ((words >> 16) & 15) * i4 + ((words >> 20) & 15) * i5
        d += ((words >> 24) & 15) * i6 + ((words >> 28) & 15) * i7
        return d


@triton.jit
def _group_sums(d, unscale, s, z, i_sum, acc, MIN: tl.constexpr):
    """acc + s unscale sum (q - z) i per group and row, from the words' dots d
    ([GROUPS, CH, RB, WORDS, 4]: row 4b + r of block b), the chunk's unscale, scales and zero
    points ([GROUPS, 1, RB, 1, 4]) and the integers' sums; the sum of (q - z) i is exact. With
    MIN, z is the group's minimum m and the sum is unscale (s sum q i + m sum i): each sum exact
    in int32 and in fp32 (a chunk is at most 32 weights of q < 16 and |i| < 2^14)."""
    if MIN:
        dots = tl.sum(d, axis=3).to(tl.float32)
        sums = tl.sum(i_sum, axis=3).to(tl.float32)
        return acc + tl.sum(unscale, axis=3) * (tl.sum(s, axis=3) * dots
                                                + tl.sum(z, axis=3) * sums)
    else:
        exact = tl.sum(d, axis=3) - tl.sum(z, axis=3) * tl.sum(i_sum, axis=3)
        return acc + tl.sum(s, axis=3) * tl.sum(unscale, axis=3) * exact.to(tl.float32)


@triton.jit
def _tile_sums(x_ptr, norm_ptr, groups, g_ok, position, tile, acc, acc_up, squares,
               W: tl.constexpr, GROUP: tl.constexpr, NORM: tl.constexpr, SWIGLU: tl.constexpr,
               EVEN: tl.constexpr, ASM: tl.constexpr, MIN: tl.constexpr):
    """A loaded tile of `groups` (g_ok: those within the split) multiplied into the sums."""
    words, s, z, words_up, s_up, z_up = tile
    x_at = groups * GROUP + position  # [GROUPS, CH, 1, WORDS, 1]
    i0, i1, i2, i3, i4, i5, i6, i7, unscale, i_sum, squares = _x_integers(
        x_ptr, norm_ptr, x_at, W, g_ok, squares, NORM, EVEN)
    d = _dots(words, i0, i1, i2, i3, i4, i5, i6, i7, ASM)
    acc = _group_sums(d, unscale, s, z, i_sum, acc, MIN)
    if SWIGLU:
        d = _dots(words_up, i0, i1, i2, i3, i4, i5, i6, i7, ASM)
        acc_up = _group_sums(d, unscale, s_up, z_up, i_sum, acc_up, MIN)
    return acc, acc_up, squares


@triton.jit
def _gemv_int4_kernel(x_ptr, w_ptr, s_ptr, z_ptr, up_ptr, up_s_ptr, up_z_ptr, bias_ptr, norm_ptr,
                      out_ptr, part_ptr, count_ptr, N, K, K_WORDS, eps, NORM: tl.constexpr,
                      SWIGLU: tl.constexpr, BIAS: tl.constexpr, ACCUMULATE: tl.constexpr,
                      REDUCE: tl.constexpr, BLOCK_N: tl.constexpr,
                      GROUPS: tl.constexpr, GROUP: tl.constexpr, WORDS: tl.constexpr,
                      SPLIT_K: tl.constexpr, EVEN: tl.constexpr,
                      PDL: tl.constexpr, GELU: tl.constexpr, ASM: tl.constexpr,
                      MIN: tl.constexpr):
    """int4 weights in floorline.engine.quant's layout. A program owns BLOCK_N rows (RB =
    BLOCK_N / 4 blocks of four interleaved rows) and reads GROUPS groups of them per iteration
    as a [GROUPS, CH, RB, WORDS, 4] tile of words: the group's W = GROUP / 8 word positions in
    CH chunks of WORDS consecutive ones, four rows' words side by side. Triton spreads threads
    over the leading (group, chunk) dimensions, so each thread holds WORDS positions of all RB
    blocks: x is read once per thread for 4 * RB rows, and a group's scale and zero point once
    per WORDS words.

    Nibble j of a word belongs to x's run j of the group (k = g * GROUP + j * W + i). x enters
    as integers, scaled per chunk (_x_integers), so that the products and their sums over a
    group are exact integer arithmetic (_dots: two dp2a instructions per four weights);
    per group and row they go to fp32, where s unscale sum (q - z) i adds into the row's sum.
    K_WORDS is K / 8, an argument so that Triton sees its divisibility and loads 16 bytes at a
    time; EVEN: no masks (whole blocks and splits); ASM: the dots in PTX (_dots); MIN: GGUF Q4_1
    blocks, z_ptr the groups' fp16 minimums (W = s q + m) in place of zero points."""
    RB: tl.constexpr = BLOCK_N // 4
    W: tl.constexpr = GROUP // 8
    CH: tl.constexpr = W // WORDS
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    g_i = tl.arange(0, GROUPS)[:, None, None, None, None]
    position = (tl.arange(0, CH)[None, :, None, None, None] * WORDS
                + tl.arange(0, WORDS)[None, None, None, :, None])
    blocks = pid_n * RB + tl.arange(0, RB)[None, None, :, None, None]
    r = tl.arange(0, 4)[None, None, None, None, :]
    block_ok = blocks < N // 4
    n_groups = K // GROUP
    span = tl.cdiv(tl.cdiv(n_groups, SPLIT_K), GROUPS) * GROUPS
    g_lo = pid_k * span
    g_hi = tl.minimum(g_lo + span, n_groups)
    words_base = blocks.to(tl.int64) * (K_WORDS * 4) + position * 4 + r
    meta_base = blocks.to(tl.int64) * (n_groups * 4) + r
    acc = tl.zeros((GROUPS, CH, RB, 4), tl.float32)
    acc_up = tl.zeros((GROUPS, CH, RB, 4), tl.float32)
    squares = tl.zeros((GROUPS, CH, 1, WORDS, 1), tl.float32)
    # The first tile's weights are read before the wait for the kernel before this one (they
    # are not its output), so that their reads overlap its last programs; x is read after
    # (measured on the H200: notebook/2026-12-04-int4-kernel-genealogy.md).
    groups = g_lo + g_i
    tile = _load_groups(w_ptr, s_ptr, z_ptr, up_ptr, up_s_ptr, up_z_ptr, words_base, meta_base,
                        groups, g_hi, block_ok, W, SWIGLU, EVEN, MIN)
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc, acc_up, squares = _tile_sums(x_ptr, norm_ptr, groups, groups < g_hi, position, tile,
                                      acc, acc_up, squares, W, GROUP, NORM, SWIGLU, EVEN, ASM,
                                      MIN)
    for g0 in range(g_lo + GROUPS, g_hi, GROUPS):
        groups = g0 + g_i
        tile = _load_groups(w_ptr, s_ptr, z_ptr, up_ptr, up_s_ptr, up_z_ptr, words_base,
                            meta_base, groups, g_hi, block_ok, W, SWIGLU, EVEN, MIN)
        acc, acc_up, squares = _tile_sums(x_ptr, norm_ptr, groups, groups < g_hi, position,
                                          tile, acc, acc_up, squares, W, GROUP, NORM, SWIGLU,
                                          EVEN, ASM, MIN)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    y = tl.reshape(tl.sum(tl.sum(acc, axis=1), axis=0), (BLOCK_N,))
    y_up = tl.reshape(tl.sum(tl.sum(acc_up, axis=1), axis=0), (BLOCK_N,))
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    _epilogue(y, y_up, tl.sum(squares), rows, rows < N, pid_n, pid_k, bias_ptr, out_ptr,
              part_ptr, count_ptr, N, K, eps, NORM, SWIGLU, BIAS, ACCUMULATE, GELU, REDUCE,
              SPLIT_K)


ACTIVATIONS = ("silu", "gelu_tanh")  # of the gated product (`up`)


def meets_in_partials(config: GemvConfig, *, accumulate: bool = False, norm=None,
                      up=None) -> bool:
    """Whether a launch's K-splits meet in SplitPartials: all but a plain accumulating product,
    whose splits simply add into out."""
    return config.split_k > 1 and not (accumulate and norm is None and up is None)


def gemv(x, w, out, *, config: GemvConfig, norm=None, eps: float = 0.0, up=None, bias=None,
         accumulate: bool = False, act: str = "silu",
         partials: SplitPartials | None = None) -> None:
    """out = W x (or out += W x): see the module docstring for the fusions. W is a 16-bit
    tensor, an Fp8Weight, an Int4Weight or GGUF blocks (Q4_1Weight, Q8_0Weight; `up` in the
    same format); for int4 and Q4_1, block_k is the K elements a program reads per iteration,
    a power-of-two number of whole groups; for Q8_0 a multiple of its blocks of 32. `act` is
    the gate's activation where `up` is given. A K-split of a product that does not simply
    accumulate meets in `partials`."""
    n, k = w.shape
    if x.numel() != k or out.numel() != n:
        raise ValueError(f"W is {n}x{k}, x has {x.numel()} elements and out {out.numel()}")
    reduce = meets_in_partials(config, accumulate=accumulate, norm=norm, up=up)
    if reduce and partials is None:
        raise ValueError("a K-split of a product that stores, normalises or gates needs "
                         "partials (SplitPartials) where its splits meet")
    if up is not None and bias is not None:
        raise ValueError("SWIGLU takes no bias")
    if up is not None and type(up) is not type(w):
        raise ValueError("SWIGLU's gate and up matrices must share a format")
    if accumulate and out.dtype != torch.float32:
        raise ValueError("accumulate adds into an fp32 residual stream")
    if act not in ACTIVATIONS:
        raise ValueError(f"activation '{act}' is not one of {', '.join(ACTIVATIONS)}")
    flags = dict(NORM=norm is not None, SWIGLU=up is not None, BIAS=bias is not None,
                 GELU=act == "gelu_tanh", ACCUMULATE=accumulate, REDUCE=reduce,
                 BLOCK_N=config.block_n, SPLIT_K=config.split_k,
                 num_warps=config.num_warps, num_stages=config.num_stages)
    grid = (triton.cdiv(n, config.block_n), config.split_k)
    sums, counts = (partials.get(n, grid[0], out.device) if reduce
                    else (out, out))  # unread without REDUCE
    if config.dots and not isinstance(w, Fp8Weight):
        raise ValueError("dots: the tensor-core GEMV takes fp8 weights only")
    if isinstance(w, Int4Words):
        groups = config.block_k // w.group_size
        if groups < 1 or groups & (groups - 1) or config.block_k % w.group_size:
            raise ValueError(f"block_k {config.block_k} is not a power-of-two number of groups "
                             f"of {w.group_size}")
        if config.block_n % 4:
            raise ValueError(f"block_n {config.block_n}: int4 rows come in blocks of four")
        positions = w.group_size // 8
        if positions % config.words or config.words & (config.words - 1):
            raise ValueError(f"words {config.words}: a power of two that divides a group's "
                             f"{positions} word positions")
        u = w if up is None else up
        minimum = isinstance(w, Q4_1Weight)
        zeros, up_zeros = (w.mins, u.mins) if minimum else (w.zeros, u.zeros)
        even = n % config.block_n == 0 and (k // w.group_size) % (config.split_k * groups) == 0
        _gemv_int4_kernel[grid](
            x, w.qweight, w.scales, zeros, u.qweight, u.scales, up_zeros,
            w.scales if bias is None else bias, w.scales if norm is None else norm, out, sums,
            counts, n, k, k // 8, eps, GROUPS=groups, GROUP=w.group_size,
            WORDS=config.words, EVEN=even, ASM=x.is_cuda, MIN=minimum, **flags,
            **pdl_options(x))
        return
    scale = up_scale = None
    even = n % config.block_n == 0 and k % (config.split_k * config.block_k) == 0
    if config.dots:  # fp8, as checked above
        if config.block_n < 16 or config.block_k < 32:
            raise ValueError(f"block_n {config.block_n} and block_k {config.block_k}: the tensor "
                             "cores' fp8 tiles are at least 16 x 32")
        u = w if up is None else up
        _gemv_fp8_dots_kernel[grid](
            x, w.weight, u.weight, w.scale if bias is None else bias,
            w.scale if norm is None else norm, w.scale, u.scale, out, sums, counts, n, k, eps,
            BLOCK_K=config.block_k, EVEN=even, EXACT=not x.is_cuda, **flags, **pdl_options(x))
        return
    blocks = isinstance(w, Q8_0Weight)
    if blocks and config.block_k % BLOCK:
        raise ValueError(f"block_k {config.block_k}: Q8_0 tiles hold whole blocks of {BLOCK}")
    if isinstance(w, (Fp8Weight, Q8_0Weight)):
        w, scale = (w.weight, w.scale) if isinstance(w, Fp8Weight) else (w.qweight, w.scales)
        if up is not None:
            up, up_scale = (up.weight, up.scale) if isinstance(up, Fp8Weight) else (up.qweight,
                                                                                   up.scales)
    _gemv_kernel[grid](
        x, w, w if up is None else up, w if bias is None else bias, w if norm is None else norm,
        w if scale is None else scale, w if up_scale is None else up_scale, out, sums, counts,
        n, k, eps, SCALE=scale is not None and not blocks, BLOCKS=blocks,
        BLOCK_K=config.block_k, EVEN=even, **flags, **pdl_options(x))


def gemv_reference(x, w, out, *, config=None, norm=None, eps: float = 0.0, up=None, bias=None,
                   accumulate: bool = False, act: str = "silu", multiply=None) -> None:
    """The same contract in plain PyTorch: fp32 arithmetic, the kernel's rounding points, and a
    quantised W dequantised to fp32 first (floorline.engine.quant). x may also be [m, K] rows
    (out [m, N]), each normalised on its own. `multiply(xf, W)`, where given, makes each product
    of the fp32 x with W instead (the CPU step's kernel, reading a quantised W as stored)."""
    xf = x.float()
    if norm is not None:
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * norm.float()

    def product(matrix):
        if multiply is not None:
            return multiply(xf, matrix)
        matrix = dense(matrix)
        return matrix @ xf if xf.dim() == 1 else xf @ matrix.T
    y = product(w)
    if up is not None:
        gate = (torch.nn.functional.gelu(y, approximate="tanh") if act == "gelu_tanh"
                else torch.nn.functional.silu(y))
        y = gate * product(up)
    if bias is not None:
        y = y + bias.float()
    if accumulate:
        out.add_(y)
    else:
        out.copy_(y)
