"""Speculative decoding measured on a workload: each prompt's reply generated without
speculation and with it, greedily, the two compared token for token, and the drafter's
acceptance, the tokens a step gives and the decode's ms per token of each."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from floorline.engine.generate import generate
from floorline.engine.speculate import AUTO
from floorline.errors import FloorlineError
from floorline.measure.texts import WORKLOADS


@dataclass
class WorkloadResult:
    workload: str
    drafter: str
    draft_tokens: int | str
    prompts: int
    tokens: int  # new tokens over the prompts, the first of each (the prefill's) left out
    identical: int  # prompts whose reply is the same token for token with speculation
    drafted: int
    accepted: int
    verify_steps: int
    plain_steps: int
    plain_ms_per_token: float  # the decode without speculation, all prompts' tokens together
    ms_per_token: float  # with speculation

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / max(1, self.verify_steps + self.plain_steps)

    @property
    def speedup(self) -> float:
        return self.plain_ms_per_token / self.ms_per_token

    def as_dict(self) -> dict:
        return {**asdict(self), "acceptance": self.acceptance,
                "tokens_per_step": self.tokens_per_step, "speedup": self.speedup}


def measure_workload(model: str, workload: str, draft: str, *, draft_tokens: int | str = AUTO,
                     max_new_tokens: int = 96, **options) -> WorkloadResult:
    """`draft` ('lookup' or a draft model's directory) on every prompt of `workload`, greedy;
    `options` go to generate (device, dtype, weights, ...)."""
    if workload not in WORKLOADS:
        raise FloorlineError(f"unknown workload '{workload}'; workloads: {', '.join(WORKLOADS)}")
    totals = dict(tokens=0, identical=0, drafted=0, accepted=0, verify_steps=0, plain_steps=0)
    plain_ms = spec_ms = 0.0
    plain_tokens = 0
    drafter = draft
    for prompt in WORKLOADS[workload]:
        plain = generate(model, prompt, max_new_tokens=max_new_tokens, **options)
        spec = generate(model, prompt, max_new_tokens=max_new_tokens, draft=draft,
                        draft_tokens=draft_tokens, **options)
        s = spec.speculation
        drafter = s.drafter
        totals["tokens"] += s.tokens
        totals["identical"] += spec.ids == plain.ids
        for key in ("drafted", "accepted", "verify_steps", "plain_steps"):
            totals[key] += getattr(s, key)
        plain_ms += plain.decode_ms
        plain_tokens += plain.steps
        spec_ms += spec.decode_ms
    if not totals["tokens"] or not plain_tokens:
        raise FloorlineError(f"workload '{workload}': every reply ended at its first token, so "
                             "there is no decode to measure")
    return WorkloadResult(workload, drafter, draft_tokens, len(WORKLOADS[workload]),
                          plain_ms_per_token=plain_ms / plain_tokens,
                          ms_per_token=spec_ms / totals["tokens"], **totals)
