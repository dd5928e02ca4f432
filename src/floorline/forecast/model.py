"""The step model, fitted per path from measured terms.

    GPU side  = weight bytes / (weights' fraction of peak x peak)
              + attention bytes / (attention's fraction of peak x peak)
              + small kernels per step x cost per small kernel
    host side = launches per step x host cost per launch
    step      = the larger of the two

Fractions of peak carry from one GPU to another; the small kernels (norms, rotary,
elementwise, sampling) are latency-bound and their cost per kernel is carried as measured.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace

from floorline.errors import FloorlineError
from floorline.forecast.calibration import Calibration
from floorline.forecast.terms import (
    GPU_GOVERNED,
    TRANSFORMERS,
    attention_bytes,
    family,
    formats,
    kind,
    layers,
    weight_bytes,
)
from floorline.hardware import lookup
from floorline.paths import parse_path

BIG_CLASSES = ("matrix-vector", "attention")


@dataclass
class Term:
    name: str
    value: float
    unit: str
    source: str

    def line(self) -> str:
        unit = f" {self.unit}" if self.unit else ""
        return f"{self.name}: {self.value:.4g}{unit} ({self.source})"


@dataclass
class Fit:
    path: str
    kind: str
    terms: dict[str, Term]
    gpus: set[str]  # GPUs whose cells the fit used
    notes: list[str] = field(default_factory=list)


def _peak(gpu: str) -> float:
    return lookup(gpu).peak_gbps * 1e6  # bytes per ms


def _cell_attention(c: dict) -> float:
    return attention_bytes(c["model"], c["ctx"], c["path"], c["kv_dtype"])


def attention_fraction(cal: Calibration, fam: str) -> Term:
    """Pooled slope of step time over attention bytes, within each path x model x GPU measured
    at several contexts (GPU-governed cells only: elsewhere the host hides it)."""
    groups: dict[tuple, list[dict]] = {}
    for c in cal.cells:
        if family(c["path"]) == fam and kind(c["path"]) == GPU_GOVERNED:
            groups.setdefault((c["path"], c["model"], c["gpu"]), []).append(c)
    sxy = sxx = 0.0
    used = []
    for group in groups.values():
        if len({c["ctx"] for c in group}) < 2:
            continue
        xs = [_cell_attention(c) for c in group]
        ys = [c["ms"] * _peak(c["gpu"]) for c in group]  # bytes at peak in the step's time
        # weighted by 1 / y^2, so that each cell counts by its relative error: a 131k-token
        # cell would otherwise set the slope for the short contexts alone
        ws = [1 / y ** 2 for y in ys]
        mx = sum(w * x for w, x in zip(ws, xs)) / sum(ws)
        my = sum(w * y for w, y in zip(ws, ys)) / sum(ws)
        sxy += sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys))
        sxx += sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
        used += group
    if used and sxy > 0:
        return Term("attention's fraction of peak", sxx / sxy, "",
                    f"slope over context of {len(used)} {fam} cells")
    for e in cal.explanations:
        if family(e["path"]) == fam and e["classes"].get("attention", {}).get("ms"):
            a = attention_bytes(e["model"], e["ctx"], e["path"], formats(e["path"])[1])
            return Term("attention's fraction of peak",
                        a / (e["classes"]["attention"]["ms"] * _peak(e["gpu"])), "",
                        f"explain of {e['path']} on {e['gpu']} ({e['source']})")
    raise FloorlineError(f"no forecast: attention's bandwidth for {fam} paths is missing "
                         f"(measure a {fam} path at two contexts, or run explain on one)")


def _explain_for(cal: Calibration, path: str) -> dict | None:
    """The path's own explain, else one of its graph-replayed twin (same kernels), else any of
    its family, preferring its kind."""
    path_spec = parse_path(path)
    twin = path if path_spec.graphs else replace(path_spec, graphs=True).name
    ranked = sorted((e for e in cal.explanations if family(e["path"]) == family(path)),
                    key=lambda e: (e["path"] != path, e["path"] != twin,
                                   kind(e["path"]) != kind(path)))
    return ranked[0] if ranked else None


def small_kernels(cal: Calibration, path: str) -> tuple[Term, Term] | None:
    """Small kernels per layer and their cost each, from explain."""
    e = _explain_for(cal, path)
    if e is None:
        return None
    small = {k: v for k, v in e["classes"].items() if k not in BIG_CLASSES}
    count = sum(v["kernels_per_step"] for v in small.values())
    if count <= 0:
        return None
    where = f"explain of {e['path']} on {e['gpu']}, {e['model']} ctx {e['ctx']} ({e['source']})"
    return (Term("small kernels per layer", count / layers(e["model"]), "", where),
            Term("cost per small kernel", sum(v["ms"] for v in small.values()) / count * 1e3,
                 "us", where))


def _small_ms(terms: dict[str, Term], model: str) -> float:
    if "small kernels per layer" not in terms:
        return 0.0
    per_layer = terms["small kernels per layer"].value
    return per_layer * layers(model) * terms["cost per small kernel"].value / 1e3


def weight_fraction(cal: Calibration, path: str, terms: dict[str, Term]) -> Term:
    """From the path's graph-replayed cells: what is left of each step after attention and the
    small kernels, against its weight bytes (median over cells). A host-bound path takes its
    graph-replayed twin's (same kernels), else explain's matrix-vector time, else the probe."""
    path_spec = parse_path(path)
    source_path = path if path_spec.graphs else replace(path_spec, graphs=True).name \
        if family(path).startswith(TRANSFORMERS) else path
    eta_a = terms["attention's fraction of peak"].value
    values = []
    for c in cal.cells:
        if c["path"] != source_path:
            continue
        rest = (c["ms"] - _cell_attention(c) / (eta_a * _peak(c["gpu"]))
                - _small_ms(terms, c["model"]))
        if rest > 0:
            values.append(weight_bytes(c["model"], c["weight_format"]) / (rest * _peak(c["gpu"])))
    if values:
        return Term("weights' fraction of peak", statistics.median(values), "",
                    f"median of {len(values)} {source_path} cells, after attention and small "
                    f"kernels")
    for e in cal.explanations:
        if e["path"] == path and e["classes"].get("matrix-vector", {}).get("ms"):
            w = weight_bytes(e["model"], formats(path)[0])
            return Term("weights' fraction of peak",
                        w / (e["classes"]["matrix-vector"]["ms"] * _peak(e["gpu"])), "",
                        f"explain's matrix-vector time ({e['source']})")
    if cal.probes:
        p = cal.probes[-1]
        return Term("weights' fraction of peak", p["stream_read_gbps"] * 1e6 / _peak(p["gpu"]), "",
                    f"the probe's streaming read on {p['gpu']}, an upper bound ({p['source']})")
    raise FloorlineError(f"no forecast: the weights' bandwidth of {path} is missing (measure "
                         f"{source_path} on a GPU, or run explain or probe)")


def host_terms(cal: Calibration, path: str, terms: dict[str, Term]) -> dict[str, Term]:
    if kind(path) == GPU_GOVERNED:
        if not cal.probes:
            return {}
        p = cal.probes[-1]
        return {"host cost per step": Term("host cost per step", p["graph_us"], "us",
                                           f"one graph replay, {p['source']} on {p['gpu']}")}
    e = _explain_for(cal, path)
    if e is None:
        raise FloorlineError(f"no forecast: launches per step of {path} are missing (run explain "
                             f"on it or on another path of its family on a GPU)")
    per_layer = e["kernels_per_step"] / layers(e["model"])
    costs = [c["ms"] / (per_layer * layers(c["model"])) * 1e3
             for c in cal.cells if c["path"] == path]
    if not costs:
        raise FloorlineError(f"no forecast: no GPU cell of {path} to measure its host cost from")
    return {"launches per layer": Term("launches per layer", per_layer, "",
                                       f"explain of {e['path']} on {e['gpu']} ({e['source']})"),
            "host cost per launch": Term("host cost per launch", statistics.median(costs), "us",
                                         f"median of {len(costs)} {path} cells")}


def fit(cal: Calibration, path: str) -> Fit:
    mine = [c for c in cal.cells if c["path"] == path]
    if not mine:
        if path in cal.cpu_paths:
            raise FloorlineError(f"no forecast: {path} was measured only on the CPU, which says "
                                 f"nothing about a GPU's step; missing: a cell of {path} on a GPU")
        raise FloorlineError(f"no forecast: no GPU cell of {path} in the calibration; missing: "
                             f"a measurement of {path} on a GPU (floorline sweep --paths {path})")
    terms = {"attention's fraction of peak": attention_fraction(cal, family(path))}
    notes = []
    small = small_kernels(cal, path)
    if small:
        terms.update({t.name: t for t in small})
    else:
        notes.append("no explain of this family: small kernels are folded into the weights' term")
    terms["weights' fraction of peak"] = weight_fraction(cal, path, terms)
    terms.update(host_terms(cal, path, terms))
    return Fit(path, kind(path), terms, {c["gpu"] for c in mine}, notes)


@dataclass
class Step:
    gpu_ms: float
    host_ms: float
    parts: dict[str, float]

    @property
    def ms(self) -> float:
        return max(self.gpu_ms, self.host_ms)


def step(f: Fit, model: str, gpu: str, ctx: int) -> Step:
    t, peak = f.terms, _peak(gpu)
    w_fmt, kv = formats(f.path)
    parts = {
        "weights": weight_bytes(model, w_fmt) / (t["weights' fraction of peak"].value * peak),
        "attention": (attention_bytes(model, ctx, f.path, kv)
                      / (t["attention's fraction of peak"].value * peak)),
        "small kernels": _small_ms(t, model),
    }
    if "host cost per launch" in t:
        host = t["launches per layer"].value * layers(model) * t["host cost per launch"].value / 1e3
    else:
        host = t["host cost per step"].value / 1e3 if "host cost per step" in t else 0.0
    return Step(sum(parts.values()), host, parts)
