"""The records a measurement produces and the database keeps: a cell's key and its result."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from floorline.timing import StepPlan

VALID = "valid"
INVALID = "invalid"
# Measured, its figures kept, but its steps were not steady (measure/steadiness.py): reported
# beside the valid cells, left out of every figure, fit and headline, and measured again by the
# next sweep (which skips only valid cells).
UNSTEADY = "unsteady"
AUTO = "auto"
# A path whose quality is another's: hf-static builds transformers' model as hf-eager does and
# scores a window by the same forward (only the decode's cache differs, which that forward does
# not use), so a sweep measures their quality once, as hf-eager's, and shows it beside both.
SAME_QUALITY = {"hf-static": "hf-eager"}


@dataclass(frozen=True)
class CellKey:
    model: str
    ctx: int
    path: str
    steps: int | str  # a count, or "auto:<relative width>"
    warmup: int | str  # a count, or "auto"

    @property
    def plan(self) -> StepPlan:
        warmup = None if self.warmup == AUTO else self.warmup
        if isinstance(self.steps, str):
            return StepPlan(warmup, None, float(self.steps.removeprefix(AUTO + ":")))
        return StepPlan(warmup, self.steps)


def key_steps(steps: int | None, rel_width: float) -> int | str:
    """A cell's `steps` as stored: the count, or the automatic rule with its width."""
    return f"{AUTO}:{rel_width:g}" if steps is None else steps


def key_warmup(warmup: int | None) -> int | str:
    return AUTO if warmup is None else warmup


@dataclass
class CellResult:
    key: CellKey
    gpu: str
    status: str
    reason: str | None = None
    samples_ms: list[float] = field(default_factory=list)
    summary: dict | None = None
    floor: dict | None = None
    details: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        """Every field, JSON-able: how a cell comes back from its child process."""
        return asdict(self)

    def measured_again_after(self, earlier: CellResult) -> None:
        """Names in its details the unsteady attempt this one measured again (a sweep's)."""
        self.details["measured_again"] = f"after an unsteady attempt: {earlier.reason}"

    @classmethod
    def from_dict(cls, data: dict) -> CellResult:
        return cls(**{**data, "key": CellKey(**data["key"])})

    @property
    def fraction_of_floor(self) -> float | None:
        if self.summary is None or self.floor is None:
            return None
        return self.floor["floor_ms"] / self.summary["median_ms"]

    @property
    def achieved_gbps(self) -> float | None:
        if self.summary is None or self.floor is None:
            return None
        return self.floor["total_bytes"] / (self.summary["median_ms"] * 1e6)


@dataclass(frozen=True)
class QualityKey:
    """What a quality measurement is of: a model and a base path (its formats: +compile and
    +graphs run the same arithmetic), on the evaluation text (its SHA-256) cut to its first
    `tokens` tokens in windows of `window`."""
    model: str
    path: str
    text: str
    tokens: int
    window: int


# The figures of a quality measurement (QualityResult.summary), each a column of its row:
# perplexity with its 95% interval, the float32 reference's on the same windows, the relative
# increase over it with a paired interval, mean KL(reference || path) per position with its
# interval, and greedy agreement over the prompt set.
QUALITY_FIGURES = ("ppl", "ppl_low", "ppl_high", "reference_ppl", "ppl_increase",
                   "ppl_increase_low", "ppl_increase_high", "kl", "kl_low", "kl_high", "prompts",
                   "prompts_agreeing", "mean_first_divergence", "near_tie_divergences")


@dataclass
class QualityResult:
    key: QualityKey
    gpu: str
    status: str
    reason: str | None = None
    summary: dict | None = None  # QUALITY_FIGURES
    greedy: list[dict] = field(default_factory=list)  # one entry per prompt
    details: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> QualityResult:
        return cls(**{**data, "key": QualityKey(**data["key"])})


@dataclass(frozen=True)
class SpeculationKey:
    """What a speculation measurement is of: a model with trained weights on one of the engine's
    paths (its formats), a drafter ('lookup' or a draft model), a workload (its prompts'
    SHA-256), the drafts a verify step checks (a count or 'auto'), the reply's length cap and
    the engine's dtype."""
    model: str
    path: str
    drafter: str
    workload: str
    texts: str
    draft_tokens: int | str
    max_new_tokens: int
    dtype: str


# The figures of a speculation measurement (SpeculationResult.summary), each a column of its
# row (store.SpeculationRow).
SPECULATION_FIGURES = (
    "prompts", "identical", "verify_steps", "plain_steps", "drafted", "accepted", "tokens",
    "acceptance", "tokens_per_step", "step_ms", "ms_per_token", "plain_ms_per_token", "speedup",
    "mean_ctx", "floor_ms", "floor_ms_per_token")


@dataclass
class SpeculationResult:
    key: SpeculationKey
    gpu: str
    status: str
    reason: str | None = None
    summary: dict | None = None  # SPECULATION_FIGURES
    details: dict = field(default_factory=dict)  # per prompt, formats, device

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> SpeculationResult:
        return cls(**{**data, "key": SpeculationKey(**data["key"])})
