"""The engine's weight formats beyond 16-bit: what each stores, how it is made, and the dense
matrix it stands for (the reference every kernel is checked against).

int4 (weight-only, group-wise, asymmetric): W[n, k] = (q[n, k] - zero[n, g]) * scale[n, g] for
g = k // group_size, q and zero in 0..15 (16 where a GPTQ checkpoint stores it), computed in
fp32. The layout is the one the GEMV streams: each output row's int4 values packed along K,
eight to an int32, in groups of `group_size`. Inside a group, word i holds the values at
k = i, i + W, ..., i + 7W (W = group_size / 8 words per group) in nibbles 0..7, so that one
shift of a whole tile of words yields the values for one contiguous run of x. Rows are
interleaved by four: the words of rows 4b..4b+3 at one position along K lie side by side, so
that one 16-byte load gives a thread four rows against the same x (x is then read and summed
once per four rows, not once per row). Scales and zero points are interleaved the same way, so
that one load gives the four rows' values for a group.

    qweight  int32 [N / 4, K / 8 * 4]     word (4b + r, p) at [b, 4p + r]
    scales   fp16  [N / 4, G * 4]         group g of row 4b + r at [b, 4g + r] (G = K / group_size)
    zeros    uint8 [N / 4, G * 4]

fp8 (weight-only, e4m3): W[n, k] = w8[n, k] * scale[n], one fp32 scale per output row.

GGUF blocks of 32 along K, as a GGUF file stores them (ggml-common.h), computed in fp32:
- Q4_0 (W = d * (q - 8)) is int4 in groups of 32 with every zero point 8: an Int4Weight.
- q4_1 (Q4_1: W = d * q + m, fp16 d and m per block): the int4 layout's words and scales, and
  the fp16 minimums interleaved as the scales are (`mins` [N / 4, G * 4]); m is not a whole
  number of steps d, so it cannot be an int4 zero point.
- q8_0 (Q8_0: W = d * q, q int8, fp16 d per block): int8 [N, K] and fp16 scales [N, K / 32].

Sources: round-to-nearest quantisation of a 16-bit matrix (any checkpoint the engine runs), the
AWQ (AutoAWQ GEMM) and GPTQ (v1, act-order off) layouts, repacked once, and a GGUF file's
blocks (floorline.engine.gguf_blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from floorline.layouts import awq, gptq

FP8_MAX = 448.0  # largest finite float8_e4m3fn
# --weights; bf16 means the checkpoint's 16-bit matrices, gguf a GGUF file's blocks as stored
FORMATS = ("bf16", "int4", "fp8", "gguf")
HEAD_FORMATS = ("bf16", "fp8")
BLOCK = 32  # weights along K per GGUF block


class Int4Words:
    """What the int4 layout's weights share (Int4Weight, Q4_1Weight): the shape its words stand
    for, their bytes and device, and the values unpacked with each column's group."""

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0] * ROWS, self.qweight.shape[1] * 2

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values()
                   if isinstance(t, torch.Tensor))

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def _unpacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The integers 0..15 [N, K] (int64) and each column's group [K]."""
        q = unpack_rows(self.qweight, self.group_size)
        return q, torch.arange(q.shape[1], device=q.device) // self.group_size


@dataclass
class Int4Weight(Int4Words):
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int

    def dequantise(self, dtype=torch.float32) -> torch.Tensor:
        q, g = self._unpacked()
        zeros, scales = unpack_groups(self.zeros), unpack_groups(self.scales)
        w = (q - zeros.long()[:, g]).float() * scales.float()[:, g]
        return w.to(dtype)


@dataclass
class Fp8Weight:
    weight: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # fp32 [N]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.scale.numel() * 4

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def dequantise(self, dtype=torch.float32) -> torch.Tensor:
        return (self.weight.float() * self.scale[:, None]).to(dtype)


@dataclass
class Q4_1Weight(Int4Words):
    qweight: torch.Tensor  # the int4 layout's words
    scales: torch.Tensor  # fp16, interleaved as Int4Weight's
    mins: torch.Tensor  # fp16, interleaved the same way
    group_size: int = BLOCK

    def dequantise(self, dtype=torch.float32) -> torch.Tensor:
        q, g = self._unpacked()
        scales, mins = unpack_groups(self.scales), unpack_groups(self.mins)
        return (q.float() * scales.float()[:, g] + mins.float()[:, g]).to(dtype)


@dataclass
class Q8_0Weight:
    qweight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # fp16 [N, K / 32]
    group_size: int = BLOCK

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * 2

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def dequantise(self, dtype=torch.float32) -> torch.Tensor:
        scales = self.scales.float().repeat_interleave(self.group_size, dim=1)
        return (self.qweight.float() * scales).to(dtype)


def dense(w, dtype=torch.float32) -> torch.Tensor:
    """The matrix a weight of any format stands for."""
    return w.to(dtype) if isinstance(w, torch.Tensor) else w.dequantise(dtype)


def nbytes(w) -> int:
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes


def format_of(w) -> str:
    """A weight's format: one of FORMATS, or "q4_1" or "q8_0" for GGUF blocks that have no
    other form ("bf16" for any unquantised tensor; Q4_0 blocks are "int4")."""
    return {Int4Weight: "int4", Fp8Weight: "fp8", Q4_1Weight: "q4_1",
            Q8_0Weight: "q8_0"}.get(type(w), "bf16")


def fuse_rows(weights: list):
    """One matrix from several of the same format stacked along N (q, k and v into qkv): each
    tensor of the format concatenated, its other fields (a group size) shared."""
    first = weights[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(weights)
    if any(type(w) is not type(first) for w in weights):
        raise ValueError("fuse_rows needs one format")
    parts = {}
    for f in fields(first):
        values = [getattr(w, f.name) for w in weights]
        if isinstance(values[0], torch.Tensor):
            parts[f.name] = torch.cat(values)
        elif any(v != values[0] for v in values):
            raise ValueError(f"fuse_rows needs one {f.name.replace('_', ' ')}")
        else:
            parts[f.name] = values[0]
    return type(first)(**parts)


def split_rows(w, n: int) -> tuple:
    """A matrix's first `n` rows and the rest, each in its format (Phi-3's gate_up_proj into
    gate and up)."""
    if isinstance(w, torch.Tensor):
        return w[:n], w[n:]
    interleaved = isinstance(w, Int4Words)  # tensors of [N / 4, ...]
    if interleaved and n % ROWS:
        raise ValueError(f"an int4 matrix splits at a multiple of {ROWS} rows, not {n}")
    at = n // ROWS if interleaved else n

    def part(p):
        return type(w)(**{f.name: (getattr(w, f.name)[p]
                                   if isinstance(getattr(w, f.name), torch.Tensor)
                                   else getattr(w, f.name)) for f in fields(w)})
    return part(slice(None, at)), part(slice(at, None))


ROWS = 4  # rows interleaved in the int4 layout


def pack_rows(q: torch.Tensor, group_size: int) -> torch.Tensor:
    """Integers 0..15 [N, K] -> the engine's int32 words [N / 4, K / 2] (layout above)."""
    n, k = q.shape
    words = group_size // 8
    v = q.to(torch.int64).reshape(n, k // group_size, 8, words)  # [n, g, j, i]
    shifts = (4 * torch.arange(8, device=q.device, dtype=torch.int64)).view(1, 1, 8, 1)
    packed = (v << shifts).sum(2)  # disjoint bit fields: the sum is the bitwise or
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # uint32 bits in an int32
    packed = packed.to(torch.int32).reshape(n // ROWS, ROWS, k // 8)
    return packed.transpose(1, 2).reshape(n // ROWS, k // 8 * ROWS).contiguous()


def pack_groups(m: torch.Tensor) -> torch.Tensor:
    """Per-group values [N, G] -> rows interleaved by four [N / 4, G * 4] (layout above)."""
    n, g = m.shape
    return m.reshape(n // ROWS, ROWS, g).transpose(1, 2).reshape(n // ROWS, g * ROWS).contiguous()


def unpack_groups(m: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_groups: [N / 4, G * 4] -> [N, G]."""
    blocks = m.shape[0]
    return m.reshape(blocks, -1, ROWS).transpose(1, 2).reshape(blocks * ROWS, -1)


def unpack_rows(qweight: torch.Tensor, group_size: int) -> torch.Tensor:
    """The engine's int32 words [N / 4, K / 2] -> integers 0..15 (int64) [N, K]."""
    blocks = qweight.shape[0]
    words = group_size // 8
    w = qweight.reshape(blocks, -1, ROWS).transpose(1, 2).reshape(blocks * ROWS, -1)
    w = (w.to(torch.int64) & 0xFFFFFFFF).reshape(blocks * ROWS, -1, 1, words)
    shifts = (4 * torch.arange(8, device=qweight.device, dtype=torch.int64)).view(1, 1, 8, 1)
    return ((w >> shifts) & 0xF).reshape(blocks * ROWS, -1)


def _check_int4_shape(n: int, k: int, group_size: int) -> None:
    if k % group_size or group_size % 8 or group_size < 8:
        raise ValueError(f"K={k} must be a multiple of the group size {group_size} (itself a "
                         "multiple of 8)")
    if n % ROWS:
        raise ValueError(f"N={n} rows: the int4 layout interleaves rows by {ROWS}")


def int4_from_integers(q, zeros, scales, group_size: int) -> Int4Weight:
    """q [N, K] 0..15, zeros and scales [N, G] -> the engine's int4 weight."""
    _check_int4_shape(*q.shape, group_size)
    return Int4Weight(pack_rows(q, group_size), pack_groups(scales.to(torch.float16)),
                      pack_groups(zeros.to(torch.uint8)), group_size)


def q4_1_from_integers(q, scales, mins) -> Q4_1Weight:
    """q [N, K] 0..15, fp16 scales and minimums [N, K / 32] -> a q4_1 weight."""
    _check_int4_shape(*q.shape, BLOCK)
    return Q4_1Weight(pack_rows(q, BLOCK), pack_groups(scales.to(torch.float16)),
                      pack_groups(mins.to(torch.float16)))


def quantise_int4(w: torch.Tensor, group_size: int = 128) -> Int4Weight:
    """Round-to-nearest, asymmetric, per group of `group_size` along K (AutoAWQ's
    pseudo_quantize without the activation-aware search): the group's range over 15 steps, the
    zero point where 0.0 lands, both as stored (fp16 scale, integer zero)."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"K={k} is not a multiple of the group size {group_size}")
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scales = ((hi - lo).clamp(min=1e-5) / 15).to(torch.float16)
    s = scales.float()
    zeros = (-torch.round(lo / s)).clamp(0, 15)
    q = (torch.round(g / s[..., None]) + zeros[..., None]).clamp(0, 15)
    return int4_from_integers(q.reshape(n, k).long(), zeros.long(), scales, group_size)


def quantise_fp8(w: torch.Tensor) -> Fp8Weight:
    """One scale per output row: the row's largest magnitude maps to e4m3's largest value."""
    wf = w.float()
    scale = (wf.abs().amax(1) / FP8_MAX).clamp(min=1e-12)
    return Fp8Weight((wf / scale[:, None]).to(torch.float8_e4m3fn), scale)


def quantise(w: torch.Tensor, fmt: str, group_size: int = 128):
    """A 16-bit matrix in the format `fmt` (bf16 keeps it as it is)."""
    if fmt == "int4":
        return quantise_int4(w, group_size)
    if fmt == "fp8":
        return quantise_fp8(w)
    return w


def int4_from_awq(t: dict, group_size: int) -> Int4Weight:
    """AutoAWQ GEMM tensors (qweight [K, N/8], qzeros [G, N/8], scales [G, N]) repacked."""
    q, zeros = awq.unpack(t)
    return int4_from_integers(q, zeros.t(), t["scales"].t(), group_size)


def int4_from_gptq(t: dict, group_size: int) -> Int4Weight:
    """GPTQ v1 tensors (qweight [K/8, N], qzeros [G, N/8] holding zero - 1, scales [G, N],
    g_idx [K]) repacked; a g_idx other than k // group_size (act-order) is refused."""
    k = t["qweight"].shape[0] * 8
    if "g_idx" in t:
        expected = torch.arange(k, device=t["g_idx"].device) // group_size
        if not torch.equal(t["g_idx"].long(), expected):
            raise ValueError("its g_idx reorders the input rows (act-order), which the engine "
                             "does not run")
    q, zeros = gptq.unpack(t)
    return int4_from_integers(q, zeros.t(), t["scales"].t(), group_size)


def fp8_from_checkpoint(weight: torch.Tensor, scale: torch.Tensor) -> Fp8Weight:
    """A float8_e4m3fn matrix with a per-tensor or per-output-row scale, as compressed-tensors
    and FBGEMM fp8 checkpoints store them; block-wise scales are refused."""
    n = weight.shape[0]
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"weight is {weight.dtype}, not float8_e4m3fn")
    s = scale.float().reshape(-1)
    if s.numel() == 1:
        s = s.expand(n)
    elif s.numel() != n:
        raise ValueError(f"weight_scale of shape {tuple(scale.shape)} is neither per tensor nor "
                         f"per output row (block-wise scales are not supported)")
    return Fp8Weight(weight.contiguous(), s.contiguous())
