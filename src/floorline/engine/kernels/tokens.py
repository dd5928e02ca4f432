"""The step's two ends outside the layers: the token's row of the embedding table into the fp32
residual stream, and the choice of the next token as the index of a vector's largest value
(greedy decoding's argmax over the logits, or sampling's over its race values).

They are kernels of the engine's own so that they launch with PDL like the rest of the step,
and because PyTorch's argmax is slow at some lengths: over Llama 3's 128,256 logits it took
37 us a step on the H200, against 8.6 us over Qwen2.5's 152,064 (`floorline explain`, sampling).

argmax spreads the vector over programs of BLOCK values; each stores its largest value and
that value's first index, and the last program to arrive (a counter, as the GEMV's K-splits
meet) takes the largest of those, writes the token and leaves the counter at zero. Ties go to
the first index and NaN counts as +inf, as torch.argmax has them (but for NaN beside +inf).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from floorline.engine.kernels.arrival import last_to_arrive
from floorline.engine.kernels.launch import pdl_options

ARGMAX_BLOCK = 2048  # values a program: 16 a thread at 4 warps; 63-75 programs for 7-8B vocabs


@triton.jit
def _embed_kernel(table_ptr, token_ptr, out_ptr, N, scale, SCALE: tl.constexpr,
                  BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < N
    row = tl.load(token_ptr).to(tl.int64) * N
    x = tl.load(table_ptr + row + i, mask=ok, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if SCALE:
        x *= scale
    tl.store(out_ptr + i, x, mask=ok)


def embed(table, token, out, *, scale: float | None = None) -> None:
    """out (fp32) = table[token] (times `scale`: Gemma's embedding scale); token is [1] on the
    device, so that a captured step reads it anew each replay."""
    n = table.shape[1]
    if out.numel() != n or out.dtype != torch.float32:
        raise ValueError(f"the table's rows have {n} values, out {out.numel()} ({out.dtype}; "
                         "it must be fp32)")
    block = min(1024, triton.next_power_of_2(n))
    _embed_kernel[(triton.cdiv(n, block),)](table, token, out, n, scale or 1.0,
                                            SCALE=scale is not None, BLOCK=block, num_warps=4,
                                            **pdl_options(out))


def embed_reference(table, token, out, *, scale: float | None = None) -> None:
    out.copy_(table.index_select(0, token).view(-1))
    if scale is not None:
        out.mul_(scale)


@dataclass(frozen=True)
class ArgmaxScratch:
    """Each program's largest value and its index, and the arrival counter (zero between
    launches), allocated once per vector length so that a captured graph keeps its addresses."""
    block: int
    best: torch.Tensor  # [programs] fp32
    at: torch.Tensor  # [programs] int32
    count: torch.Tensor  # [1] int32


def argmax_scratch(n: int, device, block: int = ARGMAX_BLOCK) -> ArgmaxScratch:
    programs = triton.cdiv(n, block)
    return ArgmaxScratch(block, torch.empty(programs, dtype=torch.float32, device=device),
                         torch.empty(programs, dtype=torch.int32, device=device),
                         torch.zeros(1, dtype=torch.int32, device=device))


@triton.jit
def _argmax_kernel(x_ptr, index_ptr, token_ptr, best_ptr, at_ptr, count_ptr, N,
                   BLOCK: tl.constexpr, PROGRAMS: tl.constexpr, PROGRAMS_PAD: tl.constexpr,
                   INDEX: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    if PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + i, mask=i < N, other=float("-inf")).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.where(x != x, float("inf"), x)
    top = tl.max(x, axis=0)
    # every program holds at least one index below N, so the first maximum is a real one
    tl.store(best_ptr + pid, top)
    tl.store(at_ptr + pid, tl.min(tl.where(x == top, i, N), axis=0))
    if last_to_arrive(count_ptr, PROGRAMS):
        p = tl.arange(0, PROGRAMS_PAD)
        best = tl.load(best_ptr + p, mask=p < PROGRAMS, other=float("-inf"), cache_modifier=".cg")
        at = tl.load(at_ptr + p, mask=p < PROGRAMS, other=N, cache_modifier=".cg")
        first = tl.min(tl.where(best == tl.max(best, axis=0), at, N), axis=0).to(tl.int64)
        if INDEX:
            first = tl.load(index_ptr + first)
        tl.store(token_ptr, first)
        tl.store(count_ptr, 0)


def argmax(x, token, scratch: ArgmaxScratch, *, index=None) -> None:
    """token[0] = the index of x's largest value (1-D, on the device), or index[that] when an
    `index` (int64, as long as x) is given; with the scratch from argmax_scratch(x.numel())."""
    n = x.numel()
    programs = scratch.best.numel()
    if triton.cdiv(n, scratch.block) != programs:
        raise ValueError(f"a scratch for {programs} programs of {scratch.block}, "
                         f"not for {n} values")
    if index is not None and (index.numel() != n or index.dtype != torch.int64):
        raise ValueError(f"index has {index.numel()} {index.dtype} values for {n}")
    _argmax_kernel[(programs,)](
        x, x if index is None else index, token, scratch.best, scratch.at, scratch.count, n,
        BLOCK=scratch.block, PROGRAMS=programs, PROGRAMS_PAD=triton.next_power_of_2(programs),
        INDEX=index is not None, num_warps=4, **pdl_options(x))


def argmax_reference(x, token, scratch=None, *, index=None) -> None:
    at = torch.argmax(x, dim=0, keepdim=True)
    token.copy_(at if index is None else index.index_select(0, at))
