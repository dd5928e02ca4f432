"""The engine as a user drives it: load, prefill, then one graph replay per token."""

from __future__ import annotations

import torch

from floorline.engine.model import Decoder, DecoderConfig
from floorline.engine.ops import ReferenceOps, TritonOps
from floorline.engine.sampling import Sampler
from floorline.engine.weights import load_checkpoint, random_weights

# Eager steps before capture: they compile the kernels and tune any shape not yet in the table.
CAPTURE_WARMUP_STEPS = 2


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
        ops = TritonOps(self.device) if backend == "triton" else ReferenceOps()
        if weights is None:
            weights = (load_checkpoint(model.weights_dir, self.config, self.device, dtype)
                       if model.has_real_weights
                       else random_weights(self.config, self.device, dtype, seed))
        self.sampler = sampler or Sampler()
        self.decoder = Decoder(self.config, weights, capacity, ops, self.sampler)
        self.graph = None

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
        return self.decoder.prefill(tokens.to(self.device).view(-1))

    def capture(self) -> None:
        """Record one step in a CUDA graph. The warm-up steps run on a side stream and their
        effect on token and position is undone, so the stream goes on from the prefill."""
        d = self.decoder
        token, pos = d.token.clone(), d.pos.clone()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(CAPTURE_WARMUP_STEPS):
                d.step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        d.token.copy_(token)
        d.pos.copy_(pos)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            d.step()

    def step(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.decoder.step()

    def close(self) -> None:
        self.graph = None
        self.decoder = None
