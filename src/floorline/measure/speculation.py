"""Speculative decoding measured on a workload: each prompt's reply generated without
speculation and with it, greedily, the two compared token for token, and the drafter's
acceptance, the tokens a step gives and the decode's ms per token of each."""

from __future__ import annotations

from dataclasses import dataclass

from floorline.engine.generate import generate
from floorline.engine.speculate import AUTO, Stats
from floorline.errors import FloorlineError
from floorline.measure.texts import WORKLOADS


@dataclass
class WorkloadResult:
    workload: str
    draft_tokens: int | str
    prompts: int
    identical: int  # prompts whose reply is the same token for token with speculation
    speculation: Stats  # the replies' together; its tokens leave out each prefill's first
    plain_ms_per_token: float  # the decode without speculation, all prompts' tokens together
    ms_per_token: float  # with speculation

    @property
    def speedup(self) -> float:
        return self.plain_ms_per_token / self.ms_per_token

    def as_dict(self) -> dict:
        return {"workload": self.workload, "draft_tokens": self.draft_tokens,
                "prompts": self.prompts, "identical": self.identical,
                **self.speculation.as_dict(), "plain_ms_per_token": self.plain_ms_per_token,
                "ms_per_token": self.ms_per_token, "speedup": self.speedup}


def measure_workload(model: str, workload: str, draft: str, *, draft_tokens: int | str = AUTO,
                     max_new_tokens: int = 96, **options) -> WorkloadResult:
    """`draft` ('lookup' or a draft model's directory) on every prompt of `workload`, greedy;
    `options` go to generate (device, dtype, weights, ...)."""
    if workload not in WORKLOADS:
        raise FloorlineError(f"unknown workload '{workload}'; workloads: {', '.join(WORKLOADS)}")
    total = None
    identical = plain_tokens = 0
    plain_ms = spec_ms = 0.0
    for prompt in WORKLOADS[workload]:
        plain = generate(model, prompt, max_new_tokens=max_new_tokens, **options)
        spec = generate(model, prompt, max_new_tokens=max_new_tokens, draft=draft,
                        draft_tokens=draft_tokens, **options)
        if total is None:
            total = Stats(spec.speculation.drafter)
        total.add(spec.speculation)
        identical += spec.ids == plain.ids
        plain_ms += plain.decode_ms
        plain_tokens += plain.steps
        spec_ms += spec.decode_ms
    if not total.tokens or not plain_tokens:
        raise FloorlineError(f"workload '{workload}': every reply ended at its first token, so "
                             "there is no decode to measure")
    return WorkloadResult(workload, draft_tokens, len(WORKLOADS[workload]), identical, total,
                          plain_ms / plain_tokens, spec_ms / total.tokens)
