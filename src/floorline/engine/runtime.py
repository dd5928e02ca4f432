"""The engine as a user drives it: load, prefill, then one graph replay per token."""

from __future__ import annotations

import torch

from floorline.engine.model import Decoder, DecoderConfig
from floorline.engine.ops import ReferenceOps, TritonOps
from floorline.engine.sampling import Sampler
from floorline.engine.weights import load_checkpoint, random_weights
from floorline.errors import FloorlineError


class Engine:
    """One batch-1 stream of `model` (a floorline ModelSpec) on `device`.

    backend: "triton" (the kernels; the default on CUDA) or "reference" (PyTorch; the default on
    the CPU). On CUDA, capture() records one step in a CUDA graph and step() replays it.
    """

    def __init__(self, model, device: str, capacity: int, *, seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16, backend: str | None = None,
                 sampler: Sampler | None = None, weights=None):
        self.config = DecoderConfig.from_hf(model.config)
        self.device = torch.device(device)
        backend = backend or ("triton" if self.device.type == "cuda" else "reference")
        if backend not in ("triton", "reference"):
            raise FloorlineError(f"engine backend must be 'triton' or 'reference', not '{backend}'")
        ops = TritonOps(self.device) if backend == "triton" else ReferenceOps()
        if weights is None:
            weights = (load_checkpoint(model.weights_dir, self.config, self.device, dtype)
                       if model.has_real_weights
                       else random_weights(self.config, self.device, dtype, seed))
        self.sampler = sampler or Sampler()
        self.decoder = Decoder(self.config, weights, capacity, ops, self.sampler)
        self.graph = None
        self.filled = 0  # tokens in the cache, kept on the host too: a step past the end is refused

    @property
    def ops(self):
        return self.decoder.ops

    @property
    def position(self) -> torch.Tensor:
        return self.decoder.pos

    @property
    def token(self) -> torch.Tensor:
        return self.decoder.token

    @property
    def logits(self) -> torch.Tensor:
        return self.decoder.logits

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.decoder.prefill(tokens.to(self.device).view(-1))
        self.filled = tokens.numel()
        return logits

    def _room(self) -> None:
        if self.filled >= self.decoder.capacity:
            raise FloorlineError(f"the cache of {self.decoder.capacity} tokens is full: no room "
                                 "for a step")

    def capture(self) -> None:
        """Record one step in a CUDA graph. One eager step first, on a side stream, compiles the
        kernels and tunes any shape not yet in the table; its effect on token, position and the
        CUDA generator (sampling draws from it) is undone, so the stream goes on from the
        prefill, and the slot it wrote in the cache is the one the first replay writes."""
        d = self.decoder
        self._room()
        token, pos = d.token.clone(), d.pos.clone()
        with torch.cuda.device(self.device):
            rng = torch.cuda.get_rng_state()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                d.step()
            torch.cuda.current_stream().wait_stream(side)
            d.token.copy_(token)
            d.pos.copy_(pos)
            torch.cuda.set_rng_state(rng)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                d.step()

    def step(self) -> None:
        self._room()
        self.filled += 1
        if self.graph is not None:
            self.graph.replay()
        else:
            self.decoder.step()

    def close(self) -> None:
        self.graph = None
        self.decoder = None
