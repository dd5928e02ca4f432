"""The report's plots. Each function draws one figure from database rows and returns the figure
and the ids of what it was drawn from, or None with what is missing."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogFormatter, PercentFormatter  # noqa: E402

from floorline.hardware import lookup  # noqa: E402
from floorline.measure.energy import energy_problem  # noqa: E402
from floorline.measure.reduction import reductions  # noqa: E402
from floorline.models import resolve_model  # noqa: E402
from floorline.records import VALID  # noqa: E402
from floorline.stats import percent  # noqa: E402
from floorline.study import study  # noqa: E402
from floorline.traffic import WEIGHT_FORMATS, floor  # noqa: E402

# Names come from paths, configs and databases: drawn as text, never parsed as math ($...$);
# log axes are therefore labelled as plain numbers (plain() below), not as powers of ten.
plt.rcParams["text.parse_math"] = False

NO_CELLS = "There are no valid cells yet: `floorline sweep` measures them."


def _valid(cells):
    return [c for c in cells if c.status == VALID]  # unsteady cells are not drawn


def _log_range(values):
    """A log axis's limits holding every value, with a margin either side."""
    return min(values) / 1.6, max(values) * 1.6


def plain(axis) -> None:
    """Tick labels of a log axis as plain numbers (100, 1000, 0.1), the minor ticks' too: an axis
    spanning less than a decade labels some of them, in mathtext by default."""
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(LogFormatter(labelOnlyBase=False))


def fraction_vs_bandwidth(cells):
    """Fraction of the memory floor against peak bandwidth (the datasheet's, or the measured
    streaming read where a device has none, as on a CPU). Log x: bandwidths span 20 to 5000 GB/s."""
    cells = _valid(cells)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for path in sorted({c.path for c in cells}):
        pts = [c for c in cells if c.path == path]
        ax.scatter([c.peak_gbps for c in pts], [c.fraction_of_floor for c in pts],
                   label=f"floorline: {path}", alpha=0.8)
    ref = study()["fraction_of_floor"]
    ax.scatter([lookup(r["gpu"]).peak_gbps for r in ref], [r["value"] for r in ref], marker="*",
               s=200, color="black", label="study (published; every-parameter bytes)")
    for r in ref:
        ax.annotate(f"{r['gpu']} {r['model']} ctx {r['ctx']}",
                    (lookup(r["gpu"]).peak_gbps, r["value"]),
                    textcoords="offset points", xytext=(-8, 6), ha="right", fontsize=8)
    peaks = [c.peak_gbps for c in cells] + [lookup(r["gpu"]).peak_gbps for r in ref]
    top = max([c.fraction_of_floor for c in cells] + [r["value"] for r in ref] + [1.0])
    ax.set(xscale="log", xlabel="peak bandwidth (GB/s; datasheet, or measured where there is none)",
           ylim=(0, top * 1.05), xlim=_log_range(peaks),
           ylabel="fraction of the memory floor (floor / measured ms)",
           title="Fraction of the memory floor against peak bandwidth")
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    plain(ax.xaxis)
    ax.legend(fontsize=7)
    return fig, [c.id for c in cells], None if cells else NO_CELLS



def ms_vs_context(cells):
    """ms/step against context, per model and path, with each model's floor as a line."""
    cells = _valid(cells)
    if not cells:
        return None, [], NO_CELLS
    groups = sorted({(c.model, c.gpu) for c in cells})
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4.2), squeeze=False)
    for ax, (model, gpu) in zip(axes[0], groups):
        mine = [c for c in cells if (c.model, c.gpu) == (model, gpu)]
        for path in sorted({c.path for c in mine}):
            pts = sorted((c.ctx, c.median_ms, c.p10_ms, c.p90_ms)
                         for c in mine if c.path == path)
            ctx, ms, lo, hi = zip(*pts)
            yerr = [[m - low for m, low in zip(ms, lo)], [h - m for m, h in zip(ms, hi)]]
            ax.errorbar(ctx, ms, yerr=yerr,
                        marker="o", capsize=3, label=path)
        floor = sorted({(c.ctx, c.floor_ms) for c in mine})
        ax.plot(*zip(*floor), "k--", label="floor")
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)",
               ylabel="ms/step (median, p10-p90)",
               title=f"{model} on {gpu}")
        contexts = sorted({c.ctx for c in mine})
        ax.set_xticks(contexts, [str(c) for c in contexts], minor=False)
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        plain(ax.yaxis)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig, [c.id for c in cells], None


def ab_forest(experiments):
    """A/B speedups with their 95% intervals, the study's beside."""
    rows = [(f"{e['b']} vs {e['a']}, {e['model']} ctx {e['ctx']}, {e['gpu']} "
             f"(N={e['sessions']})", e["speedup"], e["ci_low"], e["ci_high"], "floorline")
            for e in experiments if e["speedup"]]
    rows += [(f"{r['b']} vs {r['a']}, ctx {r['ctx']}, {r['gpu']} (study)", r["speedup"],
              r["ci_low"], r["ci_high"], "study") for r in study()["ab"]]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.5))
    for y, (_label, s, lo, hi, who) in enumerate(rows):
        color = "black" if who == "study" else "tab:blue"
        if lo is not None:
            ax.errorbar([s], [y], xerr=[[s - lo], [hi - s]], fmt="o", color=color, capsize=4)
        else:
            ax.plot([s], [y], "o", mfc="none", color=color)
    ax.axvline(1, color="grey", lw=0.8)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
    ax.set(xlabel="speedup of B over A (mean session ratio, 95% BCa CI)",
           title="A/B experiments (open marker: no published interval)")
    fig.tight_layout()
    missing = None if experiments else (
        "This database holds no A/B experiment, so only the study's are drawn: `floorline ab` "
        "runs one (for example `floorline ab --a hf-static --b hf-static+graphs`).")
    return fig, [e["id"] for e in experiments], missing


def quantised(cells):
    """Quantised paths: ms/step as bars on a linear axis, each with its own floor and its 16-bit
    reference (the same runtime and options on 16-bit weights) as marks, the study's L4 cells
    beside."""
    quant = [c for c in _valid(cells) if WEIGHT_FORMATS[c.weight_format].bits < 16]
    by_id = {c.id: c for c in cells}
    reduced = reductions(cells)
    ref = study()["quantised_ms"]
    # The study names Qwen2.5-7B as its model; its quantised cells are taken to be that model.
    model_spec, l4 = resolve_model("qwen2.5-7b"), lookup("l4")
    labels = [f"study, L4: {r['path']}" for r in ref] + [
        f"{c.model} {c.gpu} ctx {c.ctx}: {c.path}" for c in quant]
    measured = [r["ms"] for r in ref] + [c.median_ms for c in quant]
    floors = ([floor(model_spec, l4, 2048, r["weight_format"]).floor_ms for r in ref]
              + [c.floor_ms for c in quant])
    baselines = [ref[0]["ms"]] * len(ref) + [
        by_id[reduced[c.id]["reference_id"]].median_ms
        if reduced.get(c.id, {}).get("reference_id") else None for c in quant]
    y = list(range(len(labels)))
    fig, ax = plt.subplots(figsize=(11, 0.3 * len(labels) + 1.6))
    ax.barh(y, measured, 0.7, color=["grey"] * len(ref) + ["tab:orange"] * len(quant),
            hatch="//", edgecolor="white", label="measured ms/step (grey: the study's)")
    ax.scatter(floors, y, marker="|", s=150, color="black", zorder=3, label="its own floor")
    ax.scatter([b for b in baselines if b], [i for i in y if baselines[i]], marker="D", s=18,
               color="tab:blue", zorder=3, label="16-bit reference (same runtime and options)")
    for i in y:
        ax.annotate(f"{percent(floors[i] / measured[i])} of its floor",
                    (max(measured[i], baselines[i] or 0), i),
                    xytext=(6, 0), textcoords="offset points", va="center", fontsize=7)
    ax.set_yticks(y, labels, fontsize=7)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    ax.set_xlim(0, max(measured + [b for b in baselines if b]) * 1.35)
    ax.set(xlabel="ms per decode step (median)",
           title="Quantised paths against their floors and 16-bit references")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    missing = None if quant else (
        "This database holds no quantised cells, so only the study's published L4 cells are "
        "drawn: `floorline sweep --paths engine-int4,bnb-nf4` measures some (`floorline paths` "
        "lists the quantised paths this machine can run).")
    refs = [reduced[c.id]["reference_id"] for c in quant
            if reduced.get(c.id, {}).get("reference_id")]
    return fig, [c.id for c in quant] + sorted(set(refs)), missing


PARTS = (("floor_ms", "floor"),
         ("lost_in_kernels_ms", "bandwidth lost in GEMV + attention kernels"),
         ("other_kernels_ms", "other kernels"), ("launch_and_idle_ms", "launch and idle"))


def decomposition(explanations):
    """Where each millisecond goes, as stacked bars."""
    if not explanations:
        return None, [], ("This database holds no decomposition of a step yet: `floorline explain` "
                          "measures one (for example `floorline explain --path hf-eager`).")
    fig, ax = plt.subplots(figsize=(7, 0.6 * len(explanations) + 1.8))
    labels = [f"{e['model']} ctx {e['ctx']} {e['path']} ({e['gpu']})" for e in explanations]
    left = [0.0] * len(explanations)
    for key, label in PARTS:
        widths = [max(e["decomposition"][key], 0) for e in explanations]
        ax.barh(labels, widths, left=left, label=label)
        left = [a + b for a, b in zip(left, widths)]
    ax.set(xlabel="ms per step (median, unprofiled)", title="Where each millisecond of a step goes")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig, [e["id"] for e in explanations], None


NO_ENERGY = ("No cell here has a valid energy per token: `floorline sweep` measures it on an "
             "NVIDIA GPU whose driver reports energy or power (NVML), and keeps a reading whose "
             "error is bounded under 1%; a CPU's cells are not metered.")


def energy_vs_time(cells):
    """Joules per token against ms per token (batch 1: one token a step): a colour per path, a
    marker per model, each path's contexts for one model joined in order of context; log axes,
    since both span the paths' tenfold range."""
    cells = [c for c in _valid(cells)
             if c.details.get("energy") and energy_problem(c.details["energy"]) is None]
    if not cells:
        return None, [], NO_ENERGY
    fig, ax = plt.subplots(figsize=(7.5, 5))
    paths = sorted({c.path for c in cells})
    models = sorted({c.model for c in cells})
    markers = {m: "osD^vP*Xh<>p"[i % 12] for i, m in enumerate(models)}
    palette = plt.get_cmap("tab10" if len(paths) <= 10 else "tab20")
    colours = {p: palette(i % palette.N) for i, p in enumerate(paths)}
    for path in paths:
        for model in models:
            pts = sorted((c for c in cells if c.path == path and c.model == model),
                         key=lambda c: c.ctx)
            if pts:
                ax.plot([c.median_ms for c in pts],
                        [c.details["energy"]["joules_per_token"] for c in pts],
                        color=colours[path], marker=markers[model], lw=0.8, alpha=0.85)
    ax.set(xscale="log", yscale="log", xlim=_log_range([c.median_ms for c in cells]),
           ylim=_log_range([c.details["energy"]["joules_per_token"] for c in cells]),
           xlabel="ms/token (median of the timed steps)",
           ylabel="J/token (GPU energy over windows after the timed steps)",
           title="Energy per token against time per token (lines: one path and model, "
                 "contexts in order)")
    ax.title.set_fontsize(9)
    by_path = ax.legend(handles=[Line2D([], [], color=colours[p], lw=2, label=p) for p in paths],
                        title="path", fontsize=7, title_fontsize=7, loc="upper left")
    ax.add_artist(by_path)
    ax.legend(handles=[Line2D([], [], color="0.3", marker=markers[m], ls="", label=m)
                       for m in models], title="model", fontsize=7, title_fontsize=7,
              loc="lower right")
    plain(ax.xaxis)
    plain(ax.yaxis)
    return fig, [c.id for c in cells], None



NO_QUALITY = ("No valid cell here has its path's quality measured: `floorline quality --models DIR "
              "--paths engine,engine-fp8` measures it for a checkpoint with real weights (and "
              "`floorline sweep` does, once per model and path); random weights have none.")


def speed_vs_quality(pairs):
    """ms per step against the perplexity increase over float32, one panel per model and GPU:
    a colour per path, a point per context (joined, since a path's quality is one figure for
    every context), the increase's 95% interval as a horizontal bar. `pairs`: (cell, its
    quality row), both valid."""
    if not pairs:
        return None, [], NO_QUALITY
    groups = sorted({(c.model, c.gpu) for c, _ in pairs})
    fig, axes = plt.subplots(1, len(groups), figsize=(6.5 * len(groups), 4.6), squeeze=False)
    palette = plt.get_cmap("tab10")
    for ax, (model, gpu) in zip(axes[0], groups):
        mine = [(c, q) for c, q in pairs if (c.model, c.gpu) == (model, gpu)]
        for i, path in enumerate(sorted({c.path for c, _ in mine})):
            pts = sorted(((c, q) for c, q in mine if c.path == path), key=lambda p: p[0].ctx)
            q = pts[0][1]
            x = [q.ppl_increase * 100] * len(pts)
            y = [c.median_ms for c, _ in pts]
            colour = palette(i % palette.N)
            ax.plot(x, y, marker="o", color=colour, lw=0.8)
            if q.ppl_increase_low is not None:
                ax.errorbar(x[:1], y[:1], xerr=[[x[0] - q.ppl_increase_low * 100],
                                                [q.ppl_increase_high * 100 - x[0]]],
                            fmt="none", ecolor=colour, capsize=3)
            contexts = ", ".join(str(c.ctx) for c, _ in pts)
            ax.annotate(f"{path} (ctx {contexts})", (x[0], y[0]), textcoords="offset points",
                        xytext=(6, 4), fontsize=7, color=colour)
        ax.axvline(0, color="grey", lw=0.8, ls="--")
        ax.set(yscale="log", xlabel="perplexity increase over float32 (%, 95% interval)",
               ylabel="ms per decode step (median)", title=f"{model} on {gpu}")
        ax.title.set_fontsize(9)
        plain(ax.yaxis)
    fig.tight_layout()
    return fig, sorted({q.id for _, q in pairs}), None
