"""The engine's step on the CPU, built for speed: the default there (floorline.engine.runtime).

The reference (floorline.engine.ops.ReferenceOps) stays what the kernels are tested against: fp32
products from an fp32 copy of every matrix, and attention over the whole cache's capacity. This
step reads each 16-bit matrix as it is stored, once a step, and attends over the live positions
only. Measured on 2 cores of an AMD EPYC with AVX-512 BF16 (torch 2.13.0, SmolLM2-135M's shapes,
the 30 layers' matrices and the head read in turn so that none stays in cache; one run of
`bench/cpu_engine.py`): a one-row bf16 product took 11.07 ms over them through ATen's own GEMV,
against 20.38 ms through oneDNN, PyTorch's default for bf16, and 15.70 ms with oneDNN's packed
weights (an extra copy of every matrix); the fp32 reference's products took 44.63 ms. int8
products (`torch._weight_int8pack_mm`) took 10.07 ms, on half the bytes: another format, with
a floor of its own, not this step's. So up to ATEN_ROWS rows run through ATen's GEMV (one row
by torch.mv, two with oneDNN switched off around the product); more rows (a verify step)
keep oneDNN, whose GEMM is faster from 4 rows (22.44 ms against 28.25 at 4 rows, 31.02
against 113.99 at 16; at 2, 20.53 against 15.12). Where the processor has no bf16 dot
products, a product of many rows is faster widened to fp32, and one or two rows through
floorline's own AVX2 kernel (floorline.engine.cpu_kernel): the route of each is chosen when the
engine loads (floorline.engine.cpu_products).

x is normalised in fp32, rounded to the weights' dtype and multiplied with fp32 accumulation;
the product's output is rounded to that dtype before it joins the fp32 residual stream (as
transformers' bf16 model rounds it). An fp32 output (the logits) keeps that rounding only in its
tail: its REFINED largest entries are computed again from the fp32 x, as the reference computes
them, so that the token chosen is the reference's wherever its logit leads the rest by more
than the rounding. On SmolLM2-135M in bf16, greedy tokens agreed with float32's for 474 of 22
prompts x 32 tokens (summed up to each prompt's first difference) with every logit rounded,
606 with the leaders recomputed, against 624 for the reference's bf16 step and 557 for
transformers' bf16 model. A quantised matrix (int4, fp8) is multiplied as the reference
multiplies it (x and the sums in fp32), from its fp32 form made once, or, where floorline's kernel
reads its format (int4, a GGUF file's Q4_1 and Q8_0 blocks) and the trial found it faster, one
row at a time as stored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from floorline.engine import cpu_kernel
from floorline.engine.cpu_products import AS_STORED, KERNEL, ProductPlan, linear
from floorline.engine.kernels.attention import rotated_heads
from floorline.engine.kernels.gemv import gemv_reference
from floorline.engine.kvcache import FP8, dequantise, quantise
from floorline.engine.ops import ReferenceOps
from floorline.engine.quant import dense

REFINED = 16  # an fp32 output's leading entries, computed again in fp32 (module docstring)


class CpuOps(ReferenceOps):
    """The CPU's fast step: the reference's embedding, norms and argmax, its own products and
    attention (module docstring)."""

    name = "cpu"

    def __init__(self, plan: ProductPlan = AS_STORED):
        super().__init__()
        self.plan = plan  # each 16-bit product's route (cpu_products.plan_products)
        self._turn: tuple = (None, None, -1, None, None)  # _turn_at's: cos, sin, p, C, S

    def _turn_at(self, cos, sin, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Position p's [c, c] and [s, -s] over a whole head, made once a step for every layer
        that shares the rotary tables."""
        last_cos, last_sin, last_p, c2, s2 = self._turn
        if cos is not last_cos or sin is not last_sin or p != last_p:
            c, s = cos[p], sin[p]
            c2, s2 = torch.cat([c, c]), torch.cat([s, -s])
            self._turn = (cos, sin, p, c2, s2)
        return c2, s2

    def _rotated(self, qkv, n_heads: int, n_kv_heads: int, head_dim: int, cos, sin, p: int,
                 **options) -> torch.Tensor:
        """rotated_heads' q and k heads. Where every dim turns and no norm comes first, in four
        operations: x C - roll(x) S is x1 c - x2 s, x2 c + x1 s, each product and sum rounded
        as rotated_heads rounds them (x - (-y) is x + y to the bit)."""
        if options["q_norm"] is not None or options["rotary"] not in (None, head_dim):
            return rotated_heads(qkv, n_heads, n_kv_heads, head_dim, cos[p], sin[p], **options)
        c2, s2 = self._turn_at(cos, sin, p)
        x = qkv[:(n_heads + n_kv_heads) * head_dim].view(-1, head_dim).float()
        return (x * c2 - x.roll(head_dim // 2, -1) * s2).to(qkv.dtype)

    def gemv(self, x, w, out, *, norm=None, eps: float = 0.0, up=None, bias=None,
             accumulate: bool = False, act: str = "silu") -> None:
        if not isinstance(w, torch.Tensor):
            if self.plan.blocks == KERNEL and x.dim() == 1:  # as stored, never its fp32 copy
                gemv_reference(x, w, out, norm=norm, eps=eps, up=up, bias=bias,
                               accumulate=accumulate, act=act,
                               multiply=cpu_kernel.kernel().blocks)
            else:
                super().gemv(x, w, out, norm=norm, eps=eps, up=up, bias=bias,
                             accumulate=accumulate, act=act)
            return
        if norm is None:  # x rounded to W's dtype once, as through fp32 (no copy where it is)
            xf, xw = None, x.to(w.dtype)
        else:
            xf = x.float()
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * norm
            xw = xf.to(w.dtype)
        y = linear(xw, w, self.plan)
        if up is not None:
            gate = F.silu(y) if act == "silu" else F.gelu(y, approximate="tanh")
            y = gate.mul_(linear(xw, up, self.plan))
        if bias is not None:
            y = y + bias
        if accumulate:
            out.add_(y)
            return
        out.copy_(y)
        if out.dtype == torch.float32 and w.dtype != torch.float32 and up is None:
            top = out.topk(min(REFINED, out.shape[-1]), dim=-1).indices
            xf = x.float() if xf is None else xf
            exact = (w[top].float() @ xf.unsqueeze(-1)).squeeze(-1)
            out.scatter_(-1, top, exact if bias is None else exact + bias[top].float())

    def chunk_linear(self, x, w, bias, dtype):
        """A prefill chunk's product by the plan's route for its rows (ops.chunk_linear)."""
        y = linear(x.to(dtype), dense(w, dtype), self.plan)
        return y if bias is None else y + bias

    def attention(self, qkv, k_cache, v_cache, cos, sin, pos, out, *, scale: float,
                  window: int | None, scratch=None, block_t: int = 64, scales=None,
                  q_norm=None, k_norm=None, eps: float = 0.0, rotary: int | None = None) -> None:
        """The reference's contract (floorline.engine.kernels.attention), over the live span
        only: the position is read on the host, which a CPU step can afford."""
        fp8 = k_cache.dtype == FP8
        n_kv_heads, head_dim = k_cache.shape[0], k_cache.shape[-1]
        n_heads = out.numel() // head_dim
        p = int(pos)
        rotated = (n_heads + n_kv_heads) * head_dim
        r = self._rotated(qkv, n_heads, n_kv_heads, head_dim, cos, sin, p, q_norm=q_norm,
                          k_norm=k_norm, eps=eps, rotary=rotary)
        k_new, v_new = r[n_heads:], qkv[rotated:].view(n_kv_heads, head_dim)
        lo = 0 if window is None else max(0, p + 1 - window)
        if fp8:  # V transposed: its tokens are the last dimension (floorline.engine.kvcache)
            for x_new, cache, cache_scale in ((k_new, k_cache, scales[0]),
                                              (v_new, v_cache.transpose(1, 2), scales[1])):
                values, x_scale = quantise(x_new)
                cache[:, p] = values
                cache_scale[:, p] = x_scale
            keys = dequantise(k_cache[:, lo:p + 1], scales[0][:, lo:p + 1], torch.float32)
            values = dequantise(v_cache[:, :, lo:p + 1].transpose(1, 2), scales[1][:, lo:p + 1],
                                torch.float32)
        else:
            k_cache[:, p] = k_new
            v_cache[:, p] = v_new
            keys, values = k_cache[:, lo:p + 1], v_cache[:, lo:p + 1]
        # A 16-bit cache as it is stored, no copy (an fp8 one dequantised to fp32, as the
        # reference reads it): each kv head's group of queries over the live positions in one
        # fused kernel (PyTorch's CPU flash attention, which sums in fp32).
        q = r[:n_heads].view(1, n_kv_heads, -1, head_dim).to(keys.dtype)
        o = F.scaled_dot_product_attention(q, keys[None], values[None], scale=scale)
        out.copy_(o.view(-1))
