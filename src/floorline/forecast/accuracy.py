"""Leave-one-out errors, the intervals drawn from them, and the forecast a user asks for."""

from __future__ import annotations

import math
from dataclasses import dataclass

from floorline.errors import FloorlineError
from floorline.forecast.calibration import Calibration
from floorline.forecast.model import Fit, Step, fit, step
from floorline.forecast.terms import check_runnable, kind

LEVEL_PERCENT = 90
LEVEL = LEVEL_PERCENT / 100


def leave_one_out(cal: Calibration) -> list[dict]:
    """Each cell forecast from every other record (its path's other cells, the other paths'
    shared terms); a cell whose path has no other cell is left out."""
    out = []
    for c in cal.cells:
        try:
            ms = step(fit(cal.without(c), c["path"], c["gpu"]), c["model"], c["ctx"]).ms
        except FloorlineError:
            continue
        out.append({"model": c["model"], "gpu": c["gpu"], "ctx": c["ctx"], "path": c["path"],
                    "kind": kind(c["path"]), "measured_ms": c["ms"], "forecast_ms": ms,
                    "error": (ms - c["ms"]) / c["ms"], "source": c["source"]})
    return out


def interval_bounds(errors: list[float]) -> tuple[float, float] | None:
    """The errors' order statistics that a further error falls between with probability at
    least LEVEL (split-conformal: ranks floor((n+1)a/2) and ceil((n+1)(1-a/2))); None when there
    are too few errors for that."""
    n, tail = len(errors), (100 - LEVEL_PERCENT) / 2  # in percent; integer ranks, no rounding
    lo, hi = math.floor((n + 1) * tail / 100), math.ceil((n + 1) * (100 - tail) / 100)
    if lo < 1 or hi > n:
        return None
    e = sorted(errors)
    return e[lo - 1], e[hi - 1]


def interval(ms: float, errors: list[float]) -> tuple[float, float] | None:
    bounds = interval_bounds(errors)
    if bounds is None:
        return None
    low_error, high_error = bounds  # error = (forecast - measured) / measured
    return ms / (1 + high_error), ms / (1 + low_error)


def coverage(loo: list[dict]) -> dict[str, dict]:
    """Per kind: each held-out cell's interval from the other cells' errors of its kind, and
    the share of cells whose measured time falls inside."""
    out = {}
    for k in sorted({r["kind"] for r in loo}):
        rows = [r for r in loo if r["kind"] == k]
        inside = bounded = 0
        for r in rows:
            iv = interval(r["forecast_ms"], [o["error"] for o in rows if o is not r])
            if iv is not None:
                bounded += 1
                inside += iv[0] <= r["measured_ms"] <= iv[1]
        out[k] = {"cells": len(rows), "with_interval": bounded, "covered": inside,
                  "mae": sum(abs(r["error"]) for r in rows) / len(rows)}
    return out


@dataclass
class Forecast:
    model: str
    gpu: str
    ctx: int
    fit: Fit
    step: Step
    low: float | None
    high: float | None
    errors_used: int

    @property
    def ms(self) -> float:
        return self.step.ms

    def notes(self) -> list[str]:
        out = list(self.fit.notes)
        if self.gpu not in self.fit.gpus:
            out.append(f"no cell of {self.fit.path} on {self.gpu}: fractions of peak and times "
                       f"measured on {', '.join(sorted(self.fit.gpus))} stand in; the interval "
                       f"covers held-out cells there, not the move to another GPU")
        return out

    def as_dict(self) -> dict:
        return {"model": self.model, "gpu": self.gpu, "ctx": self.ctx, "path": self.fit.path,
                "kind": self.fit.kind, "ms": self.ms, "low": self.low, "high": self.high,
                "interval_level": LEVEL, "interval_from_errors": self.errors_used,
                "gpu_ms": self.step.gpu_ms, "host_ms": self.step.host_ms,
                "gpu_parts_ms": self.step.parts,
                "terms": {t.name: {"value": t.value, "unit": t.unit, "source": t.source}
                          for t in self.fit.terms.values()},
                "notes": self.notes()}


def forecast(cal: Calibration, model: str, gpu: str, ctx: int, path: str,
             loo: list[dict] | None = None) -> Forecast:
    check_runnable(model, gpu, ctx, path)
    f = fit(cal, path, gpu)
    s = step(f, model, ctx)
    loo = leave_one_out(cal) if loo is None else loo
    errors = [r["error"] for r in loo if r["kind"] == kind(path)]
    iv = interval(s.ms, errors)
    return Forecast(model, gpu, ctx, f, s, *(iv or (None, None)), len(errors))

