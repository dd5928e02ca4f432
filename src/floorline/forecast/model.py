"""The step model, fitted per path from measured terms.

    GPU side  = weight bytes / (the memory's streaming read x peak)
              + weight bytes x SM time per weight GB
              + layers x fixed cost per layer
              + attention bytes / (attention's fraction of peak x peak)
                (or attention bytes x attention's time per GB, where that fraction is low)
              + small kernels per step x cost per small kernel
    host side = layers x host time per layer + host time per step   (paths without CUDA
                graphs, where the GPU's probe ran the path's layer of the model's architecture)
              = launches per step x host cost per launch   (without graphs, from cells)
              = one graph replay                            (graph-replayed paths)
    step      = the larger of the two

The streaming read is the probe's fraction of peak, the best the memory does; what a path's
step takes beyond it is time the GPU's processors spend, which does not move with the
bandwidth: a fixed cost per layer (the launches inside a graph, each kernel's ramp-up and
drain), from the path family's 16-bit graph-replayed path, and the SM time per GB of weights
that a path spends beyond that (unpacking quantised weights), from the path's own cells. Both
are carried to another GPU as measured, as are the small kernels (norms, rotary, elementwise,
sampling). Attention's fraction of peak carries as a fraction, where the attention reads near
the memory's rate; one that reads at a third of peak or less is not bound by the memory, and its
time per GB carries as measured instead (transformers' attention over its static cache: 16% of
peak on an H200 and 22% on an H100, the same time per GB within 12% on the two, where a fraction
carried would have the H100 take 1.43x the H200's), though never less than the memory's
streaming read of its bytes takes on the GPU forecast.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field, replace

from floorline.errors import FloorlineError
from floorline.forecast.calibration import Calibration
from floorline.forecast.terms import (
    GPU_GOVERNED,
    architecture,
    attention_bytes,
    family,
    formats,
    kind,
    layers,
    sixteen_bit,
    weight_bytes,
)
from floorline.hardware import lookup
from floorline.paths import parse_path, verify_tokens

BIG_CLASSES = ("matrix-vector", "attention")
STREAM, ATTENTION = "memory's streaming read", "attention's fraction of peak"
ATTENTION_TIME = "attention's time per GB"
# At or below this fraction of peak an attention is not bound by the memory (module docstring)
MEMORY_BOUND_FROM = 1 / 3
FIXED, SM = "fixed cost per layer", "SM time per weight GB"
LAUNCHES, LAUNCH_COST, REPLAY = "launches per layer", "host cost per launch", "host cost per step"
HOST_LAYER, HOST_REST = "host time per layer", "host time per step beyond the layers"


class HostNotMeasured(FloorlineError):
    """A host-bound step on a machine whose host no measurement covers."""


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
    gpu: str  # the GPU the terms are for
    terms: dict[str, Term]
    gpus: set[str]  # GPUs whose cells of the path the fit used
    notes: list[str] = field(default_factory=list)
    host_missing: str | None = None  # why the host side is not known, where it is not


def _peak(gpu: str) -> float:
    return lookup(gpu).peak_gbps * 1e6  # bytes per ms


def _cell_attention(c: dict) -> float:
    return attention_bytes(c["model"], c["ctx"], c["path"], c["kv_dtype"])


def _probed(cal: Calibration, gpu: str, figure) -> float | None:
    """The median of `figure(probe)` over `gpu`'s probes that have it; None without one."""
    values = [figure(p) for p in cal.probes if p["gpu"] == gpu and figure(p) is not None]
    return statistics.median(values) if values else None


def _per_gpu(cal: Calibration, gpu: str, figure) -> tuple[float, str] | None:
    """`figure(probe)` for `gpu`: its probes' median, else the median over the probed GPUs
    (each GPU's median), with where it comes from; None where no probe has it."""
    here = _probed(cal, gpu, figure)
    if here is not None:
        return here, f"probe on {gpu}"
    others = {g: v for g in {p["gpu"] for p in cal.probes}
              if (v := _probed(cal, g, figure)) is not None}
    if others:
        return (statistics.median(others.values()),
                f"probes on {', '.join(sorted(others))}, carried to {gpu}")
    return None


def streaming_read(cal: Calibration, gpu: str) -> Term:
    """The memory's streaming read on `gpu` as a fraction of its peak, from the probe."""
    found = _per_gpu(cal, gpu, lambda p: p["stream_read_gbps"] * 1e6 / _peak(p["gpu"]))
    if found is None:
        raise FloorlineError("no forecast: the memory's streaming read is missing (run "
                             "`floorline probe --db DB` on a GPU and forecast with --db DB)")
    return Term(STREAM, found[0], "of peak", found[1])


def _slope(groups: list[list[dict]], y) -> float | None:
    """Pooled slope of attention bytes over y(cell) within each group (x / y: bytes per unit of
    y), each cell weighted by 1 / y^2, so that it counts by its relative error: a 131k-token
    cell would otherwise set the slope for the short contexts alone; None where the step does
    not grow with the bytes."""
    sxy = sxx = 0.0
    for group in groups:
        xs, ys = [_cell_attention(c) for c in group], [y(c) for c in group]
        ws = [1 / v ** 2 for v in ys]
        mx = sum(w * x for w, x in zip(ws, xs)) / sum(ws)
        my = sum(w * v for w, v in zip(ws, ys)) / sum(ws)
        sxy += sum(w * (x - mx) * (v - my) for w, x, v in zip(ws, xs, ys))
        sxx += sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    return sxx / sxy if sxy > 0 else None


def attention_term(cal: Calibration, fam: str) -> Term:
    """Attention's fraction of peak: the pooled slope of step time over attention bytes,
    within each path x model x GPU measured at several contexts (GPU-governed cells only:
    elsewhere the host hides it), else from an explain; at or below MEMORY_BOUND_FROM its time
    per GB instead, from the same cells."""
    groups: dict[tuple, list[dict]] = {}
    for c in cal.cells:
        if family(c["path"]) == fam and kind(c["path"]) == GPU_GOVERNED:
            groups.setdefault((c["path"], c["model"], c["gpu"]), []).append(c)
    several = [g for g in groups.values() if len({c["ctx"] for c in g}) >= 2]
    # bytes at peak in the step's time
    fraction = _slope(several, lambda c: c["ms"] * _peak(c["gpu"])) if several else None
    if fraction is not None:
        per_ms = _slope(several, lambda c: c["ms"])  # bytes a ms: the step's time alone
        return _attention_of(fraction, per_ms and 1e9 / per_ms,
                             f"slope over context of {sum(map(len, several))} {fam} cells")
    for e in cal.explanations:
        if family(e["path"]) == fam and e["classes"].get("attention", {}).get("ms"):
            a = attention_bytes(e["model"], e["ctx"], e["path"], formats(e["path"])[1])
            ms = e["classes"]["attention"]["ms"]
            return _attention_of(a / (ms * _peak(e["gpu"])), ms / a * 1e9,
                                 f"explain of {e['path']} on {e['gpu']} ({e['source']})")
    raise FloorlineError(f"no forecast: attention's bandwidth for {fam} paths is missing "
                         f"(measure a {fam} path at two contexts, or run explain on one)")


def _attention_of(fraction: float, ms_per_gb: float | None, source: str) -> Term:
    """The attention term of what was measured: its fraction of peak, or at or below
    MEMORY_BOUND_FROM its time per GB."""
    if fraction > MEMORY_BOUND_FROM:
        return Term(ATTENTION, fraction, "", source)
    return Term(ATTENTION_TIME, ms_per_gb, "ms",
                f"{source}, at {fraction:.0%} of peak: not bound by the memory")


def _attention(terms: dict[str, Term]) -> Term:
    return terms.get(ATTENTION) or terms[ATTENTION_TIME]


def attention_ms(term: Term, nbytes: float, gpu: str, stream: float) -> float:
    """Attention's time over `nbytes` on `gpu` by attention_term's term; a time per GB carried
    as measured is never less than the memory's streaming read (`stream`, of peak) takes."""
    if term.name == ATTENTION_TIME:
        return max(nbytes / 1e9 * term.value, nbytes / (stream * _peak(gpu)))
    return nbytes / (term.value * _peak(gpu))


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


def reference(cal: Calibration, path: str) -> str | None:
    """The path whose cells give `path` its fixed cost per layer: its family's 16-bit,
    graph-replayed one-token path with the most cells (ties by name), whose step has no
    unpacking to add; else the path itself where it is graph-replayed; else none."""
    counts = Counter(c["path"] for c in cal.cells
                     if family(c["path"]) == family(path) and kind(c["path"]) == GPU_GOVERNED
                     and sixteen_bit(c["path"]) and verify_tokens(c["path"]) == 1)
    if counts:
        return min(counts, key=lambda p: (-counts[p], p))
    return path if kind(path) == GPU_GOVERNED else None


def _beyond_streaming(cal: Calibration, path: str, terms: dict[str, Term]) -> list[tuple]:
    """(cell, ms) of each cell of `path`: its step less attention, its small kernels and its
    weights streamed at its GPU's streaming read."""
    attention = _attention(terms)
    out = []
    for c in cal.cells:
        if c["path"] != path:
            continue
        stream = streaming_read(cal, c["gpu"]).value
        streamed = weight_bytes(c["model"], c["weight_format"]) / (stream * _peak(c["gpu"]))
        out.append((c, c["ms"] - attention_ms(attention, _cell_attention(c), c["gpu"], stream)
                    - _small_ms(terms, c["model"]) - streamed))
    return out


def _fixed_per_layer(cal: Calibration, path: str) -> tuple[str, list[tuple[str, float]]] | None:
    """The reference path of `path`'s family, and per cell of it (its model's architecture, ms
    a layer) what its step takes beyond streaming its weights, attention and small kernels;
    None without a reference."""
    ref = reference(cal, path)
    if ref is None:
        return None
    attention = attention_term(cal, family(ref))
    ref_terms = {attention.name: attention}
    ref_terms.update({t.name: t for t in small_kernels(cal, ref) or ()})
    return ref, [(architecture(c["model"]), ms / layers(c["model"]))
                 for c, ms in _beyond_streaming(cal, ref, ref_terms)]


def fixed_cost(per_layer: tuple[str, list[tuple[str, float]]], model: str) -> Term:
    """Per layer of `model`, what the reference path's step takes beyond streaming its weights,
    attention and small kernels (`per_layer`: _fixed_per_layer's): the median over its cells of
    models of the same architecture, whose layers launch the same kernels (Qwen3's norms its q
    and k, Gemma 3's has four norms), where it has any, else over all its cells; none below
    zero."""
    ref, values = per_layer
    arch = architecture(model)
    same = [v for a, v in values if a == arch]
    chosen, of = (same, f"{arch} ") if same else ([v for _, v in values], "")
    return Term(FIXED, max(0.0, statistics.median(chosen)) * 1e3, "us",
                f"median of {len(chosen)} {ref} cells of {of}models, after streaming their "
                f"weights, attention and small kernels")


def sm_time(cal: Calibration, path: str, terms: dict[str, Term],
            per_layer: tuple[str, list[tuple[str, float]]] | None) -> Term | None:
    """Per GB of weights, what the path's graph-replayed cells (a host-bound path's twin's,
    the same kernels) take beyond streaming, attention, small kernels and the fixed cost per
    layer of each cell's model (from `per_layer`, _fixed_per_layer's; none without it) (median
    weighted by GB, none below zero); none for the reference itself or without cells."""
    path_spec = parse_path(path)
    source_path = path if kind(path) == GPU_GOVERNED else replace(path_spec, graphs=True).name
    if source_path == reference(cal, path):
        return None
    per_gb = []  # (ms per GB, GB) of each cell
    for c, ms in _beyond_streaming(cal, source_path, terms):
        tau = fixed_cost(per_layer, c["model"]).value / 1e3 if per_layer else 0.0
        gb = weight_bytes(c["model"], c["weight_format"]) / 1e9
        per_gb.append(((ms - tau * layers(c["model"])) / gb, gb))
    if not per_gb:
        return None
    return Term(SM, max(0.0, weighted_median(per_gb)), "ms",
                f"median of {len(per_gb)} {source_path} cells weighted by their GB, beyond the "
                "fixed cost per layer")


def weighted_median(pairs: list[tuple[float, float]]) -> float:
    """The median of the values of (value, weight) pairs, each counted by its weight: a small
    model's few GB, whose step is mostly fixed costs, say little of a per-GB time (the lower
    of two middle values where the weights split exactly in half)."""
    ordered, half, seen = sorted(pairs), sum(w for _, w in pairs) / 2, 0.0
    for value, weight in ordered:
        seen += weight
        if seen >= half:
            return value
    return ordered[-1][0]


def probed_host(cal: Calibration, gpu: str, path: str, arch: str) -> dict[str, Term]:
    """The host's time for a layer of `arch` in `path`, and for the rest of its step, from
    `gpu`'s probes that ran that path on a model of that architecture (the medians over them);
    empty where none did."""
    found = [h for p in cal.probes if p["gpu"] == gpu for h in p.get("host_layers") or []
             if h["path"] == path and h["architecture"] == arch]
    if not found:
        return {}
    source = (f"{len(found)} probe{'s' if len(found) > 1 else ''} of {gpu}'s host: {path} on "
              f"the {arch} architecture cut to a few MB a layer")
    return {HOST_LAYER: Term(HOST_LAYER, statistics.median(h["layer_us"] for h in found), "us",
                             source),
            HOST_REST: Term(HOST_REST, statistics.median(h["step_us"] for h in found), "us",
                            source)}


def host_terms(cal: Calibration, path: str, gpu: str,
               model: str) -> tuple[dict[str, Term], str | None]:
    """The host side's terms for `model`'s step on `gpu`, and why they are missing where they
    are. A graph-replayed path's host launches one graph a step (the probe's replay). A
    host-bound path's host takes, per layer and per step, what `gpu`'s probe measured of the
    path on the model's architecture; without such a probe, its cost per launch is its cells'
    on `gpu`; else its cells' elsewhere scaled by the probes' eager launch cost, here against
    there; else the host is not known."""
    if kind(path) == GPU_GOVERNED:
        found = _per_gpu(cal, gpu, lambda p: p.get("graph_us"))
        return ({REPLAY: Term(REPLAY, found[0], "us", f"one graph replay, {found[1]}")}
                if found else {}), None
    probed = probed_host(cal, gpu, path, architecture(model))
    if probed:
        return probed, None
    e = _explain_for(cal, path)
    if e is None:
        raise FloorlineError(f"no forecast: launches per step of {path} are missing (run explain "
                             f"on it or on another path of its family on a GPU)")
    per_layer = e["kernels_per_step"] / layers(e["model"])
    terms = {LAUNCHES: Term(LAUNCHES, per_layer, "",
                            f"explain of {e['path']} on {e['gpu']} ({e['source']})")}
    mine = [c for c in cal.cells if c["path"] == path]
    if not mine:
        raise FloorlineError(f"no forecast: no GPU cell of {path} to measure its host cost from")

    def cost(c: dict) -> float:
        return c["ms"] / (per_layer * layers(c["model"])) * 1e3

    def eager(g: str) -> float | None:
        return _probed(cal, g, lambda p: p.get("eager_us"))

    here = [cost(c) for c in mine if c["gpu"] == gpu]
    scaled = [cost(c) * eager(gpu) / eager(c["gpu"]) for c in mine
              if eager(gpu) is not None and eager(c["gpu"]) is not None]
    if here:
        terms[LAUNCH_COST] = Term(LAUNCH_COST, statistics.median(here), "us",
                                  f"median of {len(here)} {path} cells on {gpu}")
    elif scaled:
        terms[LAUNCH_COST] = Term(LAUNCH_COST, statistics.median(scaled), "us",
                                  f"median of {len(scaled)} {path} cells elsewhere, scaled by "
                                  f"the probes' eager launch ({eager(gpu):.2f} us on {gpu}'s host)")
    else:
        there = sorted({c["gpu"] for c in mine})
        return terms, (f"{path} launches every kernel from the host's processor, so its step "
                       f"depends on the machine as much as on the GPU, and no host was measured "
                       f"with the {gpu} (the cells of {path} ran on the host of the "
                       f"{', '.join(there)}, {statistics.median(cost(c) for c in mine):.1f} us a "
                       f"launch there)")
    return terms, None


def fit(cal: Calibration, path: str, gpu: str, model: str) -> Fit:
    """The terms of `path`'s step on `gpu` for `model` (its fixed cost per layer is its
    architecture's, where measured)."""
    mine = [c for c in cal.cells if c["path"] == path]
    if not mine:
        if path in cal.cpu_paths:
            raise FloorlineError(f"no forecast: {path} was measured only on the CPU, which says "
                                 f"nothing about a GPU's step; missing: a cell of {path} on a GPU")
        raise FloorlineError(f"no forecast: no GPU cell of {path} in the calibration; missing: "
                             f"a measurement of {path} on a GPU (floorline sweep --paths {path})")
    attention = attention_term(cal, family(path))
    terms = {STREAM: streaming_read(cal, gpu), attention.name: attention}
    notes = []
    small = small_kernels(cal, path)
    if small:
        terms.update({t.name: t for t in small})
    else:
        notes.append("no explain of this family: small kernels are folded into the fixed cost "
                     "per layer")
    per_layer = _fixed_per_layer(cal, path)
    if per_layer is not None:
        terms[FIXED] = fixed_cost(per_layer, model)
    extra = sm_time(cal, path, terms, per_layer)
    if extra is not None:
        terms[SM] = extra
    if per_layer is None:
        notes.append("no graph-replayed 16-bit path of its family was measured: no fixed cost "
                     "per layer")
    host, missing = host_terms(cal, path, gpu, model)
    terms.update(host)
    return Fit(path, kind(path), gpu, terms, {c["gpu"] for c in mine}, notes, missing)


@dataclass
class Step:
    gpu_ms: float
    host_ms: float
    parts: dict[str, float]

    @property
    def ms(self) -> float:
        return max(self.gpu_ms, self.host_ms)


def step(f: Fit, model: str, ctx: int) -> Step:
    """The step of `model` at `ctx` on the fit's GPU; where the fit's host side is not known, a
    refusal that gives the GPU side's forecast and asks for the host's measurement."""
    t, peak = f.terms, _peak(f.gpu)
    w_fmt, kv = formats(f.path)
    w = weight_bytes(model, w_fmt)
    parts = {
        "weights streamed": w / (t[STREAM].value * peak),
        "SM time on the weights": w / 1e9 * t[SM].value if SM in t else 0.0,
        "fixed cost of the layers": layers(model) * t[FIXED].value / 1e3 if FIXED in t else 0.0,
        "attention": attention_ms(_attention(t), attention_bytes(model, ctx, f.path, kv), f.gpu,
                                  t[STREAM].value),
        "small kernels": _small_ms(t, model),
    }
    gpu_ms = sum(parts.values())
    if f.host_missing:
        raise HostNotMeasured(
            f"no forecast: {f.host_missing}. The GPU side is forecast at {gpu_ms:.2f} ms, and the "
            f"step takes the longer of it and the host side, which only the host can tell: run "
            f"`floorline probe --db floorline.db` on the machine with the GPU, then forecast "
            f"with --db floorline.db")
    if HOST_LAYER in t:
        host = (layers(model) * t[HOST_LAYER].value + t[HOST_REST].value) / 1e3
    elif LAUNCH_COST in t:
        host = t[LAUNCHES].value * layers(model) * t[LAUNCH_COST].value / 1e3
    else:
        host = t[REPLAY].value / 1e3 if REPLAY in t else 0.0
    return Step(gpu_ms, host, parts)

