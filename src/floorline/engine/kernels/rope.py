"""Rotary embedding of the new token's q and k, fused with the KV-cache write of k and v.

qkv is the fused projection output [q heads | k heads | v heads] x head_dim; q is rotated in
place, k rotated into the cache at `pos`, v copied beside it. The cache is [kv heads, capacity,
head_dim] per layer, so each head's tokens are contiguous for the attention kernel. Rotation is
the rotate-half convention of Llama, Qwen2 and Mistral: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s).
`pos` lives on the device, so a captured step advances without the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from floorline.engine.kernels.launch import pdl_options


@triton.jit
def _rope_kv_kernel(qkv_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, capacity,
                    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    h = tl.program_id(0)
    pos = tl.load(pos_ptr)
    half = tl.arange(0, D // 2)
    cos = tl.load(cos_ptr + pos * (D // 2) + half)
    sin = tl.load(sin_ptr + pos * (D // 2) + half)
    x1 = tl.load(qkv_ptr + h * D + half).to(tl.float32)
    x2 = tl.load(qkv_ptr + h * D + D // 2 + half).to(tl.float32)
    r1 = x1 * cos - x2 * sin
    r2 = x2 * cos + x1 * sin
    if h < HQ:
        tl.store(qkv_ptr + h * D + half, r1.to(qkv_ptr.dtype.element_ty))
        tl.store(qkv_ptr + h * D + D // 2 + half, r2.to(qkv_ptr.dtype.element_ty))
    else:
        kv_head = h - HQ
        slot = (kv_head.to(tl.int64) * capacity + pos) * D
        tl.store(k_ptr + slot + half, r1.to(k_ptr.dtype.element_ty))
        tl.store(k_ptr + slot + D // 2 + half, r2.to(k_ptr.dtype.element_ty))
        d = tl.arange(0, D)
        v = tl.load(qkv_ptr + (HQ + HKV + kv_head) * D + d)
        tl.store(v_ptr + slot + d, v)


def rope_kv(qkv, k_cache, v_cache, cos, sin, pos, n_heads: int, n_kv_heads: int) -> None:
    head_dim = k_cache.shape[-1]
    _rope_kv_kernel[(n_heads + n_kv_heads,)](
        qkv, k_cache, v_cache, cos, sin, pos, k_cache.shape[1],
        HQ=n_heads, HKV=n_kv_heads, D=head_dim, num_warps=1, **pdl_options(qkv))


def rope_kv_reference(qkv, k_cache, v_cache, cos, sin, pos, n_heads: int, n_kv_heads: int) -> None:
    head_dim = k_cache.shape[-1]
    index = pos.long().view(1)
    c, s = cos.index_select(0, index), sin.index_select(0, index)  # [1, D/2]
    rotated = (n_heads + n_kv_heads) * head_dim
    x = qkv[:rotated].view(-1, head_dim).float()
    x1, x2 = x.chunk(2, dim=-1)
    r = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(qkv.dtype)
    qkv[:n_heads * head_dim].copy_(r[:n_heads].flatten())
    k_cache.index_copy_(1, index, r[n_heads:].unsqueeze(1))
    v_cache.index_copy_(1, index, qkv[rotated:].view(n_kv_heads, 1, head_dim))
