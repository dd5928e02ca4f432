"""The decoder's KV cache: in the engine's 16-bit dtype ("bf16"), or in float8 e4m3 ("fp8") with
one fp32 scale per cached token and kv head, for K and for V.

An fp8 head vector is stored as round(x / s) with s = max|x| / 448 (e4m3's largest finite
value), so every vector uses e4m3's whole range whatever its magnitude, and the scale is known
the moment the vector is written: the decode kernel that writes a token's K and V holds the
whole head vector, and no calibration pass is needed. The price is 4 bytes per head vector of
`head_dim` values (3.1% of the fp8 bytes at head_dim 128), counted by the floor
(floorline.traffic's `engine-fp8` KV format).

Why not one scale per kv head for the whole cache (3% fewer bytes at head_dim 128): it must
be fixed before the tokens come, and a token beyond the range it was fixed for saturates. Even
in hindsight it is no more accurate. Measured on the CPU (`bench/engine_kv_error.py --model
tiny-llama --ctx 2048 --device cpu --dtype float32`: random weights, K and V of every layer,
relative L2 error against the unquantised cache): one scale per (token, head) 2.39% (K) and
2.39% (V); one per head from the largest value the head holds over all 2048 tokens, the best a
fixed per-head scale can do, 2.65% and 2.64%; one per head fixed from the first 256 tokens
2.65% and 2.70%. Random weights give tokens of similar norms; the bench prints the same figures
for the real model shapes on the GPU.

Decode reads the fp8 bytes and the scales; prefill writes the cache the same way and its
attention reads K and V back as the cache holds them (quantised), so that a prompt chunked or
not leaves the same cache and decode sees what prefill saw.

The fp8 cache is laid out for the tensor cores' fp8 products (floorline.engine.kernels.attention),
which take 8-bit operands only with the summed dimension contiguous: K as [tokens, head_dim]
(the product with q sums over head_dim) and V transposed, [head_dim, tokens] (the product with
the probabilities sums over tokens). It holds FP8_SLACK token slots beyond its capacity,
zeroed, so that the decode kernel reads whole tiles of up to that many tokens without masks
past the live ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from floorline.errors import FloorlineError, out_of_memory

KV_FORMATS = ("bf16", "fp8")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_SLACK = 256  # token slots an fp8 cache holds beyond its capacity (a tile's reach)


def room(device, per_position: int) -> str:
    """What a GPU's free memory holds, at `per_position` bytes a position ("" elsewhere, where
    what is free is not known here)."""
    if torch.device(device).type != "cuda":
        return ""
    free = torch.cuda.mem_get_info(torch.device(device))[0]
    return (f"; {free / 1e9:,.1f} GB is free there, room for about {free // per_position:,} "
            "positions")


def check_format(kv: str) -> str:
    if kv not in KV_FORMATS:
        raise FloorlineError(f"engine KV cache must be one of {', '.join(KV_FORMATS)}, not '{kv}'")
    return kv


def quantise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Head vectors [..., head_dim] -> (fp8 values, fp32 scales [...]); an all-zero vector gets
    scale 0. The decode kernel computes the same, operation for operation."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / FP8_MAX
    q = x / torch.where(scale > 0, scale, 1.0)[..., None]
    return q.clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantise(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[..., None]).to(dtype)


@dataclass
class KVCache:
    """K and V of every layer, [layers, kv heads, capacity, head_dim] (each head's tokens
    contiguous); for fp8 V is [layers, kv heads, head_dim, slots] and K [layers, kv heads,
    slots, head_dim], slots = capacity + FP8_SLACK rounded up to 16, with their scales
    [layers, kv heads, slots]."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @classmethod
    def allocate(cls, kv: str, layers: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device) -> KVCache:
        """The cache, zeroed; one line where `device` cannot hold it."""
        if check_format(kv) == "bf16":
            shape = (layers, kv_heads, capacity, head_dim)
            tensors = [(shape, dtype)] * 2
        else:
            slots = -(-(capacity + FP8_SLACK) // 16) * 16  # V's rows start 16-byte aligned
            tensors = [((layers, kv_heads, slots, head_dim), FP8),
                       ((layers, kv_heads, head_dim, slots), FP8),
                       *[((layers, kv_heads, slots), torch.float32)] * 2]
        try:
            return cls(*(torch.zeros(shape, dtype=t, device=device) for shape, t in tensors))
        except (RuntimeError, MemoryError) as e:
            if not out_of_memory(e):
                raise
            asked = sum(math.prod(shape) * t.itemsize for shape, t in tensors)
            raise FloorlineError(f"cannot allocate the KV cache: {capacity:,} positions take "
                                 f"{asked:,} bytes ({asked / 1e9:,.1f} GB), more than {device} "
                                 f"could give{room(device, asked // capacity)}") from None

    @property
    def fp8(self) -> bool:
        return self.k_scale is not None

    def scales(self, layer: int) -> tuple | None:
        """The layer's (K scales, V scales), for the decode kernel; None for a 16-bit cache."""
        return (self.k_scale[layer], self.v_scale[layer]) if self.fp8 else None

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """K and V [kv heads, m, head_dim] of positions start .. start + m - 1."""
        end = start + k.shape[1]
        if not self.fp8:
            self.k[layer, :, start:end] = k
            self.v[layer, :, start:end] = v
            return
        for values, cache, scales in ((k, self.k, self.k_scale), (v, self.v, self.v_scale)):
            q, s = quantise(values)
            if cache is self.v:
                cache[layer, :, :, start:end] = q.transpose(-1, -2)
            else:
                cache[layer, :, start:end] = q
            scales[layer, :, start:end] = s

    def read(self, layer: int, end: int, dtype: torch.dtype) -> tuple:
        """K and V of positions 0 .. end - 1 as the cache holds them, in `dtype`."""
        if not self.fp8:
            return self.k[layer, :, :end], self.v[layer, :, :end]
        k, v = self.k[layer, :, :end], self.v[layer, :, :, :end].transpose(-1, -2)
        return (dequantise(k, self.k_scale[layer, :, :end], dtype),
                dequantise(v, self.v_scale[layer, :, :end], dtype))
