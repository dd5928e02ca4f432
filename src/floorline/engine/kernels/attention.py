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
so no dequantised tile is formed. With a 16-bit model both products then run on the tensor
cores in fp8 (FP8_DOTS), straight from the tiles as loaded, with no conversion of K or V: the
tensor cores take 8-bit operands only with the summed dimension contiguous and 64 or more rows,
so the scores are formed transposed, K q^T ([BLOCK_T, G_PAD]), and the output as V^T p^T, from
the cache's V held transposed ([head_dim, tokens]). The other operand, q or the probabilities,
goes in as two e4m3 parts, hi + lo / 16 (split_e4m3): eight significant bits, as many as a
bf16 q holds, each part scaled by a power of two into e4m3's range. The cache's slack past its
capacity lets these loads read whole tiles without masks. With an fp32 model the tiles widen
to fp32 for full-precision products instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from floorline.engine.kernels.e4m3 import e4m3_grid, row_powers, split_e4m3
from floorline.engine.kernels.launch import pdl_options
from floorline.engine.kvcache import FP8, FP8_MAX, FP8_SLACK, dequantise, quantise


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
def _quantised(x, dtype: tl.constexpr):
    """fp32 head vectors [rows, D] -> (fp8 values, scales [rows], the values as stored), as
    floorline.engine.kvcache.quantise computes them."""
    s = tl.max(tl.abs(x), axis=1) / _FP8_MAX
    q = x / tl.where(s > 0, s, 1.0)[:, None]
    q = e4m3_grid(tl.minimum(tl.maximum(q, -_FP8_MAX), _FP8_MAX)).to(dtype)
    return q, s, q.to(tl.float32) * s[:, None]


@triton.jit
def _attention_split_kernel(qkv_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, cos_ptr, sin_ptr, pos_ptr,
                            part_ptr, stats_ptr, capacity, scale, window, qn_ptr, kn_ptr, eps,
                            ROT: tl.constexpr, QK_NORM: tl.constexpr, HQ: tl.constexpr,
                            HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                            D: tl.constexpr, BLOCK_T: tl.constexpr, SPLITS: tl.constexpr,
                            WINDOWED: tl.constexpr, KV_FP8: tl.constexpr,
                            FP8_DOTS: tl.constexpr, EXACT: tl.constexpr,
                            PRECISION: tl.constexpr, PDL: tl.constexpr):
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
        if KV_FP8:  # V transposed: [head_dim, slots]
            tl.store(v_ptr + base + d[None, :] * capacity + pos, v_store)
        else:
            tl.store(v_ptr + base + pos * D + d[None, :], v_store)
        if KV_FP8:
            tl.store(ks_ptr + scale_base + pos + one, k_s)
            tl.store(vs_ptr + scale_base + pos + one, v_s)
    s_new = tl.sum(q * k_stored, axis=1) * scale
    q_hi, q_lo = q, q  # unread without FP8_DOTS
    if FP8_DOTS:
        # q in two e4m3 parts, transposed: the B operand of K q^T
        up, down = row_powers(tl.max(tl.abs(q), axis=1))
        q_unscale = down * scale
        q_hi, q_lo = split_e4m3(q * up[:, None], cache_dtype, EXACT)
        q_hi, q_lo = tl.trans(q_hi), tl.trans(q_lo)
    m_i = tl.where(owner, s_new, float("-inf"))
    l_i = tl.where(owner, 1.0, 0.0) + tl.zeros((G_PAD,), tl.float32)
    acc = tl.where(owner, 1.0, 0.0) * v_stored + tl.zeros((G_PAD, D), tl.float32)
    # The cached span [first, pos), cut into SPLITS chunks of whole blocks. An fp8 cache's
    # chunks start at the block that holds `first`, so that its whole tiles start aligned;
    # tokens before `first` are masked.
    first = 0
    if WINDOWED:
        first = tl.maximum(pos + 1 - window, 0)
    lo = first
    if KV_FP8:
        lo = first // BLOCK_T * BLOCK_T
    chunk = tl.cdiv(tl.cdiv(pos - lo, SPLITS), BLOCK_T) * BLOCK_T
    start = lo + split * chunk
    end = tl.minimum(start + chunk, pos)
    for t0 in range(start, end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < end
        if KV_FP8 and WINDOWED:
            t_ok = t_ok & (t >= first)
        if KV_FP8:
            # whole tiles, K [BLOCK_T, D] and V^T [D, BLOCK_T]: the cache's slack past its
            # capacity is zeroed, and what lies past `end` is masked below
            k = tl.load(k_ptr + base + t[:, None] * D + d[None, :])
            v_t = tl.load(v_ptr + base + d[:, None] * capacity + t[None, :])
            if FP8_DOTS:
                s = tl.trans(tl.dot(k, q_hi) + tl.dot(k, q_lo) * 0.0625) * q_unscale[:, None]
            else:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION) * scale
            s = s * tl.load(ks_ptr + scale_base + t)[None, :]
        else:
            offs = base + t[:, None] * D + d[None, :]
            k = tl.load(k_ptr + offs, mask=t_ok[:, None], other=0.0).to(tl.float32)
            v = tl.load(v_ptr + offs, mask=t_ok[:, None], other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if KV_FP8:
            p = p * tl.load(vs_ptr + scale_base + t)[None, :]
            if FP8_DOTS:  # p in two e4m3 parts: the B operand of V^T p^T
                up, down = row_powers(tl.max(p, axis=1))
                p_hi, p_lo = split_e4m3(p * up[:, None], cache_dtype, EXACT)
                pv = tl.dot(v_t, tl.trans(p_hi)) + tl.dot(v_t, tl.trans(p_lo)) * 0.0625
                acc += tl.trans(pv) * down[:, None]
            else:
                acc += tl.dot(p, tl.trans(v_t.to(tl.float32)), input_precision=PRECISION)
        else:
            acc += tl.dot(p, v, input_precision=PRECISION)
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


# The tensor cores sum 8-bit operands over at least this many values (tl.dot's minimum K): the
# fp8 cache's products with a 16-bit model sum over head_dim (the scores) and over a block of
# cached tokens (the output).
FP8_DOTS_MIN_K = 32


def build_problem(head_dim: int, kv: str, dtype, block_t: int) -> str | None:
    """Why the attention kernel cannot be compiled for these heads, cache format, model dtype
    and block of cached tokens (one line), or None."""
    if kv != "fp8" or dtype == torch.float32:
        return None
    if head_dim < FP8_DOTS_MIN_K:
        return (f"head_dim {head_dim}: the fp8 KV cache's attention runs on the tensor cores, "
                f"which sum 8-bit values over at least {FP8_DOTS_MIN_K} dims; use the 16-bit "
                f"cache for this model")
    if block_t < FP8_DOTS_MIN_K:
        return (f"blocks of {block_t} cached tokens: the fp8 KV cache's attention on the tensor "
                f"cores sums over at least {FP8_DOTS_MIN_K}")
    return None


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
                     fp8_dots: bool = True, num_warps: int | None = None) -> None:
    """Rotate the new q and k at `pos`, write k and v to the cache there, and
    out[h] = softmax(q_h K^T * scale) V over the live span (the new token included).
    An fp8 cache (V transposed, [kv heads, head_dim, slots]; floorline.engine.kvcache) comes
    with `scales`, its (K scales, V scales) [kv heads, slots].
    `q_norm` and `k_norm` ([head_dim], both or neither): each head's RMSNorm (with `eps`)
    before the rotation; `rotary`: the dims turned (cos and sin are [capacity, rotary / 2]),
    all by default. `fp8_dots` (else an fp8 cache's products run in tf32) and `num_warps`
    (attention_warps by default) are launch choices for benchmarks; the engine keeps the
    defaults."""
    n_kv_heads, capacity, head_dim = k_cache.shape
    n_heads = out.numel() // head_dim
    part, stats = scratch
    splits = part.shape[1]
    group = n_heads // n_kv_heads
    fp8 = _check_scales(k_cache, v_cache, scales)
    if fp8 and block_t > FP8_SLACK:
        raise ValueError(f"an fp8 cache's tiles read at most {FP8_SLACK} slots past its "
                         f"capacity: block_t {block_t} is too long")
    fp8_dots = fp8 and fp8_dots and qkv.dtype != torch.float32
    problem = fp8_dots and build_problem(head_dim, "fp8", qkv.dtype, block_t)
    if problem:
        raise ValueError(problem)
    k_scale, v_scale = scales if fp8 else (stats, stats)  # not read without fp8
    _attention_split_kernel[(n_kv_heads, splits)](
        qkv, k_cache, v_cache, k_scale, v_scale, cos, sin, pos, part, stats, capacity, scale,
        window or 0, cos if q_norm is None else q_norm, cos if k_norm is None else k_norm, eps,
        ROT=rotary or head_dim, QK_NORM=q_norm is not None, HQ=n_heads, HKV=n_kv_heads, G=group,
        G_PAD=max(16, triton.next_power_of_2(group)), D=head_dim, BLOCK_T=block_t,
        SPLITS=splits, WINDOWED=window is not None, KV_FP8=fp8,
        FP8_DOTS=fp8_dots, EXACT=not qkv.is_cuda,
        PRECISION=_precision(qkv.dtype), num_warps=num_warps or attention_warps(head_dim),
        **pdl_options(qkv))
    _attention_combine_kernel[(n_heads,)](part, stats, out, SPLITS=splits, D=head_dim,
                                          num_warps=8 if splits >= 128 else 4,
                                          **pdl_options(qkv))


def _check_scales(k_cache, v_cache, scales) -> bool:
    fp8 = k_cache.dtype == FP8
    if fp8 != (scales is not None):
        raise ValueError("an fp8 cache needs its scales, and only an fp8 cache has them")
    kv_heads, slots, head_dim = k_cache.shape
    if fp8 and v_cache.shape != (kv_heads, head_dim, slots):
        raise ValueError(f"an fp8 cache's V is [kv heads, head_dim, slots], "
                         f"{(kv_heads, head_dim, slots)} beside this K, not {tuple(v_cache.shape)}")
    return fp8


def rotated_heads(qkv, n_heads: int, n_kv_heads: int, head_dim: int, c, s, *, q_norm=None,
                  k_norm=None, eps: float = 0.0, rotary: int | None = None) -> torch.Tensor:
    """The new token's q and k heads [n_heads + n_kv_heads, head_dim], each RMS-normalised
    where `q_norm` and `k_norm` are given, its first `rotary` dims turned by the position's
    cos `c` and sin `s`, rounded to qkv's dtype as the kernel rounds them."""
    rotated = (n_heads + n_kv_heads) * head_dim
    x = qkv[:rotated].view(-1, head_dim).float()
    if q_norm is not None:
        weight = torch.cat([q_norm.float().expand(n_heads, -1),
                            k_norm.float().expand(n_kv_heads, -1)])
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    turned = rotary or head_dim
    x1, x2 = x[:, :turned].chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[:, turned:]], dim=-1).to(qkv.dtype)


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
    r = rotated_heads(qkv, n_heads, n_kv_heads, head_dim, c, s, q_norm=q_norm, k_norm=k_norm,
                      eps=eps, rotary=rotary)
    k_new, v_new = r[n_heads:].unsqueeze(1), qkv[rotated:].view(n_kv_heads, 1, head_dim)
    if _check_scales(k_cache, v_cache, scales):
        # V transposed: its tokens are the last dimension
        for x, cache, cache_scale, at in ((k_new, k_cache, scales[0], 1),
                                          (v_new, v_cache, scales[1], 2)):
            values, x_scale = quantise(x)
            values = values if at == 1 else values.transpose(1, 2).contiguous()
            # index_copy_ has no fp8 kernel on the CPU: the bytes are copied as they are
            cache.view(torch.uint8).index_copy_(at, index, values.view(torch.uint8))
            cache_scale.index_copy_(1, index, x_scale)
        keys = dequantise(k_cache, scales[0], torch.float32)
        values = dequantise(v_cache.transpose(1, 2), scales[1], torch.float32)
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
