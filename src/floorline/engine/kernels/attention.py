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
serves every position; a sliding window moves the start, so that a windowed layer reads only
its window's last positions of the cache.

Per model (constexprs): QK_NORM normalises each q and k head by its RMS and a weight before the
rotation (Qwen3, Gemma 3); ROT < D turns only a head's first ROT dims (Phi-3's partial rotary
embedding), the rest passing as they are.

An fp8 cache (floorline.engine.kvcache) holds e4m3 values and one fp32 scale per token and kv
head: the writing program quantises the new k and v (s = max|x| / 448), and the loop reads each
block's fp8 K and V tiles and its BLOCK_T scales once, folding them where they cost least: the
K scales multiply the block's scores, the V scales its probabilities before the product with V,
so no dequantised tile is formed. With a 16-bit model the products then run in fp16 (F16_DOTS):
e4m3 values are exact in fp16 and convert two per instruction, and the query, scaled by a power
of two into [-1, 1], is exact there too; widening the tiles to fp32 for tf32 products cost more
than the halved bytes saved (measured on the H200: bench/engine_kernels.py --kv fp8).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from floorline.engine.kernels.launch import pdl_options
from floorline.engine.kvcache import FP8, FP8_MAX, dequantise, quantise


@triton.jit
def _rotated(x_ptr, base, cos_ptr, sin_ptr, pos, rows, rows_ok, norm_ptr, eps, D: tl.constexpr,
             ROT: tl.constexpr, NORM: tl.constexpr):
    """Rows of head vectors at x_ptr + base + rows * D, RMS-normalised with the weight at
    norm_ptr where NORM, their first ROT dims rotated, in fp32 ([rows, D])."""
    H: tl.constexpr = ROT // 2
    d = tl.arange(0, D)
    turned = d < ROT
    partner = tl.where(turned, (d + H) % ROT, d)  # a dim that is not turned is its own partner
    x = tl.load(x_ptr + base + rows[:, None] * D + d[None, :], mask=rows_ok[:, None], other=0.0)
    y = tl.load(x_ptr + base + rows[:, None] * D + partner[None, :], mask=rows_ok[:, None],
                other=0.0)
    x = x.to(tl.float32)
    y = y.to(tl.float32)
    if NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
        x = x * rstd * tl.load(norm_ptr + d).to(tl.float32)[None, :]
        y = y * rstd * tl.load(norm_ptr + partner).to(tl.float32)[None, :]
    cos = tl.load(cos_ptr + pos * H + d % H, mask=turned, other=1.0)
    sin = tl.load(sin_ptr + pos * H + d % H, mask=turned, other=0.0)
    sign = tl.where(d < H, -1.0, 1.0)
    return x * cos[None, :] + sign[None, :] * y * sin[None, :]


_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def _e4m3_grid(x):
    """fp32 values within e4m3's range, rounded to the nearest e4m3 value (ties to even) in
    fp32, so that the conversion after it is exact. The hardware converts so itself; Triton's
    interpreter, where the CPU tests run, rounds ties away from zero and loses the carry into
    the exponent (31.75 becomes 16), so the rounding is done here, the same everywhere: adding
    2^(e + 20) to a value of exponent e leaves its bits at e4m3's step, 2^(e - 3)."""
    exponent = tl.maximum(((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    magic = ((exponent + 20 + 127) << 23).to(tl.float32, bitcast=True)
    r = (tl.abs(x) + magic) - magic  # below 2^-6 the step stays 2^-9 (subnormals)
    return tl.where(x < 0, -r, r)


@triton.jit
def _quantised(x, dtype: tl.constexpr):
    """fp32 head vectors [rows, D] -> (fp8 values, scales [rows], the values as stored), as
    floorline.engine.kvcache.quantise computes them."""
    s = tl.max(tl.abs(x), axis=1) / _FP8_MAX
    q = x / tl.where(s > 0, s, 1.0)[:, None]
    q = _e4m3_grid(tl.minimum(tl.maximum(q, -_FP8_MAX), _FP8_MAX)).to(dtype)
    return q, s, q.to(tl.float32) * s[:, None]


@triton.jit
def _attention_split_kernel(qkv_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, cos_ptr, sin_ptr, pos_ptr,
                            part_ptr, stats_ptr, capacity, scale, window, qn_ptr, kn_ptr, eps,
                            ROT: tl.constexpr, QK_NORM: tl.constexpr, HQ: tl.constexpr,
                            HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                            D: tl.constexpr, BLOCK_T: tl.constexpr, SPLITS: tl.constexpr,
                            WINDOWED: tl.constexpr, KV_FP8: tl.constexpr,
                            F16_DOTS: tl.constexpr, PRECISION: tl.constexpr,
                            PDL: tl.constexpr):
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
    q = _rotated(qkv_ptr, 0, cos_ptr, sin_ptr, pos, heads, g_ok, qn_ptr, eps, D, ROT, QK_NORM)
    q = q.to(qkv_ptr.dtype.element_ty).to(tl.float32)  # exact in tf32; scaled after the dots
    k_new = _rotated(qkv_ptr, HQ * D, cos_ptr, sin_ptr, pos, kv_head + one, one < 1, kn_ptr,
                     eps, D, ROT, QK_NORM)
    k_new = k_new.to(qkv_ptr.dtype.element_ty).to(tl.float32)
    v_new = tl.load(qkv_ptr + (HQ + HKV + kv_head) * D + d[None, :]).to(tl.float32)
    # k_stored, v_stored: the new token's k and v as the cache will hold them, in fp32
    if KV_FP8:
        k_store, k_s, k_stored = _quantised(k_new, cache_dtype)
        v_store, v_s, v_stored = _quantised(v_new, cache_dtype)
    else:
        k_store, v_store = k_new.to(cache_dtype), v_new.to(cache_dtype)
        k_stored, v_stored = k_store.to(tl.float32), v_store.to(tl.float32)
    base = kv_head.to(tl.int64) * capacity * D
    scale_base = kv_head.to(tl.int64) * capacity
    owner = split == SPLITS - 1  # this program also takes the new token
    if owner:
        tl.store(k_ptr + base + pos * D + d[None, :], k_store)
        tl.store(v_ptr + base + pos * D + d[None, :], v_store)
        if KV_FP8:
            tl.store(ks_ptr + scale_base + pos + one, k_s)
            tl.store(vs_ptr + scale_base + pos + one, v_s)
    s_new = tl.sum(q * k_stored, axis=1) * scale
    if F16_DOTS:
        # q times a power of two that brings each row within [-1, 1]: exact, and then exact in
        # fp16 (a 16-bit value's mantissa fits) but for parts below 2^-14 of the row's largest
        q_exp = ((tl.max(tl.abs(q), axis=1).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 126
        q = q * ((127 - q_exp) << 23).to(tl.float32, bitcast=True)[:, None]
        q_unscale = ((127 + q_exp) << 23).to(tl.float32, bitcast=True) * scale
        q = q.to(tl.float16)
    m_i = tl.where(owner, s_new, float("-inf"))
    l_i = tl.where(owner, 1.0, 0.0) + tl.zeros((G_PAD,), tl.float32)
    acc = tl.where(owner, 1.0, 0.0) * v_stored + tl.zeros((G_PAD, D), tl.float32)
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
        k = tl.load(k_ptr + offs, mask=t_ok[:, None], other=0.0)
        v = tl.load(v_ptr + offs, mask=t_ok[:, None], other=0.0)
        if F16_DOTS:
            k, v = k.to(tl.float16), v.to(tl.float16)
            s = tl.dot(q, tl.trans(k)) * q_unscale[:, None]
        else:
            k, v = k.to(tl.float32), v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if KV_FP8:
            s = s * tl.load(ks_ptr + scale_base + t, mask=t_ok, other=0.0)[None, :]
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if KV_FP8:
            p = p * tl.load(vs_ptr + scale_base + t, mask=t_ok, other=0.0)[None, :]
        if F16_DOTS:
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
        else:
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
    denom = tl.load(stats_ptr + (head * SPLITS + c) * 2 + 1)
    weight = tl.exp(m - tl.max(m, axis=0))  # an empty chunk has m = -inf: weight 0
    part = tl.load(part_ptr + (head * SPLITS + c)[:, None] * D + d[None, :])
    o = tl.sum(part * weight[:, None], axis=0) / tl.sum(denom * weight, axis=0)
    tl.store(out_ptr + head * D + d, o.to(out_ptr.dtype.element_ty))


def _precision(dtype) -> str:
    # The dots run on fp32 operands. bf16 and fp8 values (q as stored, K, V) are exact in tf32
    # (10-bit mantissa), so tf32 loses nothing on them; an fp32 engine needs full fp32 products.
    return "ieee" if dtype == torch.float32 else "tf32"


def attention_warps(head_dim: int) -> int:
    # A 256-wide head (Gemma) holds twice the values per tile; 8 warps share them, at 80
    # registers a thread against 138 with 4 (compiled for sm_90, 32-token blocks; neither
    # spills). Not yet timed against each other on a GPU.
    return 8 if head_dim >= 256 else 4


def attention_scratch(n_heads: int, head_dim: int, splits: int, device) -> tuple:
    """Per-chunk partial outputs and (m, l) statistics, allocated once per engine."""
    return (torch.empty(n_heads, splits, head_dim, dtype=torch.float32, device=device),
            torch.empty(n_heads, splits, 2, dtype=torch.float32, device=device))


def decode_attention(qkv, k_cache, v_cache, cos, sin, pos, out, *, scale: float,
                     window: int | None, scratch, block_t: int = 64, scales=None, q_norm=None,
                     k_norm=None, eps: float = 0.0, rotary: int | None = None,
                     f16_dots: bool = True, num_warps: int | None = None) -> None:
    """Rotate the new q and k at `pos`, write k and v to the cache there, and
    out[h] = softmax(q_h K^T * scale) V over the live span (the new token included).
    An fp8 cache comes with `scales`, its (K scales, V scales) [kv heads, capacity].
    `q_norm` and `k_norm` ([head_dim], both or neither): each head's RMSNorm (with `eps`)
    before the rotation; `rotary`: the dims turned (cos and sin are [capacity, rotary / 2]),
    all by default. `f16_dots` and `num_warps` (attention_warps by default) are launch choices
    for benchmarks; the engine keeps the defaults."""
    n_kv_heads, capacity, head_dim = k_cache.shape
    n_heads = out.numel() // head_dim
    part, stats = scratch
    splits = part.shape[1]
    group = n_heads // n_kv_heads
    fp8 = _check_scales(k_cache, scales)
    k_scale, v_scale = scales if fp8 else (stats, stats)  # not read without fp8
    _attention_split_kernel[(n_kv_heads, splits)](
        qkv, k_cache, v_cache, k_scale, v_scale, cos, sin, pos, part, stats, capacity, scale,
        window or 0, cos if q_norm is None else q_norm, cos if k_norm is None else k_norm, eps,
        ROT=rotary or head_dim, QK_NORM=q_norm is not None, HQ=n_heads, HKV=n_kv_heads, G=group,
        G_PAD=max(16, triton.next_power_of_2(group)), D=head_dim, BLOCK_T=block_t,
        SPLITS=splits, WINDOWED=window is not None, KV_FP8=fp8,
        F16_DOTS=fp8 and f16_dots and qkv.dtype != torch.float32,
        PRECISION=_precision(qkv.dtype), num_warps=num_warps or attention_warps(head_dim),
        **pdl_options(qkv))
    _attention_combine_kernel[(n_heads,)](part, stats, out, SPLITS=splits, D=head_dim,
                                          num_warps=8 if splits >= 128 else 4,
                                          **pdl_options(qkv))


def _check_scales(k_cache, scales) -> bool:
    fp8 = k_cache.dtype == FP8
    if fp8 != (scales is not None):
        raise ValueError("an fp8 cache needs its scales, and only an fp8 cache has them")
    return fp8


def decode_attention_reference(qkv, k_cache, v_cache, cos, sin, pos, out, *, scale: float,
                               window: int | None, scratch=None, block_t: int = 64,
                               scales=None, q_norm=None, k_norm=None, eps: float = 0.0,
                               rotary: int | None = None) -> None:
    """The same in PyTorch: rotate and write the cache, then a masked softmax over the whole
    capacity (no host read of pos, so it can be captured too)."""
    n_kv_heads, capacity, head_dim = k_cache.shape
    n_heads = out.numel() // head_dim
    index = pos.long().view(1)
    c, s = cos.index_select(0, index), sin.index_select(0, index)  # [1, rotary/2]
    rotated = (n_heads + n_kv_heads) * head_dim
    x = qkv[:rotated].view(-1, head_dim).float()
    if q_norm is not None:
        weight = torch.cat([q_norm.float().expand(n_heads, -1),
                            k_norm.float().expand(n_kv_heads, -1)])
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    turned = rotary or head_dim
    x1, x2 = x[:, :turned].chunk(2, dim=-1)
    r = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[:, turned:]], dim=-1).to(qkv.dtype)
    k_new, v_new = r[n_heads:].unsqueeze(1), qkv[rotated:].view(n_kv_heads, 1, head_dim)
    if _check_scales(k_cache, scales):
        for x, cache, cache_scale in ((k_new, k_cache, scales[0]), (v_new, v_cache, scales[1])):
            values, x_scale = quantise(x)
            # index_copy_ has no fp8 kernel on the CPU: the bytes are copied as they are
            cache.view(torch.uint8).index_copy_(1, index, values.view(torch.uint8))
            cache_scale.index_copy_(1, index, x_scale)
        keys, values = (dequantise(t, ts, torch.float32) for t, ts in zip((k_cache, v_cache),
                                                                           scales))
    else:
        k_cache.index_copy_(1, index, k_new.to(k_cache.dtype))
        v_cache.index_copy_(1, index, v_new.to(v_cache.dtype))
        keys, values = k_cache.float(), v_cache.float()
    q = r[:n_heads].view(n_kv_heads, -1, head_dim).float() * scale
    scores = torch.einsum("hgd,htd->hgt", q, keys)
    t = torch.arange(capacity, device=k_cache.device)
    n = index + 1
    live = t < n
    if window is not None:
        live &= t >= n - window
    probs = scores.masked_fill(~live, float("-inf")).softmax(dim=-1)
    out.copy_(torch.einsum("hgt,htd->hgd", probs, values).reshape(-1))
