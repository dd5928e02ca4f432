"""The report's plots. Each function draws one figure from database rows and returns the figure
and the ids of what it was drawn from, or None with what is missing.

One meaning per visual encoding, in every figure: hatching marks quantised weights, a black
dashed line a memory floor, black or grey the study's published figures; in the figures of one
point per cell, a path keeps its colour (its base path) and marker (its options). Legends sit
outside the axes, and axes of ms or ratios that span a decade or more are logarithmic (but
for stacked parts of a step, which add up)."""

from __future__ import annotations

import io
import math

from floorline.localcache import quiet_matplotlib_config

quiet_matplotlib_config()
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import (  # noqa: E402
    FixedLocator,
    FuncFormatter,
    LogFormatter,
    LogLocator,
    NullFormatter,
    NullLocator,
    PercentFormatter,
)

from floorline.hardware import lookup  # noqa: E402
from floorline.measure.energy import energy_problem  # noqa: E402
from floorline.measure.reduction import reductions  # noqa: E402
from floorline.models import resolve_model  # noqa: E402
from floorline.paths import REGISTRY, verify_tokens  # noqa: E402
from floorline.records import VALID  # noqa: E402
from floorline.report import here  # noqa: E402
from floorline.stats import percent  # noqa: E402
from floorline.study import study  # noqa: E402
from floorline.traffic import WEIGHT_FORMATS, floor  # noqa: E402

# Names come from paths, configs and databases: drawn as text, never parsed as math ($...$);
# log axes are therefore labelled as plain numbers (plain() below), not as powers of ten.
plt.rcParams["text.parse_math"] = False

DPI = 110
HATCH = "//"
UNQUANTISED, QUANTISED, STUDY = "tab:blue", "tab:orange", "0.55"
# tab20 without its greys (the study's colour): the dark shades, then the light ones.
PALETTE = [plt.get_cmap("tab20")(i) for i in (0, 2, 4, 6, 8, 10, 12, 16, 18,
                                             1, 3, 5, 7, 9, 11, 13, 17, 19)]
OPTION_MARKERS = {"": "o", "graphs": "s", "compile": "^", "compile+graphs": "D"}
# The base paths of the README's headline take the palette's strong colours first.
STRONG = ("engine", "engine-int4", "engine-fp8", "engine-int4-fp8head", "hf-eager", "hf-static",
          "llamacpp-bf16", "llamacpp-q4_0", "bnb-nf4")

NO_CELLS = "There are no valid cells yet: `floorline sweep` measures them."


def png(fig) -> bytes:
    """The figure as PNG bytes at the report's resolution; the figure is closed."""
    data = io.BytesIO()
    fig.savefig(data, format="png", dpi=DPI)
    plt.close(fig)
    return data.getvalue()


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


def log_x(ax, low: float, high: float, unit: str = "") -> None:
    """A log x axis from `low` to `high`, ticked 1, 2, 5, 10, 20, ... (with `unit` after each)."""
    ax.set_xscale("log")
    ax.set_xlim(low, high)
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}{unit}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def path_style(path: str) -> dict:
    """A path's colour (its base path's) and marker (its options'), the same in every figure."""
    base, *options = path.split("+")
    bases = [*STRONG, *(b for b in REGISTRY if b not in STRONG)]
    colour = PALETTE[bases.index(base) % len(PALETTE)] if base in bases else "black"
    return {"color": colour, "marker": OPTION_MARKERS.get("+".join(options), "v")}


def legend_below(fig, handles, labels, fontsize: float = 7) -> None:
    """The figure's legend under its axes (a constrained layout makes room for it), in as many
    columns as the figure's width holds."""
    renderer = fig.canvas.get_renderer()
    for ncol in range(min(len(labels), 6), 0, -1):
        legend = fig.legend(handles, labels, loc="outside lower center", ncol=ncol,
                            fontsize=fontsize, frameon=False)
        if ncol == 1 or legend.get_window_extent(renderer).width < fig.bbox.width * 0.98:
            return
        legend.remove()


def bars_and_table(figsize, ratio: float):
    """A figure of a bar chart and, right of it, an axes sharing its rows for table() to fill:
    the layout makes room for the table's text as for any axes."""
    fig, (ax, tab) = plt.subplots(1, 2, figsize=figsize, sharey=True, width_ratios=[ratio, 1],
                                  layout="constrained")
    return fig, ax, tab


def table(tab, rows: list[list[str]], header: list[str], fontsize: float) -> None:
    """Columns of text in `tab`, row i beside bar i, each column right-aligned; `header` as
    its top tick labels."""
    xs = [(i + 1) / len(rows[0]) - 0.03 for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        for x, text in zip(xs, row):
            tab.text(x, i, text, fontsize=fontsize, ha="right", va="center")
    tab.set_xlim(0, 1)
    tab.xaxis.tick_top()
    tab.set_xticks(xs if header else [], header, ha="right")
    tab.tick_params(length=0, labelsize=fontsize, labelcolor="0.35", labelleft=False)
    for spine in tab.spines.values():
        spine.set_visible(False)


def per_path_legend(fig, axes) -> None:
    """One legend under the figure for every path (and floor) drawn in any of `axes`."""
    entries = {}
    for ax in axes:
        entries.update(zip(*reversed(ax.get_legend_handles_labels())))
    legend_below(fig, list(entries.values()), list(entries))


def fraction_vs_bandwidth(cells):
    """Fraction of the memory floor against peak bandwidth (the datasheet's, or the measured
    streaming read where a device has none, as on a CPU), the study's published cells as stars
    and the same cells measured here beside them. Log x: bandwidths span 20 to 5000 GB/s."""
    cells = _valid(cells)
    fig, ax = plt.subplots(figsize=(8, 5.5), layout="constrained")
    for path in sorted({c.path for c in cells}):
        pts = [c for c in cells if c.path == path]
        ax.scatter([c.peak_gbps for c in pts], [c.fraction_of_floor for c in pts], s=24,
                   label=path, alpha=0.8, **path_style(path))
    ref = study()["fraction_of_floor"]
    ax.scatter([lookup(r["gpu"]).peak_gbps for r in ref], [r["value"] for r in ref], marker="*",
               s=200, color="black", label="the study (published)")
    for r in ref:
        ax.annotate(f"{r['gpu']} {r['model']} ctx {r['ctx']}",
                    (lookup(r["gpu"]).peak_gbps, r["value"]),
                    textcoords="offset points", xytext=(-10, 0), ha="right", va="center",
                    fontsize=7)
        # the same cell measured here, under the study's floor, beside the study's star
        here = [c for c in cells if (c.gpu, c.model, c.ctx, c.path)
                == (r["gpu"], r["model"], r["ctx"], r["path"]) and c.floor_ms_all_params]
        for c in here:
            value = c.floor_ms_all_params / c.median_ms
            ax.scatter([c.peak_gbps], [value], marker="*", s=200, facecolor="none",
                       edgecolor="black", label="the study's cell, measured here")
            ax.annotate(f"here {value:.0%}", (c.peak_gbps, value), textcoords="offset points",
                        xytext=(10, 0), ha="left", va="center", fontsize=7)
    peaks = [c.peak_gbps for c in cells] + [lookup(r["gpu"]).peak_gbps for r in ref]
    top = max([c.fraction_of_floor for c in cells] + [r["value"] for r in ref] + [1.0])
    # Room left of the leftmost star for its label.
    ax.set(xscale="log", xlabel="peak bandwidth (GB/s; datasheet, or measured where there is none)",
           ylim=(0, top * 1.05), xlim=(min(peaks) / 4, max(peaks) * 1.6),
           ylabel="fraction of the memory floor (floor / measured ms)",
           title="Fraction of the memory floor against peak bandwidth (the study's floor: the "
                 "bytes of every parameter)")
    ax.title.set_fontsize(10)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    plain(ax.xaxis)
    per_path_legend(fig, [ax])
    return fig, [c.id for c in cells], None if cells else NO_CELLS


def context_ticks(axis, contexts: list[int]) -> None:
    """Powers of two across the contexts (2k, 4k, ...), every other one beyond seven."""
    low, high = (int(math.log2(c)) for c in (min(contexts), max(contexts)))
    powers = [2 ** k for k in range(low, high + 2) if 2 ** k < max(contexts) * 1.5]
    powers = powers[::2] if len(powers) > 7 else powers
    axis.set_major_locator(FixedLocator(powers))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1024:g}k" if v >= 1024
                                           else f"{v:g}"))
    axis.set_minor_locator(NullLocator())


def model_panels(cells, height: float, margin: float = 0.5):
    """A figure of one panel per (model, GPU) side by side: it and, per panel, its axes, its
    (model, GPU) and its cells."""
    groups = sorted({(c.model, c.gpu) for c in cells})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups) + margin, height),
                             squeeze=False, layout="constrained")
    return fig, [(ax, g, [c for c in cells if (c.model, c.gpu) == g])
                 for ax, g in zip(axes[0], groups)]


def ms_vs_context(cells):
    """ms/step against context, per model and path, with each model's floor as a line."""
    cells = _valid(cells)
    if not cells:
        return None, [], NO_CELLS
    fig, panels = model_panels(cells, 5.5)
    for ax, (model, gpu), mine in panels:
        for path in sorted({c.path for c in mine}):
            pts = sorted((c.ctx, c.median_ms, c.p10_ms, c.p90_ms)
                         for c in mine if c.path == path)
            ctx, ms, lo, hi = zip(*pts)
            yerr = [[m - low for m, low in zip(ms, lo)], [h - m for m, h in zip(ms, hi)]]
            ax.errorbar(ctx, ms, yerr=yerr, capsize=2, ms=4, lw=1, label=path, **path_style(path))
        widest = {}  # a context's quantised cells have lower floors: the line is the highest
        for c in mine:
            widest[c.ctx] = max(widest.get(c.ctx, 0.0), c.floor_ms)
        ax.plot(*zip(*sorted(widest.items())), "k--", lw=1, label="floor of the widest format")
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)",
               ylabel="ms/step (median, p10-p90)", title=f"{model} on {gpu}")
        ax.title.set_fontsize(9)
        context_ticks(ax.xaxis, [c.ctx for c in mine])
        plain(ax.yaxis)
    per_path_legend(fig, fig.axes)
    return fig, [c.id for c in cells], None


NO_VERIFY = ("No verify-step cells: `floorline sweep --paths engine,engine+verify8` (the step "
             "that checks 8 tokens beside the one-token step; any K from 2 to 16) draws the "
             "cost curve.")


def verify_cost(cells):
    """The verify step's cost curve: the step that checks K tokens over the one-token step of
    the same path, model, GPU and context, against K (the lower the curve, the more each kept
    draft gains in speculative decoding)."""
    steps = {(c.model, c.gpu, c.ctx, c.path.split("+verify")[0], verify_tokens(c.path)): c
             for c in _valid(cells)}
    curves: dict[tuple, list] = {}
    for (model, gpu, ctx, path, k), c in sorted(steps.items()):
        one = steps.get((model, gpu, ctx, path, 1))
        if k > 1 and one is not None:
            curves.setdefault((model, gpu), {}).setdefault((path, ctx), [(1, 1.0, one.id)]).append(
                (k, c.median_ms / one.median_ms, c.id))
    if not curves:
        return None, [], NO_VERIFY
    fig, axes = plt.subplots(1, len(curves), figsize=(4.2 * len(curves) + 0.5, 4.5),
                             squeeze=False, layout="constrained")
    ids = []
    for ax, ((model, gpu), lines) in zip(axes[0], sorted(curves.items())):
        for (path, ctx), pts in sorted(lines.items()):
            ks, ratios, cell_ids = zip(*pts)
            ax.plot(ks, ratios, lw=1, ms=4, label=f"{path}, ctx {ctx}", **path_style(path))
            ids += cell_ids
        ax.plot([1, 16], [1, 16], color="grey", ls=":", lw=1, label="K one-token steps")
        ax.set(xscale="log", yscale="log", xlabel="tokens checked a step (K)",
               ylabel="t(K) / t(1)", title=f"{model} on {gpu}")
        ax.title.set_fontsize(9)
        ax.xaxis.set_major_locator(FixedLocator([1, 2, 4, 8, 16]))
        plain(ax.xaxis)
        plain(ax.yaxis)
    per_path_legend(fig, axes[0])
    return fig, sorted(set(ids)), None


NO_SPECULATION = ("No speculative decoding measured: `floorline speculate --model DIR` (a "
                  "checkpoint with trained weights) measures prompt lookup on every workload.")


def speculation(rows):
    """Speculative decoding per model, path, drafter and workload: ms per token with it, against
    the same replies without it and against the floor per token (the one-token step's floor
    over the tokens a step gave, verify and plain steps together); beside each bar, what the
    drafter got right."""
    rows = sorted((r for r in rows if r.status == VALID),
                  key=lambda r: (r.model, r.gpu, r.path, r.drafter, str(r.draft_tokens),
                                 r.workload))
    if not rows:
        return None, [], NO_SPECULATION
    fig, ax, tab = bars_and_table((9.5, 0.42 * len(rows) + 1.9), 1.7)
    y = list(range(len(rows)))
    ax.barh(y, [r.ms_per_token for r in rows], color=PALETTE[0], height=0.6,
            label="with speculation (effective ms/token)")
    ax.scatter([r.plain_ms_per_token for r in rows], y, marker="|", s=260, color="black",
               zorder=3, label="the same replies without it")
    ax.scatter([r.floor_ms for r in rows], y, marker="|", s=260, color="grey", zorder=3,
               label="floor of one step")
    ax.scatter([r.floor_ms_per_token for r in rows], y, marker="d", s=24, color=PALETTE[2],
               zorder=3, label="floor per token (step floor / tokens a step)")
    ax.set_yticks(y, [f"{r.model.rsplit('/', 1)[-1]} {r.path} {r.drafter} k={r.draft_tokens} "
                      f"on {r.gpu}: {r.workload}" for r in rows], fontsize=7)
    ax.invert_yaxis()
    high = max(max(r.ms_per_token, r.plain_ms_per_token, r.floor_ms) for r in rows)
    low = min(r.floor_ms_per_token for r in rows)
    log_x(ax, low / 1.6, high * 1.6)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_xlabel("ms per token (log axis)")
    table(tab, [[f"{r.acceptance:.0%}" if r.acceptance is not None else "-",
                 f"{r.tokens_per_step:.2f}", f"{r.speedup:.2f}x", f"{r.identical}/{r.prompts}"]
                for r in rows], ["kept", "tokens/step", "speedup", "same"], 7)
    legend_below(fig, *ax.get_legend_handles_labels())
    return fig, [r.id for r in rows], None


def ab_forest(experiments):
    """A/B speedups with their 95% intervals, the study's beside, on a log axis (a ratio of 2
    as far from 1 as one of 1/2), each labelled with its value."""
    rows = [(f"{e['b']} vs {e['a']}, {e['model']} ctx {e['ctx']}, {e['gpu']} "
             f"(N={e['sessions']})", e["speedup"], e["ci_low"], e["ci_high"], "floorline")
            for e in experiments if e["speedup"]]
    rows += [(f"{r['b']} vs {r['a']}, ctx {r['ctx']}, {r['gpu']} (study)", r["speedup"],
              r["ci_low"], r["ci_high"], "study") for r in study()["ab"]]
    fig, ax = plt.subplots(figsize=(8.2, 0.45 * len(rows) + 1.4), layout="constrained")
    for y, (_label, s, lo, hi, who) in enumerate(rows):
        color = "black" if who == "study" else "tab:blue"
        if lo is not None:
            ax.errorbar([s], [y], xerr=[[s - lo], [hi - s]], fmt="o", color=color, capsize=4)
        else:
            ax.plot([s], [y], "o", mfc="none", color=color)
        ax.annotate(f"{s:.3g}x", (hi or s, y), xytext=(6, 0), textcoords="offset points",
                    va="center", fontsize=8, color=color)
    ax.axvline(1, color="grey", lw=0.8)
    values = [v for r in rows for v in r[1:4] if v is not None] + [1.0]
    log_x(ax, min(values) / 1.15, max(values) * 1.4, "x")
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    # two lines: the labels of the rows leave the axes narrower than one line of it
    ax.set(xlabel="speedup of B over A (log axis)\nmean session ratio, 95% BCa interval",
           title="A/B experiments")
    entries = [(Line2D([], [], color="tab:blue", marker="o"), "measured here, 95% interval"),
               (Line2D([], [], color="black", marker="o"), "the study's, 95% interval"),
               (Line2D([], [], color="black", marker="o", mfc="none", ls=""),
                "the study's, no published interval")]
    legend_below(fig, *zip(*entries[0 if experiments else 1:]))
    missing = None if experiments else (
        "This database holds no A/B experiment, so only the study's are drawn: "
        f"{here.ab_command()} runs one on this machine.")
    return fig, [e["id"] for e in experiments], missing


def quantised(cells):
    """Quantised paths as bars from their own floor to their ms/step on a log axis, as in the
    headline, with their 16-bit reference (the same runtime and options on 16-bit weights) as
    a mark, the study's L4 cells beside."""
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
    hatched = [WEIGHT_FORMATS[r["weight_format"]].bits < 16 for r in ref] + [True] * len(quant)
    baselines = [ref[0]["ms"]] * len(ref) + [
        by_id[reduced[c.id]["reference_id"]].median_ms
        if reduced.get(c.id, {}).get("reference_id") else None for c in quant]
    y = list(range(len(labels)))
    fig, ax, tab = bars_and_table((9, 0.24 * len(labels) + 1.7), 8)
    ax.barh(y, [m - f for m, f in zip(measured, floors)], left=floors, height=0.62,
            color=[STUDY] * len(ref) + [QUANTISED] * len(quant),
            hatch=[HATCH if h else "" for h in hatched], edgecolor="white", lw=0)
    ax.vlines(floors, [i - 0.4 for i in y], [i + 0.4 for i in y], color="black", lw=1.5)
    ax.scatter([b for b in baselines if b], [i for i in y if baselines[i]], marker="D", s=16,
               color=UNQUANTISED, zorder=3)
    log_x(ax, min(floors) / 1.3, max(measured + [b for b in baselines if b]) * 1.3)
    table(tab, [[percent(f / m)] for f, m in zip(floors, measured)], ["of its floor"], 7)
    ax.set_yticks(y, labels, fontsize=7)
    ax.tick_params(axis="y", length=0)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    ax.set(xlabel="ms per decode step (median; log axis: a bar runs from its format's floor to "
                  "its step)", title="Quantised paths against their floors and 16-bit references")
    legend_below(fig, [Patch(facecolor=QUANTISED, hatch=HATCH, edgecolor="white"),
                       Patch(facecolor=STUDY, hatch=HATCH, edgecolor="white"), Patch(color=STUDY),
                       Line2D([], [], color="black", marker="|", ls="", ms=9, mew=1.5),
                       Line2D([], [], color=UNQUANTISED, marker="D", ls="", ms=4)],
                 ["quantised, measured here", "quantised, the study's", "16-bit, the study's",
                  "floor of the bar's weight format", "16-bit reference (same runtime, options)"])
    missing = None if quant else (
        "This database holds no quantised cells, so only the study's published L4 cells are "
        f"drawn: `floorline sweep{here.paths_option('engine-int4', 'bnb-nf4')}` measures some "
        "on this machine (`floorline paths` lists the quantised paths it can run).")
    refs = [reduced[c.id]["reference_id"] for c in quant
            if reduced.get(c.id, {}).get("reference_id")]
    return fig, [c.id for c in quant] + sorted(set(refs)), missing


PARTS = (("floor_ms", "floor", "0.25"),
         ("lost_in_kernels_ms", "bandwidth lost in GEMV + attention kernels", "tab:purple"),
         ("other_kernels_ms", "other kernels", "tab:olive"),
         ("launch_and_idle_ms", "launch and idle", "tab:red"))


def decomposition(explanations):
    """Where each millisecond goes, as stacked bars: on a linear axis, since the parts add up."""
    if not explanations:
        return None, [], ("This database holds no decomposition of a step yet: `floorline explain` "
                          "measures one (for example `floorline explain --path hf-eager`).")
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(explanations) + 1.8), layout="constrained")
    labels = [f"{e['model']} ctx {e['ctx']} {e['path']} ({e['gpu']})" for e in explanations]
    left = [0.0] * len(explanations)
    for key, label, colour in PARTS:
        widths = [max(e["decomposition"][key], 0) for e in explanations]
        ax.barh(labels, widths, left=left, label=label, color=colour)
        left = [a + b for a, b in zip(left, widths)]
    ax.set(xlabel="ms per step (median, unprofiled)", title="Where each millisecond of a step goes")
    legend_below(fig, *ax.get_legend_handles_labels())
    return fig, [e["id"] for e in explanations], None


NO_ENERGY = ("No cell here has a valid energy per token: `floorline sweep` measures it on an "
             "NVIDIA GPU whose driver reports energy or power (NVML), and keeps a reading whose "
             "error is bounded under 1%; a CPU's cells are not metered.")


def energy_vs_time(cells):
    """Joules per token against ms per token (batch 1: one token a step), one panel per model
    and GPU: each path's contexts joined in order of context; log axes, since both span the
    paths' tenfold range."""
    cells = [c for c in _valid(cells)
             if c.details.get("energy") and energy_problem(c.details["energy"]) is None]
    if not cells:
        return None, [], NO_ENERGY
    fig, panels = model_panels(cells, 5.2, margin=1.5)
    for ax, (model, gpu), mine in panels:
        for path in sorted({c.path for c in mine}):
            pts = sorted((c for c in mine if c.path == path), key=lambda c: c.ctx)
            ax.plot([c.median_ms for c in pts],
                    [c.details["energy"]["joules_per_token"] for c in pts],
                    lw=0.8, alpha=0.85, label=path, **path_style(path))
        ax.set(xscale="log", yscale="log", xlim=_log_range([c.median_ms for c in cells]),
               ylim=_log_range([c.details["energy"]["joules_per_token"] for c in cells]),
               xlabel="ms/token (median of the timed steps)",
               ylabel="J/token (GPU energy over windows after the timed steps)",
               title=f"{model} on {gpu} (lines: a path's contexts in order)")
        ax.title.set_fontsize(9)
        plain(ax.xaxis)
        plain(ax.yaxis)
    per_path_legend(fig, fig.axes)
    return fig, [c.id for c in cells], None


def no_quality() -> str:
    return ("No valid cell here has its path's quality measured: `floorline quality --models DIR"
            f"{here.paths_option('engine', 'engine-fp8')}` measures it on this machine for a "
            "checkpoint with real weights (and `floorline sweep` does, once per model and path); "
            "random weights have none.")


def speed_vs_quality(pairs):
    """ms per step against the perplexity increase over float32, one panel per model and GPU:
    a point per context (joined, since a path's quality is one figure for every context), the
    increase's 95% interval as a horizontal bar, each path labelled."""
    if not pairs:
        return None, [], no_quality()
    groups = sorted({(c.model, c.gpu) for c, _ in pairs})
    fig, axes = plt.subplots(1, len(groups), figsize=(6.5 * len(groups), 4.6), squeeze=False,
                             layout="constrained")
    for ax, (model, gpu) in zip(axes[0], groups):
        mine = [(c, q) for c, q in pairs if (c.model, c.gpu) == (model, gpu)]
        for path in sorted({c.path for c, _ in mine}):
            pts = sorted(((c, q) for c, q in mine if c.path == path), key=lambda p: p[0].ctx)
            q = pts[0][1]
            x = [q.ppl_increase * 100] * len(pts)
            y = [c.median_ms for c, _ in pts]
            style = path_style(path)
            ax.plot(x, y, lw=0.8, **style)
            if q.ppl_increase_low is not None:
                ax.errorbar(x[:1], y[:1], xerr=[[x[0] - q.ppl_increase_low * 100],
                                                [q.ppl_increase_high * 100 - x[0]]],
                            fmt="none", ecolor=style["color"], capsize=3)
            contexts = ", ".join(str(c.ctx) for c, _ in pts)
            ax.annotate(f"{path} (ctx {contexts})", (x[0], y[0]), textcoords="offset points",
                        xytext=(6, 4), fontsize=7, color=style["color"])
        ax.axvline(0, color="grey", lw=0.8)
        ax.set(yscale="log", xlabel="perplexity increase over float32 (%, 95% interval)",
               ylabel="ms per decode step (median)", title=f"{model} on {gpu}")
        ax.title.set_fontsize(9)
        plain(ax.yaxis)
    return fig, sorted({q.id for _, q in pairs}), None
