"""Batch-1 matrix-vector products, y = W x, with the passes around them fused in.

One kernel serves every linear of a decode step; constexpr flags choose the fusions:
- NORM: RMSNorm of x folded in. y = rstd * W (x * g), and rstd is a scalar, so the sum of
  squares accumulates in the same loop that streams W; no separate pass, no normalised copy.
- SWIGLU: the gate and up projections of the same rows in one pass, silu(W_g x) * (W_u x).
- ACCUMULATE: y is added to `out` (the fp32 residual stream) with atomics, which also lets
  the product split along K (SPLIT_K programs per row block) when N alone cannot fill the GPU.
  The split's partial sums then land in no fixed order: fp32 results are not bit-identical
  from run to run (differences of fp32 rounding).
- BIAS: y += b (Qwen2's q/k/v bias).
- SCALE: y *= s[row] (fp8 weights with one scale per output row; W is converted to fp32 as
  it is read).
Each program owns BLOCK_N rows and one K-split; W is read once, in rows of BLOCK_K elements.

int4 weights (floorline.engine.quant.Int4Weight) have a kernel of their own with the same
fusions, `_gemv_int4_kernel`: see its docstring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from floorline.engine.kernels.launch import pdl_options
from floorline.engine.quant import Fp8Weight, Int4Weight, dense


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int = 4
    split_k: int = 1
    num_stages: int = 3

    def fits(self, k: int, accumulate: bool) -> bool:
        # A split needs the atomics of ACCUMULATE; a split smaller than a block does no work.
        return self.split_k == 1 or (accumulate and k >= self.split_k * self.block_k)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, up_ptr, bias_ptr, norm_ptr, scale_ptr, up_scale_ptr, out_ptr,
                 N, K, eps, NORM: tl.constexpr, SWIGLU: tl.constexpr, BIAS: tl.constexpr,
                 SCALE: tl.constexpr,
                 ACCUMULATE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * span
    k_hi = tl.minimum(k_lo + span, K)
    row_base = rows.to(tl.int64)[:, None] * K
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    squares = tl.zeros((BLOCK_K,), tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        if EVEN:
            x = tl.load(x_ptr + cols).to(tl.float32)
            w = tl.load(w_ptr + row_base + cols[None, :])
        else:
            col_ok = cols < k_hi
            x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + row_base + cols[None, :],
                        mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        if NORM:
            squares += x * x
            if EVEN:
                x *= tl.load(norm_ptr + cols).to(tl.float32)
            else:
                x *= tl.load(norm_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
        if SWIGLU:
            if EVEN:
                u = tl.load(up_ptr + row_base + cols[None, :])
            else:
                u = tl.load(up_ptr + row_base + cols[None, :],
                            mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            acc_up += u.to(tl.float32) * x[None, :]
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    y = tl.sum(acc, axis=1)
    y_up = tl.sum(acc_up, axis=1)
    if SCALE:
        y *= tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
        if SWIGLU:
            y_up *= tl.load(up_scale_ptr + rows, mask=row_ok, other=0.0)
    _epilogue(y, y_up, tl.sum(squares, axis=0), rows, row_ok, pid_k, bias_ptr, out_ptr, K, eps,
              NORM, SWIGLU, BIAS, ACCUMULATE)


@triton.jit
def _epilogue(y, y_up, sum_squares, rows, row_ok, pid_k, bias_ptr, out_ptr, K, eps,
              NORM: tl.constexpr, SWIGLU: tl.constexpr, BIAS: tl.constexpr,
              ACCUMULATE: tl.constexpr):
    """What both kernels do with a block of finished dot products."""
    if NORM:  # NORM implies SPLIT_K == 1: this program saw all of x
        rstd = tl.rsqrt(sum_squares / K + eps)
        y *= rstd
        y_up *= rstd
    if SWIGLU:
        y = y * tl.sigmoid(y) * y_up
    if BIAS:
        b = tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        y += tl.where(pid_k == 0, b, 0.0)
    if ACCUMULATE:
        tl.atomic_add(out_ptr + rows, y, mask=row_ok, sem="relaxed")
    else:
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


ONE_BITS = 0x3F800000  # 1.0f; an argument, not a literal, so that the mask and the or fuse into
# one three-input logic instruction (with two literals the compiler emits two)


@triton.jit
def _nibble(words, j: tl.constexpr, one):
    """Nibble j of each word as the float 1 + q/16: q moved to the top four mantissa bits
    (19..22) under 1.0's exponent. The 1 is taken off once per word, after the products."""
    if 4 * j <= 19:
        bits = words << (19 - 4 * j)
    else:
        bits = words >> (4 * j - 19)
    return ((bits & 0x00780000) | one).to(tl.float32, bitcast=True)


@triton.jit
def _gemv_int4_kernel(x_ptr, w_ptr, s_ptr, z_ptr, up_ptr, up_s_ptr, up_z_ptr, bias_ptr, norm_ptr,
                      out_ptr, N, K, K_WORDS, ONE, eps, NORM: tl.constexpr, SWIGLU: tl.constexpr,
                      BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_N: tl.constexpr,
                      GROUPS: tl.constexpr, GROUP: tl.constexpr, SPLIT_K: tl.constexpr,
                      PDL: tl.constexpr):
    """int4 weights in floorline.engine.quant's layout. A program owns BLOCK_N rows (BLOCK_N / 4
    blocks of four interleaved rows) and reads GROUPS groups of each per iteration, as a
    [blocks, GROUPS, W, 4] tile of int32 words (W = GROUP / 8): four rows' words at one
    position side by side. Nibble j of every word belongs to the same run of x (k = g * GROUP +
    j * W + i), so one shift of the tile gives its products with x's run j. Per group the
    integers are summed against x first and the zero point and scale applied once:
    sum_k (q_k - z) s x_k = s (sum_k q_k x_k - z sum_k x_k). A 4-bit q becomes a float without
    a conversion instruction (_nibble), so a weight costs a shift, a logic op and a multiply-add.
    K_WORDS is K / 8, an argument so that Triton sees its divisibility and loads 16 bytes at a
    time; ONE is 1.0's bits, an argument so that mask and or fuse into one logic op."""
    RB: tl.constexpr = BLOCK_N // 4
    W: tl.constexpr = GROUP // 8
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    blocks = pid_n * RB + tl.arange(0, RB)
    r = tl.arange(0, 4)
    block_ok = (blocks < N // 4)[:, None, None, None]
    n_groups = K // GROUP
    span = tl.cdiv(tl.cdiv(n_groups, SPLIT_K), GROUPS) * GROUPS
    g_lo = pid_k * span
    g_hi = tl.minimum(g_lo + span, n_groups)
    i = tl.arange(0, W)
    word_base = blocks.to(tl.int64)[:, None, None, None] * (K_WORDS * 4) + r[None, None, None, :]
    meta_base = (blocks.to(tl.int64)[:, None, None, None] * 4 + r[None, None, None, :]) * n_groups
    if PDL:
        tl.extra.cuda.gdc_wait()
    # Per word position, so that nothing crosses threads until the end.
    acc = tl.zeros((RB, GROUPS, W, 4), tl.float32)
    acc_up = tl.zeros((RB, GROUPS, W, 4), tl.float32)
    squares = tl.zeros((GROUPS, W), tl.float32)
    for g0 in range(g_lo, g_hi, GROUPS):
        groups = g0 + tl.arange(0, GROUPS)
        g_ok = groups < g_hi
        g4 = groups[None, :, None, None]
        words_at = word_base + (g4 * W + i[None, None, :, None]) * 4
        w_mask = block_ok & (g4 < g_hi)
        words = tl.load(w_ptr + words_at, mask=w_mask, other=0)
        meta_at = meta_base + g4  # [blocks, GROUPS, 1, 4]: the words' mask serves
        s = tl.load(s_ptr + meta_at, mask=w_mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + meta_at, mask=w_mask, other=0).to(tl.float32)
        if SWIGLU:
            words_up = tl.load(up_ptr + words_at, mask=w_mask, other=0)
            s_up = tl.load(up_s_ptr + meta_at, mask=w_mask, other=0.0).to(tl.float32)
            z_up = tl.load(up_z_ptr + meta_at, mask=w_mask, other=0).to(tl.float32)
        x_at = groups[:, None] * GROUP + i[None, :]
        dot = tl.zeros((RB, GROUPS, W, 4), tl.float32)
        dot_up = tl.zeros((RB, GROUPS, W, 4), tl.float32)
        x_sum = tl.zeros((GROUPS, W), tl.float32)
        for j in tl.static_range(8):
            x = tl.load(x_ptr + x_at + j * W, mask=g_ok[:, None], other=0.0).to(tl.float32)
            if NORM:
                squares += x * x
                x *= tl.load(norm_ptr + x_at + j * W, mask=g_ok[:, None], other=0.0).to(tl.float32)
            x_sum += x
            x4 = x[None, :, :, None]
            dot += _nibble(words, j, ONE) * x4
            if SWIGLU:
                dot_up += _nibble(words_up, j, ONE) * x4
        # Per word: dot = X + Q / 16 with X = sum x and Q = sum q x over its eight values, and
        # s (Q - z X) = 16 s (dot - (1 + z / 16) X); summed over the group's words at the end
        x_sum = x_sum[None, :, :, None]
        acc += (16.0 * s) * (dot - (1.0 + z * 0.0625) * x_sum)
        if SWIGLU:
            acc_up += (16.0 * s_up) * (dot_up - (1.0 + z_up * 0.0625) * x_sum)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    y = tl.reshape(tl.sum(tl.sum(acc, axis=2), axis=1), (BLOCK_N,))
    y_up = tl.reshape(tl.sum(tl.sum(acc_up, axis=2), axis=1), (BLOCK_N,))
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    _epilogue(y, y_up, tl.sum(tl.sum(squares, axis=1), axis=0), rows, rows < N, pid_k, bias_ptr,
              out_ptr, K, eps, NORM, SWIGLU, BIAS, ACCUMULATE)


def gemv(x, w, out, *, config: GemvConfig, norm=None, eps: float = 0.0, up=None, bias=None,
         accumulate: bool = False) -> None:
    """out = W x (or out += W x): see the module docstring for the fusions. W is a 16-bit
    tensor, an Fp8Weight or an Int4Weight (`up` in the same format); for int4, block_k is the K
    elements a program reads per iteration, a power-of-two number of whole groups."""
    n, k = w.shape
    if x.numel() != k or out.numel() != n:
        raise ValueError(f"W is {n}x{k}, x has {x.numel()} elements and out {out.numel()}")
    if config.split_k > 1 and not accumulate:
        raise ValueError("a K-split needs accumulate=True (partial sums are added atomically)")
    if (norm is not None or up is not None) and config.split_k > 1:
        raise ValueError("NORM and SWIGLU need the whole of x in one program (split_k=1)")
    if up is not None and bias is not None:
        raise ValueError("SWIGLU takes no bias")
    if up is not None and type(up) is not type(w):
        raise ValueError("SWIGLU's gate and up matrices must share a format")
    if accumulate and out.dtype != torch.float32:
        raise ValueError("accumulate adds into an fp32 residual stream")
    flags = dict(NORM=norm is not None, SWIGLU=up is not None, BIAS=bias is not None,
                 ACCUMULATE=accumulate, BLOCK_N=config.block_n, SPLIT_K=config.split_k,
                 num_warps=config.num_warps, num_stages=config.num_stages)
    grid = (triton.cdiv(n, config.block_n), config.split_k)
    if isinstance(w, Int4Weight):
        groups = config.block_k // w.group_size
        if groups < 1 or groups & (groups - 1) or config.block_k % w.group_size:
            raise ValueError(f"block_k {config.block_k} is not a power-of-two number of groups "
                             f"of {w.group_size}")
        if config.block_n % 4:
            raise ValueError(f"block_n {config.block_n}: int4 rows come in blocks of four")
        u = w if up is None else up
        _gemv_int4_kernel[grid](
            x, w.qweight, w.scales, w.zeros, u.qweight, u.scales, u.zeros,
            w.scales if bias is None else bias, w.scales if norm is None else norm, out, n, k,
            k // 8, ONE_BITS, eps, GROUPS=groups, GROUP=w.group_size, **flags, **pdl_options(x))
        return
    scale = up_scale = None
    if isinstance(w, Fp8Weight):
        w, scale = w.weight, w.scale
        if up is not None:
            up, up_scale = up.weight, up.scale
    even = n % config.block_n == 0 and k % (config.split_k * config.block_k) == 0
    _gemv_kernel[grid](
        x, w, w if up is None else up, w if bias is None else bias, w if norm is None else norm,
        w if scale is None else scale, w if up_scale is None else up_scale, out, n, k, eps,
        SCALE=scale is not None, BLOCK_K=config.block_k, EVEN=even, **flags, **pdl_options(x))


def gemv_reference(x, w, out, *, config=None, norm=None, eps: float = 0.0, up=None, bias=None,
                   accumulate: bool = False) -> None:
    """The same contract in plain PyTorch: fp32 arithmetic, the kernel's rounding points, and a
    quantised W dequantised to fp32 first (floorline.engine.quant)."""
    xf = x.float()
    if norm is not None:
        xf = xf * torch.rsqrt(xf.pow(2).mean() + eps) * norm.float()
    y = dense(w) @ xf
    if up is not None:
        y = torch.nn.functional.silu(y) * (dense(up) @ xf)
    if bias is not None:
        y = y + bias.float()
    if accumulate:
        out.add_(y)
    else:
        out.copy_(y)
