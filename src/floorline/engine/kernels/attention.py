"""Decode attention: rotary embedding of the new q and k, the KV-cache write, and attention over
the cache split across the GPU (flash-decoding), in two kernels.

qkv is the fused projection output [q heads | k heads | v heads] x head_dim. The cache is
[kv heads, capacity, head_dim] per layer, so each head's tokens are contiguous. Rotation is the
rotate-half convention of Llama, Qwen2 and Mistral: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s).

One new query per head attends to the cached tokens and to itself. A program per head would
leave most of the GPU idle at long contexts, so the cached span is cut into SPLITS chunks; each
program takes one (kv head, chunk), rotates the query group of that kv head (GQA: the group
shares every K and V load), and keeps an online softmax (running max m, sum l, weighted sum of
V). The last chunk's program also takes the new token, and writes its k and v to the cache.
A second kernel, a program per head, combines the chunks:
o = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c. (Combining in the last program of each kv
head to finish, behind a counter, measured 3x slower on the H200: one program then walks the
whole group.) The chunk length follows the live length on the device, so one captured graph
serves every position; a sliding window moves the start.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from floorline.engine.kernels.launch import pdl_options


@triton.jit
def _rotated(x_ptr, base, cos_ptr, sin_ptr, pos, rows, rows_ok, D: tl.constexpr):
    """Rows of head vectors at x_ptr + base + rows * D, rotated, in fp32 ([rows, D])."""
    H: tl.constexpr = D // 2
    d = tl.arange(0, D)
    partner = (d + H) % D
    x = tl.load(x_ptr + base + rows[:, None] * D + d[None, :], mask=rows_ok[:, None], other=0.0)
    y = tl.load(x_ptr + base + rows[:, None] * D + partner[None, :], mask=rows_ok[:, None],
                other=0.0)
    cos = tl.load(cos_ptr + pos * H + d % H)
    sin = tl.load(sin_ptr + pos * H + d % H)
    sign = tl.where(d < H, -1.0, 1.0)
    return x.to(tl.float32) * cos[None, :] + sign[None, :] * y.to(tl.float32) * sin[None, :]


@triton.jit
def _attention_split_kernel(qkv_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, part_ptr,
                            stats_ptr, capacity, scale, window, HQ: tl.constexpr,
                            HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                            D: tl.constexpr, BLOCK_T: tl.constexpr, SPLITS: tl.constexpr,
                            WINDOWED: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    pos = tl.load(pos_ptr)
    d = tl.arange(0, D)
    g = tl.arange(0, G_PAD)
    g_ok = g < G
    heads = kv_head * G + g
    cache_dtype = k_ptr.dtype.element_ty
    one = tl.arange(0, 1)
    # The query group and the new k, rounded where the cache's precision would round them.
    q = _rotated(qkv_ptr, 0, cos_ptr, sin_ptr, pos, heads, g_ok, D)
    q = q.to(qkv_ptr.dtype.element_ty).to(tl.float32)  # exact in tf32; scaled after the dots
    k_new = _rotated(qkv_ptr, HQ * D, cos_ptr, sin_ptr, pos, kv_head + one, one < 1, D)
    k_new = k_new.to(qkv_ptr.dtype.element_ty).to(cache_dtype)
    v_new = tl.load(qkv_ptr + (HQ + HKV + kv_head) * D + d)
    base = kv_head.to(tl.int64) * capacity * D
    owner = split == SPLITS - 1  # this program also takes the new token
    if owner:
        tl.store(k_ptr + base + pos * D + d[None, :], k_new)
        tl.store(v_ptr + base + pos * D + d, v_new.to(cache_dtype))
    s_new = tl.sum(q * k_new.to(tl.float32), axis=1) * scale
    m_i = tl.where(owner, s_new, float("-inf"))
    l_i = tl.where(owner, 1.0, 0.0) + tl.zeros((G_PAD,), tl.float32)
    acc = tl.where(owner, 1.0, 0.0) * v_new.to(cache_dtype).to(tl.float32)[None, :] \
        + tl.zeros((G_PAD, D), tl.float32)
    # The cached span [first, pos), cut into SPLITS chunks of whole blocks.
    first = 0
    if WINDOWED:
        first = tl.maximum(pos + 1 - window, 0)
    chunk = tl.cdiv(tl.cdiv(pos - first, SPLITS), BLOCK_T) * BLOCK_T
    start = first + split * chunk
    end = tl.minimum(start + chunk, pos)
    for t0 in range(start, end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < end
        offs = base + t[:, None] * D + d[None, :]
        k = tl.load(k_ptr + offs, mask=t_ok[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=t_ok[:, None], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
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
    tl.store(part_ptr + slot[:, None] * D + d[None, :], acc, mask=g_ok[:, None])
    tl.store(stats_ptr + slot * 2, m_i, mask=g_ok)
    tl.store(stats_ptr + slot * 2 + 1, l_i, mask=g_ok)


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
    part = tl.load(part_ptr + (head * SPLITS + c)[:, None] * D + d[None, :])
    o = tl.sum(part * weight[:, None], axis=0) / tl.sum(l * weight, axis=0)
    tl.store(out_ptr + head * D + d, o.to(out_ptr.dtype.element_ty))


def _precision(dtype) -> str:
    # The dots run on fp32 operands. bf16 values (q as stored, K, V) are exact in tf32 (10-bit
    # mantissa), so tf32 loses nothing on them; an fp32 cache needs full fp32 products.
    return "ieee" if dtype == torch.float32 else "tf32"


def attention_scratch(n_heads: int, head_dim: int, splits: int, device) -> tuple:
    """Per-chunk partial outputs and (m, l) statistics, allocated once per engine."""
    return (torch.empty(n_heads, splits, head_dim, dtype=torch.float32, device=device),
            torch.empty(n_heads, splits, 2, dtype=torch.float32, device=device))


def decode_attention(qkv, k_cache, v_cache, cos, sin, pos, out, *, scale: float,
                     window: int | None, scratch, block_t: int = 64) -> None:
    """Rotate the new q and k at `pos`, write k and v to the cache there, and
    out[h] = softmax(q_h K^T * scale) V over the live span (the new token included)."""
    n_kv_heads, capacity, head_dim = k_cache.shape
    n_heads = out.numel() // head_dim
    part, stats = scratch
    splits = part.shape[1]
    group = n_heads // n_kv_heads
    _attention_split_kernel[(n_kv_heads, splits)](
        qkv, k_cache, v_cache, cos, sin, pos, part, stats, capacity, scale, window or 0,
        HQ=n_heads, HKV=n_kv_heads, G=group, G_PAD=max(16, triton.next_power_of_2(group)),
        D=head_dim, BLOCK_T=block_t, SPLITS=splits, WINDOWED=window is not None,
        PRECISION=_precision(k_cache.dtype), num_warps=4, **pdl_options(qkv))
    _attention_combine_kernel[(n_heads,)](part, stats, out, SPLITS=splits, D=head_dim,
                                          num_warps=8 if splits >= 128 else 4,
                                          **pdl_options(qkv))


def decode_attention_reference(qkv, k_cache, v_cache, cos, sin, pos, out, *, scale: float,
                               window: int | None, scratch=None, block_t: int = 64) -> None:
    """The same in PyTorch: rotate and write the cache, then a masked softmax over the whole
    capacity (no host read of pos, so it can be captured too)."""
    n_kv_heads, capacity, head_dim = k_cache.shape
    n_heads = out.numel() // head_dim
    index = pos.long().view(1)
    c, s = cos.index_select(0, index), sin.index_select(0, index)  # [1, D/2]
    rotated = (n_heads + n_kv_heads) * head_dim
    x1, x2 = qkv[:rotated].view(-1, head_dim).float().chunk(2, dim=-1)
    r = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(qkv.dtype)
    k_cache.index_copy_(1, index, r[n_heads:].unsqueeze(1).to(k_cache.dtype))
    v_cache.index_copy_(1, index, qkv[rotated:].view(n_kv_heads, 1, head_dim).to(v_cache.dtype))
    q = r[:n_heads].view(n_kv_heads, -1, head_dim).float() * scale
    scores = torch.einsum("hgd,htd->hgt", q, k_cache.float())
    t = torch.arange(capacity, device=k_cache.device)
    n = index + 1
    live = t < n
    if window is not None:
        live &= t >= n - window
    probs = scores.masked_fill(~live, float("-inf")).softmax(dim=-1)
    out.copy_(torch.einsum("hgt,htd->hgd", probs, v_cache.float()).reshape(-1))
