"""Speculative decoding: a drafter proposes the next few tokens, one verify step of the target
model checks them all (Engine.verify), and every token up to the first the target disagrees
with is kept, plus the target's own token at that point. At batch 1 a verify step of k tokens
reads the same weights as a step of one, so each accepted draft is a token for almost nothing.

Verification keeps the target's output distribution exactly. Greedy: a draft is kept where it
is the target's argmax, so the tokens are those of plain greedy decoding. Sampling: both
drafters here are deterministic (the proposal puts all its mass on the drafted token d), and
the standard rejection rule then reads: keep d with probability p(d); on rejection draw from p
with d removed, renormalised; after the last kept draft, draw a bonus token from p. Each
emitted token is distributed as the target's sampler would draw it (Leviathan et al. 2023,
"Fast inference from transformers via speculative decoding", theorem 1, with a one-hot q).

Drafters:
- PromptLookup: the tokens that followed the latest earlier occurrence of the context's last
  n-gram (n from 3 down to 1), from an index kept up to date as tokens arrive; no weights.
- DraftModel: a smaller model with the target's vocabulary, decoding greedily in an engine of
  its own, kept in step with the tokens the target accepts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from floorline.engine.model import VERIFY_MAX
from floorline.engine.runtime import Engine
from floorline.engine.sampling import Sampler
from floorline.errors import FloorlineError

AUTO = "auto"  # draft length chosen from the acceptance so far


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens two sequences share from their start."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PromptLookup:
    """Drafts by n-gram lookup in the context so far (prompt and reply)."""

    name = "lookup"

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram
        self.start_prompt([])

    def start_prompt(self, prompt: list[int]) -> None:
        # per n, each n-gram's latest continuation; n-grams ending before `indexed` are in
        self.index: list[dict[tuple, int]] = [{} for _ in range(self.max_ngram + 1)]
        self.indexed = 0

    def draft(self, context: list[int], count: int) -> list[int]:
        """Up to `count` tokens that followed the latest earlier occurrence of the longest
        n-gram that ends the context; none where no n-gram recurs."""
        # every n-gram that ends before the last token: where its continuation starts
        for end in range(max(self.indexed, 1), len(context)):
            for n in range(1, min(self.max_ngram, end) + 1):
                self.index[n][tuple(context[end - n:end])] = end
        self.indexed = max(self.indexed, len(context))
        for n in range(min(self.max_ngram, len(context)), 0, -1):
            at = self.index[n].get(tuple(context[-n:]))
            if at is not None:
                return context[at:at + count]
        return []

    def accepted(self, context: list[int]) -> None:
        """The context after a verify step (nothing to keep in step)."""


class DraftModel:
    """Drafts with a smaller model run greedily by its own engine. Its cache holds the context
    but its last token, which is its next input, as the target's does."""

    def __init__(self, engine: Engine, name: str):
        if not engine.sampler.greedy:
            raise FloorlineError("the draft model decodes greedily")
        self.engine, self.name = engine, f"draft:{name}"
        self.start, self.fed = 0, []  # where the last draft began, and the inputs it fed

    def start_prompt(self, prompt: list[int]) -> None:
        self.engine.prefill(torch.tensor(prompt))
        self.start, self.fed = len(prompt), []
        if self.engine.device.type == "cuda":
            self.engine.capture()

    def draft(self, context: list[int], count: int) -> list[int]:
        e = self.engine
        self.start, self.fed = e.filled, [context[-1]]
        drafted = []
        for _ in range(min(count, e.decoder.capacity - e.filled - 1)):
            e.step()
            drafted.append(e.token.item())
            self.fed.append(drafted[-1])
        self.fed.pop()  # the last draft was never an input
        return drafted

    def accepted(self, context: list[int]) -> None:
        """Back in step with the target: the context but its last token in the cache. The
        kept drafts are there already; what the cache lacks (the context's token before the
        target's own, where every draft was kept) is stepped in."""
        e = self.engine
        needed = context[self.start:-1]
        for i in range(common_prefix(needed, self.fed), len(needed)):
            e.seek(self.start + i, needed[i])
            e.step()
        e.seek(len(context) - 1, context[-1])
        self.start, self.fed = len(context) - 1, []


@dataclass
class Stats:
    """What speculation did over a reply."""
    drafter: str
    verify_steps: int = 0  # verify steps with at least one draft
    plain_steps: int = 0  # steps with no draft to check
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0  # tokens the steps gave the reply (none past its end)

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_step(self) -> float | None:
        steps = self.verify_steps + self.plain_steps
        return self.tokens / steps if steps else None

    def record(self, drafted: int, kept: int, delivered: int) -> None:
        """A step: `drafted` tokens checked (0: a plain step), `kept` of them accepted,
        `delivered` tokens given to the reply."""
        if drafted:
            self.verify_steps += 1
        else:
            self.plain_steps += 1
        self.drafted += drafted
        self.accepted += kept
        self.tokens += delivered

    def add(self, other: Stats) -> None:
        """Another reply's counts added to these."""
        for name in ("verify_steps", "plain_steps", "drafted", "accepted", "tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict:
        return {**asdict(self), "acceptance": self.acceptance,
                "tokens_per_step": self.tokens_per_step}

    def summary(self) -> str:
        rate = "-" if self.acceptance is None else f"{self.acceptance:.0%}"
        per = "-" if self.tokens_per_step is None else f"{self.tokens_per_step:.2f}"
        return (f"speculation ({self.drafter}): {per} tokens a step, {self.accepted} of "
                f"{self.drafted} drafted tokens kept ({rate}) over {self.verify_steps} verify "
                f"and {self.plain_steps} plain steps")


def check_draft_tokens(setting: int | str) -> int | str:
    """A draft length as given (1 to VERIFY_MAX - 1, or AUTO), refused otherwise."""
    if setting != AUTO and (not isinstance(setting, int) or not 1 <= setting < VERIFY_MAX):
        raise FloorlineError(f"draft tokens (--draft-tokens) must be 1 to {VERIFY_MAX - 1} or "
                             f"'{AUTO}', not {setting!r}")
    return setting


class DraftLength:
    """Drafts per verify step: fixed, or (auto) twice the mean run of kept drafts so far plus
    one, so that a drafter that is often right is given room and one that is not costs little;
    at most VERIFY_MAX - 1."""

    def __init__(self, setting: int | str):
        self.setting = check_draft_tokens(setting)
        self.runs: list[int] = []

    def next(self) -> int:
        if self.setting != AUTO:
            return self.setting
        if not self.runs:
            return 4
        mean = sum(self.runs[-16:]) / len(self.runs[-16:])
        return max(1, min(VERIFY_MAX - 1, math.ceil(2 * mean) + 1))

    def kept(self, run: int) -> None:
        self.runs.append(run)


def verify_greedy(predicted: list[int], drafts: list[int]) -> list[int]:
    """The tokens a greedy verify step emits: the drafts while each is the target's argmax,
    then the target's own token (predicted[j] follows input j)."""
    out = []
    for j, d in enumerate(drafts):
        if predicted[j] != d:
            break
        out.append(d)
    return out + [predicted[len(out)]]


def verify_sampled(probs: torch.Tensor, drafts: list[int],
                   generator: torch.Generator | None = None) -> list[int]:
    """The rejection rule for deterministic drafts (module docstring): probs [k, vocab] are the
    target's sampling distributions after each input, drafts the k - 1 drafted tokens."""
    k = len(drafts)
    if k:
        d = torch.tensor(drafts, device=probs.device)
        chance = probs[torch.arange(k, device=probs.device), d]
        u = torch.rand(k, device=probs.device, generator=generator)
        kept = (u < chance).int().cumprod(0)
        n = int(kept.sum())
    else:
        n = 0
    p = probs[n]
    if n < k:
        p = p.clone()
        p[drafts[n]] = 0.0
        if float(p.sum()) <= 0:  # p put all its mass on the rejected draft: cannot happen
            raise FloorlineError("the rejection rule drew from an empty distribution")
    token = int(torch.multinomial(p, 1, generator=generator))
    return drafts[:n] + [token]


def drafter_for(draft: str, make_engine) -> PromptLookup | DraftModel:
    """'lookup', or a draft model's checkpoint directory (make_engine(path) builds its
    engine)."""
    if draft == PromptLookup.name:
        return PromptLookup()
    return DraftModel(make_engine(draft), draft)


class Speculator:
    """The decode steps of one stream with speculation: each step drafts what fits, verifies
    it (or, with nothing drafted, takes a plain step) and keeps the drafter in step with the
    tokens the reply kept. `seed` seeds the rejection rule's draws when sampling."""

    def __init__(self, engine: Engine, drafter, sampler: Sampler, draft_tokens: int | str,
                 seed: int):
        self.engine, self.drafter, self.sampler = engine, drafter, sampler
        self.length = DraftLength(draft_tokens)
        self.stats = Stats(drafter.name)
        self.generator = None
        if not sampler.greedy:
            self.generator = torch.Generator(device=engine.device).manual_seed(seed)
        self.drafted = 0

    def start(self, prompt: list[int], first: int) -> None:
        """After the engine's prefill of `prompt`, which gave the token `first`."""
        self.drafter.start_prompt(prompt)
        self.drafter.accepted(prompt + [first])

    def step(self, context: list[int], room: int) -> list[int]:
        """One step after `context` (the engine's next input its last token), drafting at most
        `room` tokens: the tokens it emits, the engine moved past them."""
        e = self.engine
        room = max(0, min(room, self.length.next(), e.decoder.capacity - e.filled - 1))
        drafts = self.drafter.draft(context, room)[:room]
        self.drafted = len(drafts)
        if not drafts:
            e.step()
            return [e.token.item()]
        rows = e.verify(drafts)
        k = len(drafts) + 1
        if self.sampler.greedy:
            emitted = verify_greedy(rows.next[:k].tolist(), drafts)
        else:
            emitted = verify_sampled(self.sampler.probabilities(rows.logits[:k]), drafts,
                                     self.generator)
        e.seek(e.filled + len(emitted), emitted[-1])
        self.length.kept(len(emitted) - 1)
        return emitted

    def kept(self, context: list[int], emitted: int, delivered: int, more: bool) -> None:
        """The reply took `delivered` of the last step's `emitted` tokens and is now `context`;
        `more`: whether it goes on (the drafter is then brought in step with it)."""
        self.stats.record(self.drafted, emitted - 1, delivered)
        if more:
            self.drafter.accepted(context)
