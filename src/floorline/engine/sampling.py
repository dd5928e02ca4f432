"""Choosing the next token on the device, inside the captured step: greedy, or temperature
with nucleus (top-p) sampling."""

from __future__ import annotations

import math

import torch

from floorline.engine.kernels.tokens import argmax_reference


class Sampler:
    def __init__(self, temperature: float = 0.0, top_p: float = 1.0):
        if not math.isfinite(temperature):  # nan passes the comparison below, inf would too
            raise ValueError(f"temperature must be a finite number, got {temperature}")
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
        self.temperature, self.top_p = temperature, top_p

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def __call__(self, logits: torch.Tensor, token: torch.Tensor,
                 argmax=argmax_reference) -> None:
        """logits [vocab] fp32 -> token [1] int64, in place. `argmax(values, token, index=)`
        writes the index of the largest value (or index[it]): the engine's kernel, or PyTorch."""
        if self.greedy:
            argmax(logits, token)
            return
        probs, order = self._nucleus(logits)
        # Exponential race: argmax p_i / E_i with E_i ~ Exp(1) picks i with probability
        # p_i / sum p; no host round trip, and the draw comes from torch's CUDA generator,
        # which a graph replay advances.
        race = probs / torch.empty_like(probs).exponential_()
        argmax(race, token, index=order)

    def _nucleus(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tempered probabilities sorted, those outside the nucleus zeroed (not
        renormalised), and the vocabulary order they are in; over the last dimension."""
        probs = torch.softmax(logits / self.temperature, dim=-1)
        probs, order = torch.sort(probs, dim=-1, descending=True)
        # The smallest prefix whose mass reaches top_p (the first token always stays).
        return probs * ((probs.cumsum(-1) - probs) < self.top_p), order

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution this sampler draws from, per row of `logits` [..., vocab]: one-hot
        at the argmax when greedy, else tempered and cut to the nucleus, renormalised."""
        if self.greedy:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        probs, order = self._nucleus(logits)
        probs = probs / probs.sum(-1, keepdim=True)
        return torch.empty_like(probs).scatter_(-1, order, probs)
