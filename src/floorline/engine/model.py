"""floorline's batch-1 decoder for the Llama, Qwen2 and Mistral families, in one file.

The step is a fixed sequence of kernels over buffers allocated once, so it can be captured in a
single CUDA graph:

    h = embed[token]                                    fp32 residual stream
    per layer:
        qkv  = Wqkv . rmsnorm(h) + b                    norm folded into the product
        rope(q, k); K, V cache[pos] = k, v              one kernel split across the GPU,
                                                        (fp8 cache: quantised as written)
        attn = attention(q, K, V cache[:pos + 1])       then one combining the splits
        h   += Wo . attn                                added in the product's epilogue
        act  = silu(Wg . rmsnorm(h)) * (Wu . rmsnorm(h))   one pass over both matrices
        h   += Wd . act
    logits = Whead . rmsnorm(h); token = sample(logits); pos += 1

`ops` is the kernels (floorline.engine.ops.TritonOps) or their PyTorch references
(ReferenceOps, the CPU path); both take the same buffers. W is 16-bit, int4 or fp8
(floorline.engine.quant); the kernels read it as stored. Prefill runs PyTorch on the same weights,
chunk by chunk (bounded memory whatever the prompt's length), a quantised matrix dequantised to
the 16-bit dtype for its product.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from floorline.engine.kvcache import KVCache
from floorline.engine.quant import dense
from floorline.engine.weights import DecoderWeights
from floorline.errors import FloorlineError


class EngineUnsupported(FloorlineError):
    """The engine does not implement this architecture (one line: what is missing)."""


SUPPORTED = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class DecoderConfig:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    eps: float
    rope: dict
    qkv_bias: bool
    o_bias: bool
    tied: bool
    windows: tuple
    max_positions: int
    initializer_range: float = 0.02

    @classmethod
    def from_hf(cls, config) -> "DecoderConfig":
        from floorline.traffic import kv_layout

        cfg = config.get_text_config()
        if cfg.model_type not in SUPPORTED:
            raise EngineUnsupported(f"the engine runs {', '.join(SUPPORTED)} models, not "
                                    f"'{cfg.model_type}'")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise EngineUnsupported(f"the engine's MLP is SwiGLU; this model uses {cfg.hidden_act}")
        if getattr(cfg, "mlp_bias", False):
            raise EngineUnsupported("the engine's MLP has no biases (mlp_bias is set)")
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        if head_dim < 16 or head_dim & (head_dim - 1):
            raise EngineUnsupported(f"head_dim {head_dim}: the kernels need a power of two >= 16")
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        rope.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        rope_type = rope.get("rope_type", "default")
        if rope_type not in ("default", "llama3"):
            raise EngineUnsupported(f"rope type '{rope_type}' (the engine has default and llama3)")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise EngineUnsupported("partial rotary embeddings")
        attention_bias = getattr(cfg, "attention_bias", False)
        _, windows = kv_layout(config)
        return cls(
            hidden=cfg.hidden_size, intermediate=cfg.intermediate_size,
            layers=cfg.num_hidden_layers, heads=heads,
            kv_heads=getattr(cfg, "num_key_value_heads", None) or heads, head_dim=head_dim,
            vocab=cfg.vocab_size, eps=cfg.rms_norm_eps, rope=rope,
            qkv_bias=cfg.model_type == "qwen2" or attention_bias, o_bias=attention_bias,
            tied=bool(getattr(cfg, "tie_word_embeddings", False)), windows=tuple(windows),
            max_positions=cfg.max_position_embeddings,
            initializer_range=getattr(cfg, "initializer_range", 0.02))

    @property
    def qkv_rows(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim


def inverse_frequencies(config: DecoderConfig) -> torch.Tensor:
    """Rotary inverse frequencies in float64, with Llama 3's wavelength-dependent scaling."""
    d = config.head_dim
    inv = 1.0 / config.rope["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    if config.rope.get("rope_type") != "llama3":
        return inv
    r = config.rope
    factor, low, high = r["factor"], r["low_freq_factor"], r["high_freq_factor"]
    old = r["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv
    # Long wavelengths are divided by the factor, short ones kept, the band between blended.
    smooth = (old / wavelength - low) / (high - low)
    blended = (1 - smooth) * inv / factor + smooth * inv
    scaled = torch.where(wavelength > old / low, inv / factor, inv)
    middle = (wavelength <= old / low) & (wavelength >= old / high)
    return torch.where(middle, blended, scaled)


# Cached tokens per iteration of the attention kernel, per cache format. An fp8 block of 64
# tokens is half the bytes of a 16-bit one for the same loop work; on the H200, at 131072
# tokens of Llama-3.1-8B, 128 ran at 3.0 TB/s against 2.3 (bench/engine_kernels.py --kv fp8).
ATTENTION_BLOCK_T = {"bf16": 64, "fp8": 128}
PREFILL_CHUNK = 2048  # prompt tokens per prefill pass


def attention_splits(kv_heads: int, device, per_sm: int = 2) -> int:
    """Chunks per kv head for decode attention: about `per_sm` programs per SM, a power of two
    (the combine kernel reduces over them in one block), at most 128."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count \
        if torch.device(device).type == "cuda" else 2
    splits = 1
    while splits < 128 and kv_heads * splits * 2 <= per_sm * sms:
        splits *= 2
    return splits


class Decoder:
    """Weights, KV cache, step buffers and the decode step of one batch-1 stream; `kv` is the
    cache's format (floorline.engine.kvcache: "bf16", the weights' 16-bit dtype, or "fp8")."""

    def __init__(self, config: DecoderConfig, weights: DecoderWeights, capacity: int, ops,
                 sampler, kv: str = "bf16"):
        if capacity > config.max_positions:
            raise FloorlineError(f"capacity {capacity} is above the model's "
                                 f"{config.max_positions} positions")
        self.config, self.w, self.capacity, self.ops, self.sampler = (
            config, weights, capacity, ops, sampler)
        c, device, dtype = config, weights.device, weights.dtype
        self.cache = KVCache.allocate(kv, c.layers, c.kv_heads, capacity, c.head_dim, dtype,
                                      device)
        self.block_t = ATTENTION_BLOCK_T[kv]
        self.k_cache, self.v_cache = self.cache.k, self.cache.v
        angles = torch.outer(torch.arange(capacity, dtype=torch.float64), inverse_frequencies(c))
        self.cos = angles.cos().float().to(device)
        self.sin = angles.sin().float().to(device)
        self.scale = c.head_dim ** -0.5
        # The step's state and buffers: fixed addresses, so a captured graph reuses them.
        self.token = torch.zeros(1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.int32, device=device)  # the new token's position
        self.h = torch.empty(c.hidden, dtype=torch.float32, device=device)
        self.qkv = torch.empty(c.qkv_rows, dtype=dtype, device=device)
        self.attn = torch.empty(c.heads * c.head_dim, dtype=dtype, device=device)
        self.act = torch.empty(c.intermediate, dtype=dtype, device=device)
        self.logits = torch.empty(c.vocab, dtype=torch.float32, device=device)
        self.scratch = ops.attention_scratch(c.heads, c.head_dim,
                                             attention_splits(c.kv_heads, device), device)

    def step(self) -> None:
        """One decode step on the device: reads token and pos, leaves the next token and pos+1."""
        c, w, ops = self.config, self.w, self.ops
        self.h.copy_(w.embed.index_select(0, self.token).view(-1))
        for i, layer in enumerate(w.layers):
            ops.gemv(self.h, layer.wqkv, self.qkv, norm=layer.ln1, eps=c.eps, bias=layer.bqkv)
            ops.attention(self.qkv, self.k_cache[i], self.v_cache[i], self.cos, self.sin,
                          self.pos, self.attn, scale=self.scale, window=c.windows[i],
                          scratch=self.scratch, block_t=self.block_t,
                          scales=self.cache.scales(i))
            ops.gemv(self.attn, layer.wo, self.h, bias=layer.bo, accumulate=True)
            ops.gemv(self.h, layer.wgate, self.act, norm=layer.ln2, eps=c.eps, up=layer.wup)
            ops.gemv(self.act, layer.wdown, self.h, accumulate=True)
        ops.gemv(self.h, w.head, self.logits, norm=w.norm, eps=c.eps)
        self.sampler(self.logits, self.token)
        self.pos.add_(1)

    def prefill(self, tokens: torch.Tensor, chunk: int = PREFILL_CHUNK) -> torch.Tensor:
        """Run `tokens` (1-D) through the model from position 0, fill the cache, sample the next
        token into `token`, set `pos`; returns the last position's logits (fp32).

        The prompt goes through in chunks of `chunk` tokens, every layer for one chunk before
        the next, so that activations, products and attention scores scale with the chunk and
        not with the prompt: a chunk's queries attend to the cache written so far, read back as
        it holds them (with an fp8 cache, quantised), so that chunking changes nothing."""
        c, w = self.config, self.w
        n = tokens.numel()
        if n == 0 or n >= self.capacity:
            raise FloorlineError(f"prefill of {n} tokens into a cache of {self.capacity}")
        if chunk < 1:
            raise FloorlineError(f"prefill chunk must be at least 1 token, got {chunk}")
        for start in range(0, n, chunk):
            x = self._prefill_chunk(tokens[start:start + chunk], start)
        # The last position's logits by the decode step's own head product (fp32 out).
        self.ops.gemv(x[-1].contiguous(), w.head, self.logits, norm=w.norm, eps=c.eps)
        self.sampler(self.logits, self.token)
        self.pos.fill_(n)
        return self.logits.clone()

    def _prefill_chunk(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Positions start .. start + len(tokens) - 1 through every layer; their K and V into
        the cache; returns the chunk's residual stream (fp32)."""
        c, w, dt = self.config, self.w, self.w.dtype
        m = tokens.numel()
        end = start + m
        x = w.embed[tokens].float()
        cos, sin = self.cos[start:end], self.sin[start:end]
        for i, layer in enumerate(w.layers):
            qkv = _linear(_rms_norm(x, layer.ln1, c.eps), layer.wqkv, layer.bqkv, dt)
            q, k, v = qkv.split([c.heads * c.head_dim, c.kv_heads * c.head_dim,
                                 c.kv_heads * c.head_dim], dim=-1)
            q = _rotate(q.view(m, c.heads, c.head_dim), cos, sin).to(dt)
            k = _rotate(k.view(m, c.kv_heads, c.head_dim), cos, sin).to(dt)
            self.cache.write(i, start, k.transpose(0, 1),
                             v.view(m, c.kv_heads, c.head_dim).transpose(0, 1))
            o = _chunk_attention(q, *self.cache.read(i, end, dt), start, c.windows[i],
                                 self.scale)
            x = x + _linear(o.transpose(0, 1).reshape(m, -1), layer.wo, layer.bo, dt).float()
            hn = _rms_norm(x, layer.ln2, c.eps)
            act = (torch.nn.functional.silu(_linear(hn, layer.wgate, None, dt))
                   * _linear(hn, layer.wup, None, dt))
            x = x + _linear(act, layer.wdown, None, dt).float()
        return x


def _rms_norm(x, weight, eps):
    x = x.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(weight.dtype)


def _linear(x, weight, bias, dtype):
    return torch.nn.functional.linear(x.to(dtype), dense(weight, dtype), bias)


def _rotate(x, cos, sin):
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _chunk_attention(q, k, v, start: int, window: int | None, scale: float):
    """Queries [m, heads, d] at positions start .. start + m - 1 against the cached keys and
    values [kv_heads, start + m, d] -> [heads, m, d]. As 4-D tensors with K and V repeated per
    query head, SDPA takes a fused kernel (flash for the first chunk, which needs no mask beyond
    causality; memory-efficient with the mask after it), so that no [heads, m, start + m] score
    tensor is made on a GPU."""
    group = q.shape[1] // k.shape[0]
    q = q.transpose(0, 1)[None]
    k, v = (t.repeat_interleave(group, dim=0)[None] for t in (k, v))
    if start == 0 and window is None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                               scale=scale)
        return out[0]
    query = start + torch.arange(q.shape[2], device=q.device)[:, None]
    key = torch.arange(k.shape[2], device=q.device)[None, :]
    mask = key <= query
    if window is not None:
        mask &= key > query - window
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                            scale=scale)[0]
