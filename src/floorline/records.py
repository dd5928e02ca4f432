"""The records a measurement produces and the database keeps: a cell's key and its result."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from floorline.timing import StepPlan

VALID = "valid"
INVALID = "invalid"
AUTO = "auto"


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
