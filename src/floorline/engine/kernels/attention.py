"""Decode attention over the KV cache, split across the GPU (flash-decoding).

One new query per head attends to the `pos + 1` cached tokens. A single program per head would
leave most of the GPU idle at long contexts, so the cached span is cut into SPLITS chunks; each
program takes one (kv head, chunk), scores the whole query group of that kv head (GQA: the group
shares every K and V load; the dots run on fp32 operands, see _precision), and keeps an online softmax (running max m, sum l, weighted sum of
V). A second kernel combines the chunks: o = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c.
The chunk length follows the live length on the device, so one captured graph serves every
position. A sliding window moves the span's start.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from floorline.engine.kernels.launch import pdl_options


@triton.jit
def _attention_split_kernel(qkv_ptr, k_ptr, v_ptr, pos_ptr, part_ptr, stats_ptr, capacity,
                            scale, window, G: tl.constexpr, G_PAD: tl.constexpr,
                            D: tl.constexpr, BLOCK_T: tl.constexpr, SPLITS: tl.constexpr,
                            WINDOWED: tl.constexpr, PRECISION: tl.constexpr,
                            PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    n = tl.load(pos_ptr) + 1
    first = 0
    if WINDOWED:
        first = tl.maximum(n - window, 0)
    chunk = tl.cdiv(tl.cdiv(n - first, SPLITS), BLOCK_T) * BLOCK_T
    start = first + split * chunk
    end = tl.minimum(start + chunk, n)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    heads = kv_head * G + g
    q = tl.load(qkv_ptr + heads[:, None] * D + d[None, :], mask=(g < G)[:, None], other=0.0)
    q = q.to(tl.float32) * scale
    base = kv_head.to(tl.int64) * capacity * D
    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D), tl.float32)
    for t0 in range(start, end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < end
        offs = base + t[:, None] * D + d[None, :]
        k = tl.load(k_ptr + offs, mask=t_ok[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=t_ok[:, None], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    slot = heads * SPLITS + split
    tl.store(part_ptr + slot[:, None] * D + d[None, :], acc, mask=(g < G)[:, None])
    tl.store(stats_ptr + slot * 2, m_i, mask=g < G)
    tl.store(stats_ptr + slot * 2 + 1, l_i, mask=g < G)


@triton.jit
def _attention_combine_kernel(part_ptr, stats_ptr, out_ptr, SPLITS: tl.constexpr,
                              D: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    head = tl.program_id(0)
    c = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    m = tl.load(stats_ptr + (head * SPLITS + c) * 2)
    l = tl.load(stats_ptr + (head * SPLITS + c) * 2 + 1)
    weight = tl.exp(m - tl.max(m, axis=0))  # an empty chunk has m = -inf: weight 0
    acc = tl.load(part_ptr + (head * SPLITS + c)[:, None] * D + d[None, :])
    o = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l * weight, axis=0)
    tl.store(out_ptr + head * D + d, o.to(out_ptr.dtype.element_ty))


def _precision(dtype) -> str:
    # The dots run on fp32 operands. A bf16 cache's values are exact in tf32 (10-bit mantissa),
    # so tf32 loses nothing on K and V; an fp32 cache needs full fp32 products.
    return "ieee" if dtype == torch.float32 else "tf32"


def attention_scratch(n_heads: int, head_dim: int, splits: int, device) -> tuple:
    """Per-chunk partial outputs and (m, l) statistics, allocated once per engine."""
    return (torch.empty(n_heads, splits, head_dim, dtype=torch.float32, device=device),
            torch.empty(n_heads, splits, 2, dtype=torch.float32, device=device))


def attention(qkv, k_cache, v_cache, pos, out, *, scale: float, window: int | None, scratch,
              block_t: int = 64) -> None:
    """out[h] = softmax(q_h K^T * scale) V over the live span, q_h read from the front of qkv."""
    n_kv_heads, capacity, head_dim = k_cache.shape
    n_heads = out.numel() // head_dim
    part, stats = scratch
    splits = part.shape[1]
    group = n_heads // n_kv_heads
    _attention_split_kernel[(n_kv_heads, splits)](
        qkv, k_cache, v_cache, pos, part, stats, capacity, scale, window or 0,
        G=group, G_PAD=max(16, triton.next_power_of_2(group)), D=head_dim, BLOCK_T=block_t,
        SPLITS=splits, WINDOWED=window is not None, PRECISION=_precision(k_cache.dtype),
        num_warps=4, **pdl_options(qkv))
    _attention_combine_kernel[(n_heads,)](part, stats, out, SPLITS=splits, D=head_dim,
                                          num_warps=8 if splits >= 128 else 4, **pdl_options(qkv))


def attention_reference(qkv, k_cache, v_cache, pos, out, *, scale: float, window: int | None,
                        scratch=None, block_t: int = 64) -> None:
    """Masked softmax over the whole capacity: no host read of pos, so it can be captured too."""
    n_kv_heads, capacity, head_dim = k_cache.shape
    n_heads = out.numel() // head_dim
    q = qkv[:n_heads * head_dim].view(n_kv_heads, -1, head_dim).float() * scale
    scores = torch.einsum("hgd,htd->hgt", q, k_cache.float())
    t = torch.arange(capacity, device=k_cache.device)
    n = pos.long() + 1
    live = t < n
    if window is not None:
        live &= t >= n - window
    probs = scores.masked_fill(~live, float("-inf")).softmax(dim=-1)
    out.copy_(torch.einsum("hgt,htd->hgd", probs, v_cache.float()).reshape(-1))
