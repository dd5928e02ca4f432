"""`engine`: floorline's own runtime (floorline.engine) under the measurement contract, in
16-bit (`engine`), int4 (`engine-int4`: groups of 128 along K, or of 64 or 32 where 128 does not
divide every matrix width) and fp8 (`engine-fp8`) weights, each also with an fp8 LM head
(`-fp8head`) or an fp8 KV cache (`-kvfp8`), and a model directory's GGUF file as it stores its
blocks (`engine-gguf`, its floor the bytes of the file's own types: traffic.engine_gguf_format).
A quantised path's realised reduction is measured against `engine`. Each cell also records
its time to first token, and an int4 cell its group size (its floor counts that group's scales
and zero points: traffic.resolve_weight_format).
With `+verifyK` each timed step is the engine's verify step of K tokens (floorline.engine
.speculate), whose floor is the one-token step's: it reads the same weights and cache."""

from __future__ import annotations

import time

from floorline.models.gguf_checkpoint import gguf_files
from floorline.paths.base import DecodePath, PathFacts, PathUnavailable, Session
from floorline.traffic import engine_kv_format, engine_weight_format


class EngineSession(Session):
    not_static_reason = ("the engine captures its own step in one CUDA graph, and its kernels "
                         "are Triton's, not torch.compile's")

    def __init__(self, engine, device: str, seed: int):
        self.engine, self.device, self.seed = engine, device, seed
        self.timing = {}
        self.drafts: list[int] = []  # +verifyK: the K - 1 tokens each verify step checks

    def verify_tokens(self, k: int) -> None:
        """Time the verify step of k tokens (Engine.verify) in place of the one-token step: the
        current token and k - 1 fixed ones, of which none is kept, so that each step moves one
        position on and reads the cache a one-token step at that position would."""
        import torch

        self.drafts = torch.randint(self.engine.config.vocab, (k - 1,),
                                    generator=torch.Generator().manual_seed(self.seed)).tolist()

    def prefill(self, ctx: int) -> None:
        """The prompt's prefill, timed to its first token read back (after a prefill of two
        tokens, in chunks of one, that compiles the kernels and loads the libraries both kinds
        of chunk use, so that the time is the prefill's and not the process's start-up); then
        the step's capture."""
        import torch

        tokens = torch.randint(self.engine.config.vocab, (ctx,),
                               generator=torch.Generator().manual_seed(self.seed))
        self.engine.decoder.prefill(tokens[:2].to(self.engine.device), chunk=1)
        cuda = self.device.startswith("cuda")
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.engine.prefill(tokens)
        self.engine.token.item()
        ms = (time.perf_counter() - t0) * 1e3
        self.timing = {"prefill_ms": ms, "prefill_tokens_per_s": ctx / ms * 1e3}
        if cuda:
            self.engine.capture()

    def prefill_details(self) -> dict:
        details = dict(self.timing)
        if self.engine.group_size is not None:
            details["group_size"] = self.engine.group_size
        if self.drafts:
            details["verify_tokens"] = len(self.drafts) + 1
        if self.engine.product_plan is not None:  # the routes, alike for a host's cells
            details["cpu_products"] = self.engine.products(trials=False)
            details["cpu_product_trials"] = self.engine.product_plan.trials
        return details

    def window_logits(self, ids):
        """The window prefilled into the cache from position 0, every position's logits through
        the step's head (Decoder.prefill, all_logits): the engine's weights, head and KV cache
        formats, each chunk's attention reading K and V back as the cache stores them."""
        logits = self.engine.decoder.prefill(ids.view(-1).to(self.engine.device),
                                             all_logits=True)
        self.engine.filled = ids.numel()  # as Engine.prefill leaves it
        return logits

    def step(self) -> None:
        if not self.drafts:
            self.engine.step()
            return
        rows = self.engine.verify(self.drafts)
        self.engine.seek(self.engine.filled + 1, rows.next[:1])  # on the device: no wait

    def rewind(self, n: int) -> None:
        # The position moves back on the device, outside the captured step, which reads it.
        self.engine.seek(self.engine.filled - n, self.engine.token)

    def close(self) -> None:
        import torch

        self.engine.close()
        self.engine = None
        if torch.cuda.is_initialized():  # on the CPU, the GPU's driver is never started
            torch.cuda.empty_cache()


class EnginePath(DecodePath):
    sized_by_capacity = False  # attention reads the cache up to the step's position only

    def __init__(self, weights: str = "bf16", head: str = "bf16", kv: str = "bf16"):
        self.weights, self.head, self.kv = weights, head, kv
        # The name and the floor's formats follow from the engine's own formats; a quantised
        # engine is measured against the 16-bit one.
        quantised = (weights, head, kv) != ("bf16", "bf16", "bf16")
        self.facts = PathFacts(
            "engine" + ("" if weights == "bf16" else f"-{weights}")
            + ("-fp8head" if head == "fp8" else "") + ("-kvfp8" if kv == "fp8" else ""),
            "engine-gguf" if weights == "gguf" else engine_weight_format(weights, head),
            engine_kv_format(kv),
            reference="engine" if quantised else None)

    def rewinds(self, model_spec) -> bool:
        return True  # its cache keeps every position, a sliding window's included

    def real_weights(self, model_spec) -> bool:
        if self.weights != "gguf":
            return model_spec.has_real_weights
        return bool(gguf_files(model_spec))

    def unavailable(self, device: str) -> str | None:
        if device.startswith("cuda"):
            try:
                import triton  # noqa: F401
            except ImportError:
                return "the engine's kernels need Triton on a CUDA device (pip install triton)"
            import torch

            fp8 = "fp8" in (self.weights, self.head, self.kv)
            if fp8 and torch.cuda.get_device_capability(torch.device(device)) < (8, 9):
                return "the engine's fp8 kernels need compute capability 8.9 or newer"
        return None

    def versions(self) -> dict:
        from importlib.metadata import PackageNotFoundError, version

        try:  # read from its metadata: importing Triton takes a tenth of a second
            return {"triton": version("triton")}
        except PackageNotFoundError:
            return {}

    def open(self, model_spec, device: str, capacity: int, seed: int) -> Session:
        # The engine loads torch and Triton: imported when a session opens, so that listing
        # or parsing paths stays light.
        from floorline.engine import Engine
        from floorline.engine.model import EngineUnsupported

        try:
            engine = Engine(model_spec, device, capacity, seed=seed, weights=self.weights,
                            head=self.head, kv=self.kv)
        except EngineUnsupported as e:
            raise PathUnavailable(str(e)) from None
        return EngineSession(engine, device, seed)
