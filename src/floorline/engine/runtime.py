"""The engine as a user drives it: load, prefill, then one graph replay per token."""

from __future__ import annotations

import torch

from floorline import graphs
from floorline.engine.cpu import CpuOps
from floorline.engine.cpu_products import plan_products
from floorline.engine.gguf_blocks import load_gguf
from floorline.engine.kernels.attention import build_problem as attention_build_problem
from floorline.engine.kvcache import check_format
from floorline.engine.model import (
    VERIFY_MAX,
    Decoder,
    DecoderConfig,
    EngineUnsupported,
    Rows,
    attention_block_t,
)
from floorline.engine.ops import ReferenceOps, TritonOps
from floorline.engine.quant import FORMATS, HEAD_FORMATS, Int4Weight, format_of
from floorline.engine.sampling import Sampler
from floorline.engine.weights import int4_group, load_checkpoint, random_weights
from floorline.errors import FloorlineError
from floorline.models.gguf_checkpoint import model_gguf
from floorline.models.zoo import quantisation_config

BACKENDS = ("triton", "cpu", "reference")


class Engine:
    """One batch-1 stream of `model` (a floorline ModelSpec) on `device`.

    backend: "triton" (the kernels; the default on CUDA), "cpu" (the CPU's fast step,
    floorline.engine.cpu; the default elsewhere) or "reference" (the PyTorch references the
    kernels are tested against). On CUDA, capture() records one step in a CUDA graph and step()
    replays it.
    weights: the decoder linears' format, "bf16" (the 16-bit `dtype`), "int4" or "fp8", or
    "gguf": the model directory's GGUF file, each matrix and the LM head in its blocks as stored
    (floorline.engine.gguf_blocks); None runs a checkpoint in its own format (16-bit for random
    weights). group_size: int4's group
    along K, 128, 64 or 32; None takes a packed checkpoint's own, or else the largest that
    divides every matrix width (`self.group_size` is the one that runs, None if not int4).
    head: the LM head's, "bf16" (16-bit) or "fp8". kv: the KV cache's, "bf16" (the 16-bit
    `dtype`) or "fp8" (e4m3, a scale per token and head). `decoder_weights` skips loading.
    """

    def __init__(self, model_spec, device: str, capacity: int, *, seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16, backend: str | None = None,
                 sampler: Sampler | None = None, weights: str | None = None,
                 head: str = "bf16", kv: str = "bf16", group_size: int | None = None,
                 decoder_weights=None):
        if weights is not None and weights not in FORMATS:
            raise FloorlineError(f"engine weights must be one of {', '.join(FORMATS)}, not "
                                 f"'{weights}'")
        if head not in HEAD_FORMATS:
            raise FloorlineError(f"engine head must be one of {', '.join(HEAD_FORMATS)}, not "
                                 f"'{head}'")
        check_format(kv)
        self.config = DecoderConfig.from_hf(model_spec.config)
        quantization = (quantisation_config(model_spec.config) if model_spec.has_real_weights
                        else None)
        if weights == "int4" and quantization is None and decoder_weights is None:
            # quantised here (a packed checkpoint keeps its own group): refused before loading
            try:
                group_size = int4_group(self.config, group_size)
            except ValueError as e:
                raise EngineUnsupported(str(e)) from None
        self.device = torch.device(device)
        backend = backend or ("triton" if self.device.type == "cuda" else "cpu")
        if backend not in BACKENDS:
            raise FloorlineError(f"engine backend must be one of {', '.join(BACKENDS)}, not "
                                 f"'{backend}'")
        if backend == "triton":  # refused here, not by the compiler at the first step
            problem = attention_build_problem(self.config.head_dim, kv, dtype,
                                              attention_block_t(self.config.head_dim, kv))
            if problem:
                raise EngineUnsupported(problem)
        formats = dict(head=head, group_size=group_size)
        if decoder_weights is None and weights == "gguf":
            decoder_weights = self._stored(model_spec, head, group_size, dtype)
        elif decoder_weights is None and model_spec.has_real_weights:
            decoder_weights = load_checkpoint(model_spec.weights_dir, self.config, self.device,
                                              dtype, weights=weights, quantization=quantization,
                                              **formats)
        elif decoder_weights is None:
            decoder_weights = random_weights(self.config, self.device, dtype, seed,
                                             weights=weights or "bf16", **formats)
        if backend == "triton":
            ops = TritonOps(self.device, precise=dtype == torch.float32)
        elif backend == "cpu":  # each product's route timed on these weights
            ops = CpuOps(plan_products(decoder_weights))
        else:
            ops = ReferenceOps()
        self.sampler = sampler or Sampler()
        self.decoder = Decoder(self.config, decoder_weights, capacity, ops, self.sampler, kv)
        self.kv = kv
        wdown = decoder_weights.layers[0].wdown
        self.weights = format_of(wdown)  # the formats that run
        self.group_size = wdown.group_size if isinstance(wdown, Int4Weight) else None
        self.head = format_of(decoder_weights.head)
        self.graph = None
        self.graphs: dict[tuple, object] = {}  # other samplers' captured steps (use_sampler)
        self.verify_graphs: dict[int, object] = {}  # CUDA: the verify step of k tokens, by k
        self.filled = 0  # tokens in the cache, kept on the host too: a step past the end is refused

    def _stored(self, model_spec, head: str, group_size: int | None, dtype):
        """The weights of the model directory's GGUF file, as stored."""
        if head != "bf16" or group_size is not None:
            raise FloorlineError("gguf weights run the file's own LM head and blocks: no head "
                                 "format or group size is chosen for them")
        try:
            path = model_gguf(model_spec)
        except FloorlineError as e:
            raise EngineUnsupported(str(e)) from None
        return load_gguf(path, self.config, self.device, dtype)

    @property
    def ops(self):
        return self.decoder.ops

    @property
    def product_plan(self):
        """The CPU step's timed routes for its 16-bit products (cpu_products.ProductPlan); None
        where no route was timed: on a GPU, the reference, or a model in fp32."""
        if not isinstance(self.ops, CpuOps) or not self.ops.plan.trials:
            return None
        return self.ops.plan

    def products(self, trials: bool = True) -> str | None:
        """product_plan in a line for a user, with the trials' times or not."""
        plan = self.product_plan
        return None if plan is None else plan.describe(self.decoder.w.dtype, trials)

    @property
    def position(self) -> torch.Tensor:
        return self.decoder.pos

    @property
    def token(self) -> torch.Tensor:
        return self.decoder.token

    @property
    def logits(self) -> torch.Tensor:
        return self.decoder.logits

    def prefill(self, tokens: torch.Tensor, keep: int = 0) -> torch.Tensor:
        """The prompt `tokens` into the cache, from position `keep` (Decoder.prefill)."""
        logits = self.decoder.prefill(tokens.to(self.device).view(-1), keep=keep)
        self.filled = tokens.numel()
        return logits

    def use_sampler(self, sampler: Sampler) -> None:
        """Sample with `sampler` from the next step on. On CUDA each sampler's step is captured
        once (its temperature and top-p are part of the graph) and kept for when it is used
        again."""
        key = (sampler.temperature, sampler.top_p)
        if key == (self.sampler.temperature, self.sampler.top_p):
            return
        self.graphs[(self.sampler.temperature, self.sampler.top_p)] = self.graph
        self.sampler = self.decoder.sampler = sampler
        self.graph = self.graphs.pop(key, None)

    def _room(self, tokens: int = 1) -> None:
        capacity = self.decoder.capacity
        if self.filled >= capacity:
            raise FloorlineError(f"the cache of {capacity} tokens is full: no room for a step")
        if self.filled + tokens > capacity:
            raise FloorlineError(f"the cache of {capacity} tokens holds {self.filled}: no room "
                                 f"for a verify step of {tokens}")

    def capture(self) -> None:
        """Record one step in a CUDA graph. One eager step first compiles the kernels and tunes
        any shape not yet in the table; its effect on token, position and the CUDA generator
        (sampling draws from it) is undone, so the stream goes on from the prefill, and the slot
        it wrote in the cache is the one the first replay writes."""
        d = self.decoder
        self._room()
        token, pos = d.token.clone(), d.pos.clone()
        with torch.cuda.device(self.device):
            rng = torch.cuda.get_rng_state()

            def reset() -> None:
                d.token.copy_(token)
                d.pos.copy_(pos)
                torch.cuda.set_rng_state(rng)
            self.graph = graphs.capture(d.step, reset=reset)

    def step(self) -> None:
        self._room()
        self.filled += 1
        if self.graph is not None:
            self.graph.replay()
        else:
            self.decoder.step()

    def verify(self, drafts: list[int]) -> Rows:
        """One step over the current token and `drafts` after it (Decoder.verify): returns its
        rows, each position's logits and greedy next token. On CUDA each k's step is captured
        in a graph on first use, after one eager run that compiles and tunes its kernels (a
        verify step moves neither token nor position, and the cache slots it wrote are
        written again by the replay)."""
        k = len(drafts) + 1
        blocks = sorted({self.weights, self.head} & {"q4_1", "q8_0"})
        if blocks and isinstance(self.ops, TritonOps):
            raise EngineUnsupported(f"the GPU's verify step does not yet run GGUF "
                                    f"{' or '.join(b.upper() for b in blocks)} blocks as stored")
        rows = self.decoder.verify_rows(k)
        self._room(k)
        if drafts:
            rows.token[1:].copy_(torch.tensor(drafts, dtype=torch.long))
        if self.device.type != "cuda":
            return self.decoder.verify(k)
        self._verify_graph(k).replay()
        return rows

    def _verify_graph(self, k: int):
        """The CUDA graph of the verify step of k tokens, captured on first use."""
        if k not in self.verify_graphs:
            self.decoder.verify_rows(k)
            with torch.cuda.device(self.device):
                self.verify_graphs[k] = graphs.capture(lambda: self.decoder.verify(k))
        return self.verify_graphs[k]

    def capture_verify(self) -> None:
        """On CUDA, capture now the graph of every verify step (2 to VERIFY_MAX tokens) that fits
        the cache, so that no later step pays for its capture (generate does this before it
        times the decode). Nothing moves: a verify step moves neither token nor position."""
        if self.device.type != "cuda":
            return
        for k in range(2, min(VERIFY_MAX, self.decoder.capacity - self.filled) + 1):
            self._verify_graph(k)

    def seek(self, filled: int, token: int | torch.Tensor) -> None:
        """Go on from the cache's first `filled` tokens with `token` (or a [1] tensor on the
        device holding it) as the next input: after a verify step, past the tokens it
        accepted (the slots after them are written again as the stream goes on)."""
        if not 0 < filled < self.decoder.capacity:
            raise FloorlineError(f"cannot go on from {filled} tokens in a cache of "
                                 f"{self.decoder.capacity}")
        self.filled = filled
        self.decoder.pos.fill_(filled)
        if isinstance(token, torch.Tensor):
            self.decoder.token.copy_(token)
        else:
            self.decoder.token.fill_(token)

    def close(self) -> None:
        self.graph = None
        self.graphs = {}
        self.verify_graphs = {}
        self.decoder = None
