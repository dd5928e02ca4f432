"""Eight 4-bit values per int32, as GPTQ and AWQ store them.

Nibble j (bits 4j..4j+3) of a packed word holds the value at position `order[j]` of its run of
eight along the packed dimension: GPTQ uses the natural order, AWQ interleaves
[0, 2, 4, 6, 1, 3, 5, 7] (awq/modules/linear/gemm.py, WQLinear_GEMM.from_linear).
"""

from __future__ import annotations

import math

NATURAL = (0, 1, 2, 3, 4, 5, 6, 7)


def pack_int4(values, dim: int, order=NATURAL):
    """Integers 0..15 -> int32 with `dim` eight times shorter."""
    import torch

    v = values.to(torch.int64).movedim(dim, -1)
    if v.shape[-1] % 8:
        raise ValueError(f"packed dimension {v.shape[-1]} is not a multiple of 8")
    if v.numel() and (v.min() < 0 or v.max() > 15):
        raise ValueError("4-bit values must lie in 0..15")
    v = v.reshape(*v.shape[:-1], -1, 8)[..., list(order)]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=v.device)
    words = (v << shifts).sum(-1)  # disjoint bit fields: the sum is the bitwise or
    words = torch.where(words >= 2**31, words - 2**32, words)  # as uint32 bits in an int32
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def unpack_int4(words, dim: int, order=NATURAL):
    """int32 -> integers 0..15 (int64) with `dim` eight times longer."""
    import torch

    w = words.to(torch.int64).movedim(dim, -1) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=w.device)
    nibbles = (w.unsqueeze(-1) >> shifts) & 0xF
    inverse = [order.index(i) for i in range(8)]
    nibbles = nibbles[..., inverse]
    return nibbles.reshape(*w.shape[:-1], -1).movedim(-1, dim).contiguous()


def random_groups(out_features: int, in_features: int, group_size: int, generator, device,
                  std: float = 0.02):
    """Random int4 weights [out, in] (uniform 0..15), zero points [groups, out] of 7 or 8 and
    fp16 scales [groups, out], such that the dequantised weights have mean ~0 and standard
    deviation ~`std`, like a trained layer's (never all zeros)."""
    import torch

    groups = math.ceil(in_features / group_size)
    q = torch.randint(0, 16, (out_features, in_features), generator=generator, device=device)
    zeros = 7 + torch.randint(0, 2, (groups, out_features), generator=generator, device=device)
    # E[(q - z)^2] = var(q) + (E q - E z)^2 + var(z) = 255/12 + 0 + 1/4
    scale = std / math.sqrt(255 / 12 + 1 / 4)
    jitter = torch.empty(groups, out_features, device=device)
    jitter.uniform_(0.9, 1.1, generator=generator)
    return q, zeros, (scale * jitter).to(torch.float16)


def dequantise_groups(q, zeros, scales, group_size: int):
    """(q - zero) * scale per group, in fp32 rounded once to fp16: [out, in] from q [out, in],
    zeros and scales [groups, out]."""
    import torch

    g = torch.arange(q.shape[1], device=q.device) // group_size
    w = (q - zeros.t()[:, g]).to(torch.float32) * scales.t()[:, g].to(torch.float32)
    return w.to(torch.float16)
