"""transformers' own decode: `hf-eager` (DynamicCache, the study's setup) and `hf-static`."""

from __future__ import annotations

import gc

from floorline.models import build_model, cache_keyword
from floorline.paths.base import DecodePath, PathFacts, Session
from floorline.traffic import kv_layout


class HFSession(Session):
    def __init__(self, hf_model, cache, device: str, seed: int, not_static_reason: str | None):
        self.hf_model, self.cache, self.device, self.seed = hf_model, cache, device, seed
        self.not_static_reason = not_static_reason
        self.forward = hf_model.forward
        self.cache_keyword = cache_keyword(hf_model)
        self._recompile_guard = None

    def prefill(self, ctx: int) -> None:
        import torch

        vocab = self.hf_model.config.get_text_config().vocab_size
        tokens = torch.randint(vocab, (1, ctx), generator=torch.Generator().manual_seed(self.seed))
        tokens = tokens.to(self.device)
        out = self.hf_model(input_ids=tokens, **{self.cache_keyword: self.cache}, use_cache=True,
                         cache_position=torch.arange(ctx, device=self.device), logits_to_keep=1)
        # The step's only inputs and outputs: fixed buffers, updated in place.
        self.token = out.logits[:, -1:].argmax(-1)
        self.position = torch.tensor([ctx], device=self.device)

    def step(self) -> None:
        out = self.forward(input_ids=self.token, **{self.cache_keyword: self.cache},
                           use_cache=True, cache_position=self.position,
                           position_ids=self.position.unsqueeze(0))
        self.token.copy_(out.logits[:, -1:].argmax(-1))  # greedy sampling, on the device
        self.position.add_(1)

    def rewind(self, n: int) -> None:
        from transformers import DynamicCache

        if isinstance(self.cache, DynamicCache):
            self.cache.crop(-n)  # its tensors' length is where it writes next
        else:
            # A static layer writes at its own count of tokens (transformers 5.17 on), a tensor
            # that a captured or compiled step reads: moved back in place; earlier versions
            # write at the step's cache_position.
            for layer in self.cache.layers:
                length = getattr(layer, "cumulative_length", None)
                if length is not None:
                    length.sub_(n)
        self.position.sub_(n)

    def window_logits(self, ids):
        """The model's own forward over the window, without a cache, in the session's dtype."""
        out = self.hf_model(input_ids=ids.view(1, -1).to(self.device), use_cache=False)
        return out.logits[0].float().cpu()

    def compile(self, mode: str) -> None:
        import torch

        self.forward = torch.compile(self.hf_model.forward, mode=mode, fullgraph=True,
                                     dynamic=False)
        # A recompile would silently run a different program than the one named: make it fail.
        self._recompile_guard = torch._dynamo.config.patch(error_on_recompile=True)
        self._recompile_guard.__enter__()

    def close(self) -> None:
        import torch

        if self._recompile_guard is not None:
            self._recompile_guard.__exit__(None, None, None)
            torch._dynamo.reset()
        self.hf_model = self.cache = self.forward = self.token = self.position = None
        gc.collect()
        if torch.cuda.is_initialized():  # on the CPU, the GPU's driver is never started
            torch.cuda.empty_cache()


class HFPath(DecodePath):
    FACTS = {"dynamic": PathFacts("hf-eager", dtype="bfloat16"),
             "static": PathFacts("hf-static", dtype="bfloat16")}

    def __init__(self, cache: str):
        self.cache_kind = cache
        self.facts = self.FACTS[cache]

    def rewinds(self, model_spec) -> bool:
        # a sliding-window layer past its window has dropped the tokens a rewind goes back to
        _, windows = kv_layout(model_spec.config)
        return all(w is None for w in windows)

    def build(self, model_spec, device: str, seed: int):
        """The transformers model this path decodes with."""
        import torch

        return build_model(model_spec, device, getattr(torch, self.facts.dtype), seed)

    def open(self, model_spec, device: str, capacity: int, seed: int) -> Session:
        from transformers import DynamicCache, StaticCache

        hf_model = self.build(model_spec, device, seed)
        if self.cache_kind == "dynamic":
            cache = DynamicCache(config=hf_model.config)
            return HFSession(hf_model, cache, device, seed,
                             "DynamicCache grows its tensors by one token every step")
        cache = StaticCache(config=hf_model.config, max_cache_len=capacity)
        _, windows = kv_layout(hf_model.config)
        not_static_reason = None
        if any(w is not None for w in windows):
            not_static_reason = ("transformers' static sliding-window layers count tokens in a "
                                 "Python int, which a graph or a compiled step would freeze")
        return HFSession(hf_model, cache, device, seed, not_static_reason)
