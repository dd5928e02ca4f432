"""The step's operations, as Triton kernels or as their PyTorch references (same buffers)."""

from __future__ import annotations

import torch

from floorline.engine.kernels import attention, gemv, norm, rows, tokens
from floorline.engine.kernels.attention import decode_attention_reference
from floorline.engine.kernels.gemv import gemv_reference
from floorline.engine.kernels.norm import add_norm_reference
from floorline.engine.kernels.tokens import argmax_reference, embed_reference
from floorline.engine.quant import dense
from floorline.engine.tuning import GemvTuner


def chunk_linear(x, w, bias, dtype):
    """A prefill chunk's product (floorline.engine.model._Chunk): x rounded to the 16-bit dtype,
    W dequantised to it, one GEMM."""
    return torch.nn.functional.linear(x.to(dtype), dense(w, dtype), bias)


class ReferenceOps:
    """Plain PyTorch: what every kernel is tested against (the CPU's own step, built for speed,
    is floorline.engine.cpu's CpuOps).

    The reference product runs in fp32 on W dequantised; each matrix's fp32 form is made once
    and kept (the values are those dequantise() gives every step), so that a CPU step does not
    convert every weight again: on SmolLM2-135M in bf16 that conversion made the step about 4x
    slower than transformers' own. The cost is an fp32 copy of the matrices in memory."""

    name = "reference"
    attention = staticmethod(decode_attention_reference)
    add_norm = staticmethod(add_norm_reference)
    embed = staticmethod(embed_reference)
    argmax = staticmethod(argmax_reference)
    chunk_linear = staticmethod(chunk_linear)

    def __init__(self):
        self._fp32: dict[int, tuple[object, torch.Tensor]] = {}  # id(W) -> (W, its fp32 form)

    def dense(self, w):
        """W's fp32 matrix, made on first use; W is held with it so that its id stays its."""
        if w is None:
            return None
        if id(w) not in self._fp32:
            self._fp32[id(w)] = (w, dense(w))
        return self._fp32[id(w)][1]

    def gemv(self, x, w, out, *, norm=None, eps: float = 0.0, up=None, bias=None,
             accumulate: bool = False, act: str = "silu") -> None:
        gemv_reference(x, self.dense(w), out, norm=norm, eps=eps, up=self.dense(up), bias=bias,
                       accumulate=accumulate, act=act)

    @staticmethod
    def attention_scratch(n_heads, head_dim, splits, device):
        return None

    @staticmethod
    def argmax_scratch(n, device):
        return None


class TritonOps:
    """floorline's kernels; the GEMV's and rows product's launch configurations from the per-GPU
    tuning table. `precise` (an fp32 model): fp8 products stay off the tensor cores, whose x
    carries twelve significant bits and whose 8-bit sums fewer than fp32's
    (floorline.engine.tuning)."""

    name = "triton"

    def __init__(self, device, precise: bool = False):
        self.tuner = GemvTuner(device, precise=precise)
        self._gemv = gemv.gemv
        self.partials = gemv.SplitPartials()
        self.attention = attention.decode_attention
        self.attention_scratch = attention.attention_scratch
        self.add_norm = norm.add_norm
        self.embed = tokens.embed
        self.argmax = tokens.argmax
        self.argmax_scratch = tokens.argmax_scratch
        self.chunk_linear = chunk_linear

    def gemv(self, x, w, out, *, norm=None, eps: float = 0.0, up=None, bias=None,
             accumulate: bool = False, act: str = "silu") -> None:
        several = x.dim() == 2  # rows of a verify step
        config = self.tuner.config(w, out, norm=norm is not None, up=up is not None,
                                   bias=bias is not None, accumulate=accumulate, rows=several)
        product = rows.rows_product if several else self._gemv
        product(x, w, out, config=config, norm=norm, eps=eps, up=up, bias=bias,
                accumulate=accumulate, act=act, partials=self.partials)
