"""Forecast ms/step for a model x GPU x context x path, from terms measured in the database.

    step ms = max(GPU side, host side)
    GPU side  = bytes / (efficiency of the path x datasheet bandwidth of the GPU) + fixed kernels
    host side = host ms per decoder layer of the path x layers

Where `floorline explain` has measured the path, the efficiency is floor / (time of the
matrix-vector and attention kernels), and the path's other kernels (norms, elementwise, ...) are
a fixed time taken to be the same on every GPU (they are latency-bound, not bandwidth-bound).
A path is GPU-bound where the card waits on nothing (explain found launch and idle under half of
the step; without explain: its step is one CUDA graph replay), and its host side is taken as
nil; without explain its efficiency is then the median fraction of the floor of its cells.
Otherwise it is host-bound: the host side per layer is the median of its cells' ms per layer,
and the efficiency comes from explain, else from the probe (streaming read / datasheet), else
from a stated assumption. The forecast's interval is the 5th-95th percentile of the path's
leave-one-out relative errors (all paths' where it has fewer than three cells).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import numpy as np

from floorline.errors import FloorlineError
from floorline.hardware import catalogue_names, lookup
from floorline.models import resolve_model
from floorline.paths import parse_path
from floorline.traffic import floor

ASSUMED_EFFICIENCY = 0.85  # where nothing was measured: a good streaming kernel's share of peak


@dataclass
class PathFit:
    path: str
    bound: str  # "gpu" or "host"
    efficiency: float
    fixed_ms: float  # kernels whose time does not scale with bandwidth
    host_ms_per_layer: float
    basis: list[int]  # cell ids
    notes: list[str] = field(default_factory=list)


@dataclass
class Forecast:
    model: str
    gpu: str
    ctx: int
    path: str
    ms: float
    low: float | None
    high: float | None
    gpu_ms: float
    host_ms: float
    fit: PathFit

    def as_dict(self) -> dict:
        return {"model": self.model, "gpu": self.gpu, "ctx": self.ctx, "path": self.path,
                "ms": self.ms, "low": self.low, "high": self.high, "gpu_ms": self.gpu_ms,
                "host_ms": self.host_ms, "bound": self.fit.bound, "efficiency": self.fit.efficiency,
                "fixed_ms": self.fit.fixed_ms,
                "host_ms_per_layer": self.fit.host_ms_per_layer, "basis_cells": self.fit.basis,
                "notes": self.fit.notes}


def _layers(model: str) -> int:
    return resolve_model(model).config.get_text_config().num_hidden_layers


def fit_path(path: str, cells: list[dict], explanations: list[dict], probes: dict) -> PathFit:
    mine = [c for c in cells if c["path"] == path and c["status"] == "valid"]
    if not mine:
        raise FloorlineError(f"no valid cells of path {path} in the database to fit")
    ids = [c["id"] for c in mine]
    explained = [e for e in explanations if e["path"] == path]
    d = explained[-1]["decomposition"] if explained else None
    host_bound = d["launch_and_idle_ms"] > 0.5 * d["median_ms"] if d else not parse_path(path).graphs
    notes = []
    if d:
        eff = d["floor_ms"] / (d["floor_ms"] + d["lost_in_kernels_ms"])
        fixed = d["other_kernels_ms"]
        notes.append(f"efficiency and fixed kernel time from explain ({explained[-1]['gpu']}, "
                     f"ctx {explained[-1]['ctx']}); fixed kernels taken as GPU-independent")
    elif not host_bound:
        eff, fixed = statistics.median(c["fraction_of_floor"] for c in mine), 0.0
        notes.append("efficiency = median fraction of the floor of its cells")
    else:
        fixed = 0.0
        reads = [probes[c["fingerprint_key"]]["stream_read_gbps"] / c["peak_gbps"]
                 for c in mine if c["fingerprint_key"] in probes]
        if reads:
            eff = statistics.median(reads)
            notes.append("efficiency from the probe: streaming read / datasheet")
        else:
            eff = ASSUMED_EFFICIENCY
            notes.append(f"efficiency assumed {ASSUMED_EFFICIENCY} (nothing measured)")
    if not host_bound:
        return PathFit(path, "gpu", eff, fixed, 0.0, ids, ["GPU-bound: host side nil", *notes])
    host = statistics.median(c["median_ms"] / _layers(c["model"]) for c in mine)
    return PathFit(path, "host", eff, fixed, host, ids,
                   ["host-bound: host ms per layer = median of its cells", *notes])


def forecast_with(fit: PathFit, model: str, gpu: str, ctx: int, errors: list[float]) -> Forecast:
    spec, device = resolve_model(model), lookup(gpu)
    f = floor(spec, device, ctx)
    gpu_ms = f.floor_ms / fit.efficiency + fit.fixed_ms
    host_ms = fit.host_ms_per_layer * _layers(model)
    ms = max(gpu_ms, host_ms)
    low = high = None
    if len(errors) >= 2:
        q05, q95 = np.percentile(errors, [5, 95])
        low, high = ms / (1 + q95), ms / (1 + q05)  # errors are (forecast - measured) / measured
    return Forecast(model, gpu, ctx, fit.path, ms, low, high, gpu_ms, host_ms, fit)


def leave_one_out(cells: list[dict], explanations: list[dict], probes: dict) -> list[dict]:
    """Each valid cell forecast from the other cells of its path."""
    out = []
    valid = [c for c in cells if c["status"] == "valid" and c["gpu"] in catalogue_names()]
    for c in valid:
        rest = [o for o in valid if o["id"] != c["id"]]
        try:
            fit = fit_path(c["path"], rest, explanations, probes)
        except FloorlineError:
            continue  # the only cell of its path
        pred = forecast_with(fit, c["model"], c["gpu"], c["ctx"], []).ms
        out.append({"id": c["id"], "model": c["model"], "gpu": c["gpu"], "ctx": c["ctx"],
                    "path": c["path"], "measured_ms": c["median_ms"], "forecast_ms": pred,
                    "error": (pred - c["median_ms"]) / c["median_ms"]})
    return out


def predict(model: str, gpu: str, ctx: int, path: str, cells, explanations, probes) -> Forecast:
    fit = fit_path(parse_path(path).name, cells, explanations, probes)
    loo = leave_one_out(cells, explanations, probes)
    errors = [r["error"] for r in loo if r["path"] == fit.path]
    if len(errors) < 3:
        errors = [r["error"] for r in loo]
    result = forecast_with(fit, model, gpu, ctx, errors)
    measured_gpus = {c["gpu"] for c in cells if c["id"] in fit.basis}
    if gpu not in measured_gpus:
        fit.notes.append(f"{gpu} was not measured: its datasheet bandwidth and the efficiency and "
                         f"host speed measured on {', '.join(sorted(measured_gpus))} stand in")
    return result


def study_check(cells, explanations, probes) -> list[dict]:
    """The study's published cells against the forecast from this database (hf-eager, the
    study's setup). Published ms: the L4 bf16 figure as printed; the H100's from its published
    fraction of the floor, under the study's every-parameter byte count."""
    from floorline.report.figures import study

    fit = fit_path("hf-eager", cells, explanations, probes)
    rows = []
    for ref in study()["fraction_of_floor"]:
        f = floor(resolve_model(ref["model"]), lookup(ref["gpu"]), ref["ctx"])
        printed = [q["ms"] for q in study()["quantised_ms"]
                   if q["gpu"] == ref["gpu"] and q["weight_format"] == "bf16"]
        published = printed[0] if printed else f.floor_ms_all_params / ref["value"]
        pred = forecast_with(fit, ref["model"], ref["gpu"], ref["ctx"], []).ms
        rows.append({"gpu": ref["gpu"], "model": ref["model"], "ctx": ref["ctx"],
                     "published_ms": published, "forecast_ms": pred,
                     "error": (pred - published) / published})
    return rows
