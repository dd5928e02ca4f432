"""`engine`: floorline's own runtime (floorline.engine) under the measurement contract, in
16-bit (`engine`), int4 (`engine-int4`, group 128) and fp8 (`engine-fp8`) weights, each also with
an fp8 LM head (`-fp8head`). A quantised path's realised reduction is measured against `engine`."""

from __future__ import annotations

from floorline.paths.base import Path, PathUnavailable, Session
from floorline.traffic import engine_weight_format


class EngineSession(Session):
    not_static = ("the engine captures its own step in one CUDA graph, and its kernels are "
                  "Triton's, not torch.compile's")

    def __init__(self, engine, device: str, seed: int):
        self.engine, self.device, self.seed = engine, device, seed

    def prefill(self, ctx: int) -> None:
        import torch

        tokens = torch.randint(self.engine.config.vocab, (ctx,),
                               generator=torch.Generator().manual_seed(self.seed))
        self.engine.prefill(tokens)
        if self.device.startswith("cuda"):
            self.engine.capture()

    def step(self) -> None:
        self.engine.step()

    def close(self) -> None:
        import torch

        self.engine.close()
        self.engine = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class EnginePath(Path):
    def __init__(self, weights: str = "bf16", head: str = "bf16"):
        self.weights, self.head = weights, head
        self.name = "engine" + ("" if weights == "bf16" else f"-{weights}") + \
            ("-fp8head" if head == "fp8" else "")
        if weights != "bf16" or head != "bf16":
            self.reference = "engine"
            self.weight_format = engine_weight_format(weights, head)

    def unavailable(self, device: str) -> str | None:
        if device.startswith("cuda"):
            try:
                import triton  # noqa: F401
            except ImportError:
                return "the engine's kernels need Triton on a CUDA device (pip install triton)"
            import torch

            fp8 = "fp8" in (self.weights, self.head)
            if fp8 and torch.cuda.get_device_capability(torch.device(device)) < (8, 9):
                return "the engine's fp8 kernels need compute capability 8.9 or newer"
        return None

    def versions(self) -> dict:
        try:
            import triton
        except ImportError:
            return {}
        return {"triton": triton.__version__}

    def open(self, model, device: str, capacity: int, seed: int) -> Session:
        from floorline.engine import Engine
        from floorline.engine.model import EngineUnsupported

        try:
            engine = Engine(model, device, capacity, seed=seed, weights=self.weights,
                            head=self.head)
        except EngineUnsupported as e:
            raise PathUnavailable(str(e)) from None
        return EngineSession(engine, device, seed)
