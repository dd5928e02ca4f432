"""Leave-one-out errors (a cell at a time, or a whole GPU), the intervals drawn from them, and
the forecast a user asks for."""

from __future__ import annotations

import math
from dataclasses import dataclass

from floorline.errors import FloorlineError
from floorline.forecast.calibration import Calibration
from floorline.forecast.model import Fit, Step, fit, step
from floorline.forecast.terms import check_runnable, family, formats, kind, parameters

LEVEL_PERCENT = 90
LEVEL = LEVEL_PERCENT / 100


def leave_one_out(cal: Calibration) -> list[dict]:
    """Each cell forecast from every other record (its path's other cells, the other paths'
    shared terms); a cell whose path has no other cell is left out."""
    out = []
    for c in cal.cells:
        try:
            ms = step(fit(cal.without(c), c["path"], c["gpu"], c["model"]), c["model"],
                      c["ctx"]).ms
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
    f = fit(cal, path, gpu, model)
    s = step(f, model, ctx)
    loo = leave_one_out(cal) if loo is None else loo
    errors = [r["error"] for r in loo if r["kind"] == kind(path)]
    iv = interval(s.ms, errors)
    return Forecast(model, gpu, ctx, f, s, *(iv or (None, None)), len(errors))


SMALL = "small models (under 2 B parameters)"


def path_family(model: str, path: str) -> str:
    """The family a cell's error is reported in: small models (launch-bound on any path), the
    engine per weight format, or the stock paths by kind."""
    if parameters(model) < 2e9:
        return SMALL
    if family(path).startswith("engine"):
        weights, kv = formats(path)
        name = weights.removeprefix("engine-").replace("-fp8head", ", fp8 head")
        return f"engine, {name}" + (", fp8 KV cache" if kv == "engine-fp8" else "")
    return f"stock, {kind(path)}"


def without_gpu(cal: Calibration, gpu: str) -> Calibration:
    """The calibration less every record of `gpu`: its cells, explain decompositions, probes."""
    return Calibration([c for c in cal.cells if c["gpu"] != gpu],
                       [e for e in cal.explanations if e["gpu"] != gpu],
                       [p for p in cal.probes if p["gpu"] != gpu], cal.cpu_paths)


def leave_one_gpu_out(cal: Calibration, gpu: str, probed: bool = False) -> list[dict]:
    """Each cell of `gpu` forecast from the other GPUs' records alone, as for a GPU not in
    hand (with `probed`: and its own probes, as for a GPU whose `floorline probe` is in hand
    but none of its cells): a row per cell with its error, or why it was not forecast, and
    whether the 90% interval (from the held-in cells' leave-one-out errors of its kind) held
    it."""
    held_in = without_gpu(cal, gpu)
    if probed:
        held_in.probes += [p for p in cal.probes if p["gpu"] == gpu]
    loo = leave_one_out(held_in)
    out = []
    for c in cal.cells:
        if c["gpu"] != gpu:
            continue
        row = {"model": c["model"], "ctx": c["ctx"], "path": c["path"], "gpu": gpu,
               "family": path_family(c["model"], c["path"]), "measured_ms": c["ms"],
               "source": c["source"]}
        try:
            f = forecast(held_in, c["model"], gpu, c["ctx"], c["path"], loo)
        except FloorlineError as e:
            out.append({**row, "forecast_ms": None, "error": None, "held": None,
                        "missing": str(e).removeprefix("no forecast: ")})
            continue
        held = None if f.low is None else f.low <= c["ms"] <= f.high
        out.append({**row, "forecast_ms": f.ms, "error": (f.ms - c["ms"]) / c["ms"],
                    "held": held, "missing": None})
    return out


def by_family(rows: list[dict]) -> dict[str, dict]:
    """Per family: cells forecast, their mean absolute and largest error, how many their
    interval held (of those with one), and the cells not forecast."""
    out = {}
    for name in sorted({r["family"] for r in rows}):
        mine = [r for r in rows if r["family"] == name]
        done = [r for r in mine if r["error"] is not None]
        bounded = [r for r in done if r["held"] is not None]
        out[name] = {"cells": len(done), "not_forecast": len(mine) - len(done),
                     "mae": sum(abs(r["error"]) for r in done) / len(done) if done else None,
                     "worst": max((r["error"] for r in done), key=abs) if done else None,
                     "with_interval": len(bounded),
                     "held": sum(r["held"] for r in bounded)}
    return out
