"""h += rmsnorm(x) * w: Gemma's norms of the attention's and the MLP's outputs, applied before
they join the fp32 residual stream. The norm needs all of x (the output of a product spread
over many programs), so it is a kernel of its own, one program over the hidden size."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from floorline.engine.kernels.launch import pdl_options


@triton.jit
def _add_norm_kernel(x_ptr, w_ptr, h_ptr, N, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
    i = tl.arange(0, BLOCK)
    ok = i < N
    x = tl.load(x_ptr + i, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + i, mask=ok, other=0.0).to(tl.float32)
    h = tl.load(h_ptr + i, mask=ok, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    tl.store(h_ptr + i, h + x * rstd * w, mask=ok)


def add_norm(x, weight, h, *, eps: float) -> None:
    """h (fp32) += x * rsqrt(mean(x^2) + eps) * weight."""
    n = x.numel()
    if weight.numel() != n or h.numel() != n or h.dtype != torch.float32:
        raise ValueError(f"x has {n} elements, the weight {weight.numel()}, h {h.numel()} "
                         f"({h.dtype}; it must be fp32)")
    block = triton.next_power_of_2(n)
    _add_norm_kernel[(1,)](x, weight, h, n, eps, BLOCK=block,
                           num_warps=16 if block >= 4096 else 4, **pdl_options(x))


def add_norm_reference(x, weight, h, *, eps: float) -> None:
    xf = x.float()
    h.add_(xf * torch.rsqrt(xf.pow(2).mean() + eps) * weight.float())
