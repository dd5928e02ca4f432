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
Each program owns BLOCK_N rows and one K-split; W is read once, in rows of BLOCK_K elements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from floorline.engine.kernels.launch import pdl_options


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
def _gemv_kernel(x_ptr, w_ptr, up_ptr, bias_ptr, norm_ptr, out_ptr, N, K, eps,
                 NORM: tl.constexpr, SWIGLU: tl.constexpr, BIAS: tl.constexpr,
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
    if NORM:  # NORM implies SPLIT_K == 1: this program saw all of x
        rstd = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
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


def gemv(x, w, out, *, config: GemvConfig, norm=None, eps: float = 0.0, up=None, bias=None,
         accumulate: bool = False) -> None:
    """out = W x (or out += W x): see the module docstring for the fusions."""
    n, k = w.shape
    if config.split_k > 1 and not accumulate:
        raise ValueError("a K-split needs accumulate=True (partial sums are added atomically)")
    if (norm is not None or up is not None) and config.split_k > 1:
        raise ValueError("NORM and SWIGLU need the whole of x in one program (split_k=1)")
    if up is not None and bias is not None:
        raise ValueError("SWIGLU takes no bias")
    if accumulate and out.dtype != torch.float32:
        raise ValueError("accumulate adds into an fp32 residual stream")
    even = n % config.block_n == 0 and k % (config.split_k * config.block_k) == 0
    grid = (triton.cdiv(n, config.block_n), config.split_k)
    _gemv_kernel[grid](
        x, w, w if up is None else up, w if bias is None else bias, w if norm is None else norm,
        out, n, k, eps,
        NORM=norm is not None, SWIGLU=up is not None, BIAS=bias is not None,
        ACCUMULATE=accumulate, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SPLIT_K=config.split_k, EVEN=even, num_warps=config.num_warps,
        num_stages=config.num_stages, **pdl_options(w))


def gemv_reference(x, w, out, *, config=None, norm=None, eps: float = 0.0, up=None, bias=None,
                   accumulate: bool = False) -> None:
    """The same contract in plain PyTorch (fp32 arithmetic, the kernel's rounding points)."""
    xf = x.float()
    if norm is not None:
        xf = xf * torch.rsqrt(xf.pow(2).mean() + eps) * norm.float()
    y = w.float() @ xf
    if up is not None:
        y = torch.nn.functional.silu(y) * (up.float() @ xf)
    if bias is not None:
        y = y + bias.float()
    if accumulate:
        out.add_(y)
    else:
        out.copy_(y)
