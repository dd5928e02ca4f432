"""floorline's batch-1 decoder for the Llama, Qwen2, Mistral, Qwen3, Gemma 3 and Phi-3 families,
in one file.

The step is a fixed sequence of kernels over buffers allocated once, so it can be captured in a
single CUDA graph:

    h = embed[token] (* sqrt(hidden): Gemma)            fp32 residual stream
    per layer:
        qkv  = Wqkv . rmsnorm(h) + b                    norm folded into the product
        rmsnorm(q), rmsnorm(k) per head (Qwen3, Gemma)  one kernel split across the GPU,
        rope(q, k); K, V cache[pos] = k, v              (fp8 cache: quantised as written)
        attn = attention(q, K, V cache[:pos + 1])       then one combining the splits
        h   += Wo . attn                                added in the product's epilogue
                                                        (Gemma: h += rmsnorm(Wo . attn))
        act  = silu(Wg . rmsnorm(h)) * (Wu . rmsnorm(h))   one pass over both matrices
                                                        (Gemma: tanh-GELU, GeGLU)
        h   += Wd . act                                 (Gemma: h += rmsnorm(Wd . act))
    logits = Whead . rmsnorm(h) (Gemma: soft-capped where the config says);
    token = sample(logits); pos += 1

Variants, from the config: explicit head_dim; rotary on the first `rotary` dims of a head only
(Phi-3's partial_rotary_factor); Gemma 3's sliding-window layers with a rotary base of their
own, interleaved with global ones. A sliding-window layer keeps a full-length cache, as every
layer does, and reads only the window's last positions of it. Gemma's RMSNorm weights act as
(1 + w): the 1 is added at load, in fp32 (floorline.engine.weights).

`ops` is the kernels (floorline.engine.ops.TritonOps), their PyTorch references (ReferenceOps)
or the CPU's step (floorline.engine.cpu.CpuOps); all take the same buffers. W is 16-bit, int4 or fp8
(floorline.engine.quant); the kernels read it as stored. The layer above is written once
(Decoder._forward), over the stages of a pass: the decode step's and verify's, which are the ops
(_Step), or a prefill chunk's (_Chunk): PyTorch on the same weights, chunk by chunk (bounded
memory whatever the prompt's length), a quantised matrix dequantised to the 16-bit dtype for its
product; asked for the logits of every position (a quality measurement), it computes each
chunk's with the step's head arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch

from floorline.engine.kernels.gemv import gemv_reference
from floorline.engine.kvcache import KVCache
from floorline.engine.weights import DecoderWeights
from floorline.errors import FloorlineError
from floorline.traffic import kv_layout


class EngineUnsupported(FloorlineError):
    """The engine does not implement this architecture (one line: what is missing)."""


SUPPORTED = ("llama", "qwen2", "mistral", "qwen3", "gemma3_text", "phi3")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # config name -> the engine's
ROPE_TYPES = ("default", "llama3", "linear", "longrope")


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
    rotary: int = 0  # dims of a head the rotary embedding turns (0: all of them)
    local_rope: dict | None = None  # sliding-window layers' own rotary embedding (Gemma 3)
    qk_norm: bool = False  # RMSNorm of each q and k head before the rotary embedding
    gemma: bool = False  # (1 + w) norms, norms after attention and MLP too, scaled embedding
    fused: bool = False  # the checkpoint stores qkv_proj and gate_up_proj (Phi-3)
    act: str = "silu"  # the gated MLP's activation: silu or gelu_tanh
    query_scale: float = 0.0  # attention's scale on q.k (0: head_dim ** -0.5)
    final_softcap: float | None = None  # logits = c tanh(logits / c)

    @classmethod
    def from_hf(cls, config) -> DecoderConfig:
        cfg = config.get_text_config()
        kind = cfg.model_type
        if "moe" in kind or any(getattr(cfg, f, None) for f in ("num_experts",
                                                                 "num_local_experts")):
            raise EngineUnsupported(f"'{kind}' is a mixture-of-experts model; the engine runs "
                                    "dense decoders only")
        if kind not in SUPPORTED:
            raise EngineUnsupported(f"the engine runs {', '.join(SUPPORTED)} models, not "
                                    f"'{kind}'")
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise EngineUnsupported(f"the engine's MLP is SwiGLU or tanh-GELU GeGLU; this model "
                                    f"uses {act}")
        if getattr(cfg, "mlp_bias", False):
            raise EngineUnsupported("the engine's MLP has no biases (mlp_bias is set)")
        if getattr(cfg, "attn_logit_softcapping", None) is not None:
            raise EngineUnsupported("attention logit soft-capping (attn_logit_softcapping) is "
                                    "not implemented in the engine")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise EngineUnsupported("bidirectional attention (use_bidirectional_attention)")
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        if head_dim < 16 or head_dim & (head_dim - 1):
            raise EngineUnsupported(f"head_dim {head_dim}: the kernels need a power of two >= 16")
        params = dict(getattr(cfg, "rope_parameters", None) or {})
        local = None
        if "full_attention" in params:  # one rotary embedding per layer type
            local = _rope(params.get("sliding_attention") or {}, cfg)
            params = params["full_attention"] or {}
        rope = _rope(params, cfg)
        factor = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
        rotary = int(head_dim * factor)
        if rotary < 2 or rotary % 2 or rotary > head_dim:
            raise EngineUnsupported(f"partial_rotary_factor {factor} turns {rotary} of "
                                    f"{head_dim} dims (the engine needs an even number)")
        attention_bias = getattr(cfg, "attention_bias", False)
        gemma = kind == "gemma3_text"
        _, windows = kv_layout(config)
        return cls(
            hidden=cfg.hidden_size, intermediate=cfg.intermediate_size,
            layers=cfg.num_hidden_layers, heads=heads,
            kv_heads=getattr(cfg, "num_key_value_heads", None) or heads, head_dim=head_dim,
            vocab=cfg.vocab_size, eps=cfg.rms_norm_eps, rope=rope,
            qkv_bias=kind == "qwen2" or attention_bias, o_bias=attention_bias,
            tied=bool(getattr(cfg, "tie_word_embeddings", False)), windows=tuple(windows),
            max_positions=cfg.max_position_embeddings,
            initializer_range=getattr(cfg, "initializer_range", 0.02), rotary=rotary,
            local_rope=local, qk_norm=kind in ("qwen3", "gemma3_text"), gemma=gemma,
            fused=kind == "phi3", act=ACTIVATIONS[act],
            query_scale=cfg.query_pre_attn_scalar ** -0.5 if gemma else head_dim ** -0.5,
            final_softcap=getattr(cfg, "final_logit_softcapping", None))

    @property
    def qkv_rows(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    @property
    def long_rope_from(self) -> int | None:
        """LongRoPE (Phi-3): the position from which the long factors apply; None without it."""
        if self.rope.get("rope_type") != "longrope":
            return None
        return self.rope["original_max_position_embeddings"]

    @property
    def embed_scale(self) -> float | None:
        """Gemma's scale on the embedding row, sqrt(hidden)."""
        return self.hidden ** 0.5 if self.gemma else None


def _rope(params: dict, cfg) -> dict:
    """A rotary embedding's parameters, with its base and original length filled in; a type
    the engine does not implement is refused."""
    rope = dict(params)
    rope.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise EngineUnsupported(f"rope type '{kind}' (the engine has {', '.join(ROPE_TYPES)})")
    rope["rope_type"] = kind
    if kind == "longrope":
        rope.setdefault("original_max_position_embeddings",
                        getattr(cfg, "original_max_position_embeddings", None))
        if rope["original_max_position_embeddings"] is None:
            raise EngineUnsupported("LongRoPE without original_max_position_embeddings")
    return rope


def inverse_frequencies(config: DecoderConfig, rope: dict | None = None,
                        long: bool = False) -> torch.Tensor:
    """Rotary inverse frequencies in float64 of `rope` (the global one by default) over the
    turned dims: Llama 3's wavelength-dependent scaling, linear scaling (Gemma 3's global
    layers), or LongRoPE's per-frequency factors (the long ones where `long`)."""
    r = config.rope if rope is None else rope
    d = config.rotary or config.head_dim
    inv = 1.0 / r["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    kind = r.get("rope_type")
    if kind == "linear":
        return inv / r["factor"]
    if kind == "longrope":
        factors = r["long_factor"] if long else r["short_factor"]
        return inv / torch.tensor(factors, dtype=torch.float64)
    if kind != "llama3":
        return inv
    factor, low, high = r["factor"], r["low_freq_factor"], r["high_freq_factor"]
    old = r["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv
    # Long wavelengths are divided by the factor, short ones kept, the band between blended.
    smooth = (old / wavelength - low) / (high - low)
    blended = (1 - smooth) * inv / factor + smooth * inv
    scaled = torch.where(wavelength > old / low, inv / factor, inv)
    middle = (wavelength <= old / low) & (wavelength >= old / high)
    return torch.where(middle, blended, scaled)


def rotary_scaling(config: DecoderConfig, rope: dict) -> float:
    """LongRoPE's factor on cos and sin (its attention_factor, or transformers' default from
    how far the context was extended); 1 for the other types."""
    if rope.get("rope_type") != "longrope":
        return 1.0
    if rope.get("attention_factor") is not None:
        return rope["attention_factor"]
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or config.max_positions / original
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))


def long_positions(rope: dict, positions: torch.Tensor, prompt: int | None = None):
    """Where LongRoPE's long factors apply. transformers picks one set per forward pass, the
    long one once the sequence is longer than the original length: a decode step at position
    p uses it from p = original on, and a prompt longer than the original uses it at every
    position. (Generation in transformers, and Phi-3's own code, also recompute the cache at
    the step that crosses the original length, so that every cached key turns with the long
    factors: floorline.engine.generate does the same, by a prefill.) None for the other
    types."""
    if rope.get("rope_type") != "longrope":
        return None
    original = rope["original_max_position_embeddings"]
    if prompt is not None and prompt > original:
        return torch.ones_like(positions, dtype=torch.bool)
    return positions >= original


def rotary_table(config: DecoderConfig, rope: dict, positions: torch.Tensor,
                 long: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, turned dims / 2] in fp32, computed in float64; `long` marks the
    positions that take LongRoPE's long factors."""
    inv = inverse_frequencies(config, rope)
    if long is not None:
        inv = torch.where(long[:, None].cpu(), inverse_frequencies(config, rope, long=True), inv)
    angles = positions.cpu().double()[:, None] * inv
    scale = rotary_scaling(config, rope)
    return (angles.cos() * scale).float(), (angles.sin() * scale).float()


# Cached tokens per iteration of the attention kernel at head_dim 128, per cache format. An fp8
# block of 64 tokens is half the bytes of a 16-bit one for the same loop work; on the H200, at
# 131072 tokens of Llama-3.1-8B, 128 ran at 3.0 TB/s against 2.2 (bench/engine_kernels.py --kv fp8).
ATTENTION_BLOCK_T = {"bf16": 64, "fp8": 128}


def attention_block_t(head_dim: int, kv: str = "bf16") -> int:
    """Cached tokens per iteration: a tile of ATTENTION_BLOCK_T[kv] x 128 values, fewer
    tokens for 256-wide heads (Gemma) so that a tile holds as many values."""
    return max(16, ATTENTION_BLOCK_T[kv] * 128 // max(head_dim, 128))
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


VERIFY_MAX = 16  # tokens a verify step checks at once


@dataclass
class Rows:
    """A pass's input tokens, their positions and the buffers their activations pass through.
    m is None for the decode step's own (1-D: one token); else m tokens, [m, ...] each (a
    verify step's, or a prefill chunk's)."""
    m: int | None
    token: torch.Tensor  # int64 [1] or [m]
    pos: torch.Tensor  # int32 [1] or [m]
    h: torch.Tensor  # the fp32 residual stream
    qkv: torch.Tensor
    attn: torch.Tensor
    act: torch.Tensor
    out: torch.Tensor | None  # Gemma: a product's output before its norm joins h
    logits: torch.Tensor | None  # fp32; None: rows whose logits nobody asks for (prefill)
    next: torch.Tensor | None  # int64 [m]: each position's greedy next token

    @classmethod
    def allocate(cls, c: DecoderConfig, dtype, device, m: int | None, token=None,
                 pos=None, head: bool = True) -> Rows:
        """The buffers; without logits and next tokens unless `head`."""
        lead = () if m is None else (m,)

        def buffer(n, kind=dtype):
            return torch.empty(*lead, n, dtype=kind, device=device)
        return cls(m, token if token is not None else torch.zeros(m, dtype=torch.long,
                                                                  device=device),
                   pos if pos is not None else torch.zeros(m, dtype=torch.int32, device=device),
                   buffer(c.hidden, torch.float32), buffer(c.qkv_rows),
                   buffer(c.heads * c.head_dim), buffer(c.intermediate),
                   buffer(c.hidden, torch.float32) if c.gemma else None,
                   buffer(c.vocab, torch.float32) if head else None,
                   None if m is None or not head else torch.zeros(m, dtype=torch.long,
                                                                  device=device))

    def first(self, k: int) -> Rows:
        """The first k rows, as views (the same memory)."""
        return Rows(k, *(None if t is None else t[:k] for t in self._buffers()))

    def singles(self) -> list[Rows]:
        """Each token's row as one-token buffers (views), for the operations that run token by
        token; the decode step's own buffers as they are."""
        if self.m is None:
            return [self]
        return [Rows(None, *(None if t is None else t[j:j + 1] if t.dim() == 1 else t[j]
                             for t in self._buffers())) for j in range(self.m)]

    def _buffers(self) -> tuple:
        return (self.token, self.pos, self.h, self.qkv, self.attn, self.act, self.out,
                self.logits, self.next)


class Decoder:
    """Weights, KV cache, step buffers and the passes (step, verify, prefill) of one batch-1
    stream; `kv` is the cache's format (floorline.engine.kvcache: "bf16", the weights' 16-bit
    dtype, or "fp8")."""

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
        self.k_cache, self.v_cache = self.cache.k, self.cache.v
        # One cos/sin table per rotary embedding (Gemma 3: global, local); each layer's pick.
        self.ropes = [c.rope] + ([c.local_rope] if c.local_rope is not None else [])
        positions = torch.arange(capacity)
        self.tables = [tuple(t.to(device) for t in rotary_table(
            c, r, positions, long_positions(r, positions))) for r in self.ropes]
        self.layer_rope = [int(c.local_rope is not None and w is not None) for w in c.windows]
        self.scale = c.query_scale or c.head_dim ** -0.5
        self.rotary = c.rotary or c.head_dim
        self.block_t = attention_block_t(c.head_dim, kv)
        # Gemma's embedding scale, rounded to the 16-bit dtype as transformers rounds it
        # (bfloat16: sqrt(3840) = 61.97 becomes 62)
        self.embed_scale = (None if c.embed_scale is None
                            else torch.tensor(c.embed_scale, dtype=dtype).item())
        # The step's state and buffers: fixed addresses, so a captured graph reuses them.
        self.token = torch.zeros(1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.int32, device=device)  # the new token's position
        self.one = Rows.allocate(c, dtype, device, None, self.token, self.pos)
        self.logits = self.one.logits
        self.scratch = ops.attention_scratch(c.heads, c.head_dim,
                                             attention_splits(c.kv_heads, device), device)
        self.argmax = partial(ops.argmax, scratch=ops.argmax_scratch(c.vocab, device))
        self.many: Rows | None = None  # verify's buffers, for up to VERIFY_MAX tokens
        self.offsets: torch.Tensor | None = None  # 0 .. VERIFY_MAX - 1: verify's positions

    def step(self) -> None:
        """One decode step on the device: reads token and pos, leaves the next token and pos+1."""
        self._forward(_Step(self, self.one))
        self.sampler(self.logits, self.token, self.argmax)
        self.pos.add_(1)

    def verify_rows(self, k: int) -> Rows:
        """verify's buffers for `k` tokens: views of one set of VERIFY_MAX rows (allocated on
        first use), so that the graph captured for each k keeps its addresses. The caller
        writes the drafted tokens into `.token[1:k]`."""
        if not 1 <= k <= VERIFY_MAX:
            raise FloorlineError(f"a verify step checks 1 to {VERIFY_MAX} tokens, not {k}")
        if self.many is None:
            c, device = self.config, self.token.device
            self.many = Rows.allocate(c, self.w.dtype, device, VERIFY_MAX)
            self.offsets = torch.arange(VERIFY_MAX, dtype=torch.int32, device=device)
        return self.many.first(k)

    def verify(self, k: int) -> Rows:
        """One step over k tokens at once: the current token (at pos) and the k - 1 drafted
        after it (at pos + 1 ..), each reading the cache up to its own position (the causal
        mask among them), each's K and V written to the cache. Leaves every position's logits
        in `.logits[:k]` and its greedy next token in `.next[:k]`; token and pos are unchanged
        (the caller moves them past the tokens it accepts)."""
        rows = self.verify_rows(k)
        rows.token[:1].copy_(self.token)
        torch.add(self.pos, self.offsets[:k], out=rows.pos)
        self._forward(_Step(self, rows))
        for j in range(k):
            self.argmax(rows.logits[j], rows.next[j:j + 1])
        return rows

    def _forward(self, run: _Step | _Chunk) -> None:
        """The decoder, the one place its layer is written: run.rows' tokens through every
        layer, their K and V into the cache, then the head where the rows hold logits. The pass
        `run` supplies the stages: `product` (the ops' gemv contract), and embed, attention and
        post_norm on its rows."""
        c, rows = self.config, run.rows
        run.embed()
        for i, layer in enumerate(self.w.layers):
            run.product(rows.h, layer.wqkv, rows.qkv, norm=layer.ln1, eps=c.eps,
                        bias=layer.bqkv)
            run.attention(i, layer)
            self._add(run, rows.attn, layer.wo, layer.bo, layer.post_attn)
            run.product(rows.h, layer.wgate, rows.act, norm=layer.ln2, eps=c.eps, up=layer.wup,
                        act=c.act)
            self._add(run, rows.act, layer.wdown, None, layer.post_mlp)
        if rows.logits is not None:
            self._head(run.head_product, rows.h, rows.logits)

    def _add(self, run: _Step | _Chunk, x, w, bias, post_norm) -> None:
        """h += W x (+ b), or with a norm after the product (Gemma) h += rmsnorm(W x)."""
        if post_norm is None:
            run.product(x, w, run.rows.h, bias=bias, accumulate=True)
            return
        run.product(x, w, run.rows.out, bias=bias)
        run.post_norm(post_norm)

    def _head(self, product, x: torch.Tensor, logits: torch.Tensor) -> None:
        """logits = Whead . rmsnorm(x) by `product` (the ops' gemv contract), soft-capped where
        the config says."""
        c = self.config
        product(x, self.w.head, logits, norm=self.w.norm, eps=c.eps)
        if c.final_softcap is not None:
            logits.div_(c.final_softcap).tanh_().mul_(c.final_softcap)

    def prefill(self, tokens: torch.Tensor, chunk: int = PREFILL_CHUNK,
                all_logits: bool = False, keep: int = 0) -> torch.Tensor:
        """Run `tokens` (1-D) through the model from position `keep` (the cache's first `keep`
        positions already hold tokens[:keep], as a conversation's earlier turns left them), fill
        the cache, sample the next token into `token`, set `pos`; returns the last position's
        logits (fp32), or with `all_logits` every position's from `keep` on, [n - keep, vocab]
        fp32 on the host (each chunk's by the step's head arithmetic, moved off the device as
        the chunk ends).

        The prompt goes through in chunks of `chunk` tokens, every layer for one chunk before
        the next, in buffers of one chunk's rows, so that activations, products and attention
        scores scale with the chunk and not with the prompt: a chunk's queries attend to the
        cache written so far, read back as it holds them (with an fp8 cache, quantised), so
        that chunking changes nothing."""
        n = tokens.numel()
        if n == 0 or n >= self.capacity:
            raise FloorlineError(f"prefill of {n} tokens into a cache of {self.capacity}")
        if chunk < 1:
            raise FloorlineError(f"prefill chunk must be at least 1 token, got {chunk}")
        if not 0 <= keep < n:
            raise FloorlineError(f"prefill keeping {keep} of {n} tokens: at least one is new")
        every = torch.empty(n - keep, self.config.vocab) if all_logits else None
        rows = Rows.allocate(self.config, self.w.dtype, self.w.device, min(chunk, n - keep),
                             head=all_logits)
        for start in range(keep, n, chunk):
            part = rows.first(min(chunk, n - start))
            part.token.copy_(tokens[start:start + part.m])
            self._forward(_Chunk(self, part, start, n))
            if every is not None:
                every[start - keep:start - keep + part.m] = part.logits.cpu()
        # The last position's logits by the decode step's own head product (fp32 out).
        self._head(self.ops.gemv, part.h[-1], self.logits)
        self.sampler(self.logits, self.token, self.argmax)
        self.pos.fill_(n)
        return every if every is not None else self.logits.clone()


class _Step:
    """The decode step's and verify's stages: the ops (kernels or their references) on the
    rows' fixed buffers. m rows run the products on [m, ...] rows (each weight read once for
    all of them) and attention, embedding and Gemma's post-norms token by token, in position
    order."""

    def __init__(self, decoder: Decoder, rows: Rows):
        self.d, self.rows, self.singles = decoder, rows, rows.singles()
        self.product = self.head_product = decoder.ops.gemv

    def embed(self) -> None:
        for one in self.singles:
            self.d.ops.embed(self.d.w.embed, one.token, one.h, scale=self.d.embed_scale)

    def attention(self, i: int, layer) -> None:
        """q and k normed (Qwen3, Gemma) and rotated, K and V into the cache, attention."""
        d, c = self.d, self.d.config
        cos, sin = d.tables[d.layer_rope[i]]
        for one in self.singles:
            d.ops.attention(one.qkv, d.k_cache[i], d.v_cache[i], cos, sin, one.pos, one.attn,
                            scale=d.scale, window=c.windows[i], scratch=d.scratch,
                            block_t=d.block_t, scales=d.cache.scales(i), q_norm=layer.q_norm,
                            k_norm=layer.k_norm, eps=c.eps, rotary=d.rotary)

    def post_norm(self, weight) -> None:
        """h += rmsnorm(out)."""
        for one in self.singles:
            self.d.ops.add_norm(one.out, weight, one.h, eps=self.d.config.eps)


class _Chunk:
    """A prefill chunk's stages, over its m rows at once (positions start .. start + m - 1 of a
    `prompt`-token prompt), in PyTorch: each product a GEMM in the 16-bit dtype (x normalised
    and rounded to it, a quantised W dequantised to it), attention by SDPA against the cache
    written so far, and the head (every position's logits) in fp32 as the step computes it."""

    head_product = staticmethod(gemv_reference)

    def __init__(self, decoder: Decoder, rows: Rows, start: int, prompt: int):
        self.d, self.rows, self.start, self.end = decoder, rows, start, start + rows.m
        positions = torch.arange(start, self.end)
        self.tables = []  # the chunk's cos and sin per rotary embedding
        for rope, (cos, sin) in zip(decoder.ropes, decoder.tables):
            long = long_positions(rope, positions, prompt)
            if long is not None and bool(long.all()):  # a long prompt takes LongRoPE's long set
                table = rotary_table(decoder.config, rope, positions, long)
                self.tables.append(tuple(t.to(cos.device) for t in table))
            else:
                self.tables.append((cos[start:self.end], sin[start:self.end]))

    def embed(self) -> None:
        self.rows.h.copy_(self.d.w.embed[self.rows.token])
        if self.d.embed_scale is not None:
            self.rows.h.mul_(self.d.embed_scale)

    def product(self, x, w, out, *, norm=None, eps: float = 0.0, up=None, bias=None,
                accumulate: bool = False, act: str = "silu") -> None:
        dtype = self.d.w.dtype
        if norm is not None:
            x = _rms_norm(x, norm, eps)
        y = self.d.ops.chunk_linear(x, self._unpacked(w), bias, dtype)
        if up is not None:  # the gated MLP's, stored
            gate = (torch.nn.functional.silu(y) if act == "silu"
                    else torch.nn.functional.gelu(y, approximate="tanh"))
            torch.mul(gate, self.d.ops.chunk_linear(x, self._unpacked(up), None, dtype),
                      out=out)
        elif accumulate:
            out.add_(y)
        else:
            out.copy_(y)

    def _unpacked(self, w):
        """A quantised W's float32 form where the step's ops keep one (the CPU's, made once: not
        unpacked again for every chunk of every prompt); else W as it is stored."""
        keeps = getattr(self.d.ops, "dense", None)
        return w if keeps is None or isinstance(w, torch.Tensor) else keeps(w)

    def attention(self, i: int, layer) -> None:
        d, c, m, dtype = self.d, self.d.config, self.rows.m, self.d.w.dtype
        q, k, v = self.rows.qkv.split([c.heads * c.head_dim, c.kv_heads * c.head_dim,
                                       c.kv_heads * c.head_dim], dim=-1)
        q, k = q.view(m, c.heads, c.head_dim), k.view(m, c.kv_heads, c.head_dim)
        if layer.q_norm is not None:
            q, k = _rms_norm(q, layer.q_norm, c.eps), _rms_norm(k, layer.k_norm, c.eps)
        cos, sin = self.tables[d.layer_rope[i]]
        q = _rotate(q, cos, sin, d.rotary).to(dtype)
        k = _rotate(k, cos, sin, d.rotary).to(dtype)
        d.cache.write(i, self.start, k.transpose(0, 1),
                      v.view(m, c.kv_heads, c.head_dim).transpose(0, 1))
        o = _chunk_attention(q, *d.cache.read(i, self.end, dtype), self.start, c.windows[i],
                             d.scale)
        self.rows.attn.view(m, c.heads, c.head_dim).copy_(o.transpose(0, 1))

    def post_norm(self, weight) -> None:
        self.rows.h.add_(_rms_norm(self.rows.out, weight, self.d.config.eps))


def _rms_norm(x, weight, eps):
    x = x.float()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(weight.dtype)


def _rotate(x, cos, sin, rotary: int):
    """Rotate-half on the first `rotary` dims of each head (x [m, heads, d]); the rest pass."""
    x = x.float()
    x1, x2 = x[..., :rotary].chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rotary:]], dim=-1)


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
