"""The headline figure, one panel a reader takes in at a glance, and its small multiples (every
model, GPU and context). In both, a path is a bar from the floor of its weight format to its
ms/step on a log axis, so that a bar's length is how many times its floor the step takes."""

from __future__ import annotations

from statistics import median

from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from floorline.paths import verify_tokens
from floorline.report.figures import (
    HATCH,
    NO_CELLS,
    QUANTISED,
    UNQUANTISED,
    bars_and_table,
    legend_below,
    log_x,
    plt,
    table,
)
from floorline.report.quotes import one_class, quote, steady
from floorline.stats import percent
from floorline.store import CellRow
from floorline.traffic import WEIGHT_FORMATS

WIDTH = 8.2  # inches: 900 pixels at the report's 110 dpi, a README's width


def is_quantised(weight_format: str) -> bool:
    fmt = WEIGHT_FORMATS.get(weight_format)
    return fmt is not None and fmt.bits < 16


def ladder(cells: list[CellRow]) -> list[dict]:
    """The figures' numbers: one panel per (model, GPU, context), one bar per path, slowest
    first. A path measured more than once is drawn at the median of its runs in the class of
    its newest (report/quotes.py: the same code and environment), each run kept in `runs`;
    unsteady runs are left out. A bar's fraction is its own floor (that of its weight format)
    over its ms/step; the panel's `floor_ms` is the floor of its 16-bit bars, None when it
    has only quantised ones."""
    groups: dict[tuple, dict[str, list[CellRow]]] = {}
    for c in cells:
        # a verify step checks several tokens a step: its cost has a figure of its own
        if steady(c) and c.median_ms and c.floor_ms and verify_tokens(c.path) == 1:
            by_path = groups.setdefault((c.model, c.gpu, c.ctx), {})
            by_path.setdefault(c.path, []).append(c)
    panels = []
    for (model, gpu, ctx), paths in sorted(groups.items()):
        bars = []
        for path, runs in paths.items():
            _, runs = one_class(runs)
            ms, floor_ms = median(r.median_ms for r in runs), median(r.floor_ms for r in runs)
            bars.append({"path": path, "ms": ms, "floor_ms": floor_ms, "fraction": floor_ms / ms,
                         "quantised": is_quantised(runs[0].weight_format),
                         "weight_format": runs[0].weight_format,
                         "runs": [r.median_ms for r in runs], "ids": [r.id for r in runs]})
        bars.sort(key=lambda b: (-b["ms"], b["path"]))
        full = [b["floor_ms"] for b in bars if not b["quantised"]]
        panels.append({"model": model, "gpu": gpu, "ctx": ctx, "bars": bars,
                       "floor_ms": median(full) if full else None})
    return panels


def quoted(sources: list[list[CellRow]], model: str, ctx: int, paths) -> list[CellRow]:
    """The runs a quoted table gives for each of `paths` (its ms/step; report/quotes.py), from
    the first of `sources` with a steady run of it: drawn, they make its figure."""
    rows = []
    for path in paths:
        for source in sources:
            step = quote(source, model, ctx, path)
            if step:
                rows += [r for r in source if r.id in step.ids]
                break
    return rows


def pick(panels: list[dict]) -> dict:
    """The headline's panel: of each model's shortest context with two paths or more (where
    the weights, which every path must stream, weigh most in a step), the one with the most."""
    shortest: dict[tuple, dict] = {}
    for p in [p for p in panels if len(p["bars"]) > 1] or panels:  # sorted by context
        shortest.setdefault((p["model"], p["gpu"]), p)
    return max(shortest.values(), key=lambda p: len(p["bars"]))


def rungs(bars: list[dict]) -> tuple[list[dict], list[dict]]:
    """The headline's bars and those left to the small multiples: every 16-bit path, and the
    quantised paths faster than the fastest 16-bit one."""
    fastest = min((b["ms"] for b in bars if not b["quantised"]), default=float("inf"))
    keep = [b for b in bars if not b["quantised"] or b["ms"] < fastest]
    return keep, [b for b in bars if b not in keep]


def ms_axis(ax, bars: list[dict]) -> None:
    log_x(ax, min(b["floor_ms"] for b in bars) / 1.3, max(b["ms"] for b in bars) * 1.3)


def draw(ax, bars: list[dict], floor_ms: float | None, fontsize: float) -> None:
    """One panel: a bar per path from its own floor (the tick) to its ms, the 16-bit floor as a
    dashed line, the paths slowest at the top."""
    y = list(range(len(bars)))
    ax.barh(y, [b["ms"] - b["floor_ms"] for b in bars], left=[b["floor_ms"] for b in bars],
            height=0.62, color=[QUANTISED if b["quantised"] else UNQUANTISED for b in bars],
            hatch=[HATCH if b["quantised"] else "" for b in bars], edgecolor="white", lw=0)
    ax.vlines([b["floor_ms"] for b in bars], [i - 0.4 for i in y], [i + 0.4 for i in y],
              color="black", lw=1.5)
    if floor_ms is not None:
        ax.axvline(floor_ms, color="black", ls="--", lw=0.9)
    ax.set_yticks(y, [b["path"] for b in bars], fontsize=fontsize)
    ax.set_ylim(len(bars) - 0.5, -0.5)
    ax.tick_params(axis="x", labelsize=fontsize)
    ax.tick_params(axis="y", length=0)


def legend(fig, bars: list[dict], fontsize: float, floor_ms: float | None = None) -> None:
    """What the bars' colours, hatching, ticks and dashed line mean, for those drawn."""
    kinds = {b["quantised"] for b in bars}
    entries = [(False in kinds, Patch(color=UNQUANTISED), "16-bit (or wider) weights"),
               (True in kinds, Patch(facecolor=QUANTISED, hatch=HATCH, edgecolor="white"),
                "quantised weights"),
               (True, Line2D([], [], color="black", marker="|", ls="", ms=9, mew=1.5),
                "floor of the bar's weight format"),
               (False in kinds, Line2D([], [], color="black", ls="--", lw=0.9),
                "16-bit floor" + (f" ({floor_ms:.2f} ms)" if floor_ms else ""))]
    shown = [(handle, text) for drawn, handle, text in entries if drawn]
    legend_below(fig, *zip(*shown), fontsize=fontsize)


def headline(cells: list[CellRow]):
    """The headline figure (900 pixels wide); returns (figure, cell ids, what is missing)."""
    panels = ladder(cells)
    if not panels:
        return None, [], NO_CELLS
    panel = pick(panels)
    bars, left_out = rungs(panel["bars"])
    fig, ax, tab = bars_and_table((WIDTH, 0.27 * len(bars) + 1.7), 3)
    draw(ax, bars, panel["floor_ms"], 8.5)
    ms_axis(ax, bars)
    table(tab, [[f"{b['ms']:.2f}", percent(b["fraction"]), str(len(b["runs"]))] for b in bars],
          ["ms/step", "of floor", "runs"], 8.5)
    fig.suptitle(f"{panel['model']} on {panel['gpu']}, ctx {panel['ctx']}: ms per decode step "
                 "against the memory floor", fontsize=10)
    xlabel = "ms per decode step (log axis; a bar runs from its format's floor to the median step)"
    if left_out:
        paths = f"{len(left_out)} quantised path{'s' if len(left_out) > 1 else ''}"
        xlabel += (f"\nnot drawn: {paths} slower than a 16-bit one (every path is in the "
                   "report's small multiples)")
    ax.set_xlabel(xlabel, fontsize=8.5)
    legend(fig, bars, 8.5, panel["floor_ms"])
    return fig, sorted(i for b in bars for i in b["ids"]), None


def newspaper(heights: list[float], n: int) -> list[list[int]]:
    """Panels, in reading order, cut into at most `n` columns of about equal height."""
    target, cols, height = sum(heights) / n, [[]], 0.0
    for i, h in enumerate(heights):
        if cols[-1] and height + h / 2 > target and len(cols) < n:
            cols.append([])
            height = 0.0
        cols[-1].append(i)
        height += h
    return cols


def small_multiples(cells: list[CellRow]):
    """Every panel with every path, in columns, on one shared log axis; returns (figure, cell
    ids, what is missing)."""
    panels = ladder(cells)
    if not panels:
        return None, [], NO_CELLS
    # Inches: a bar's row, and a panel's title and ticks. The layout keeps the axes' heights in
    # the ratio of their bars, so that a bar is as thick in every panel.
    row, margins = 0.17, 0.4
    heights = [row * len(p["bars"]) + margins for p in panels]
    cols = newspaper(heights, min(3, len(panels)))
    tallest = max(sum(heights[i] for i in col) for col in cols)
    fig = plt.figure(figsize=(10, tallest + 0.5), layout="constrained")
    every = [b for p in panels for b in p["bars"]]
    for sub, col in zip(fig.subfigures(1, len(cols), squeeze=False)[0], cols):
        spare = tallest - sum(heights[i] for i in col)
        axes = sub.subplots(len(col) + 1, 2, height_ratios=[len(panels[i]["bars"]) for i in col]
                            + [max(spare / row, 1e-3)], width_ratios=[5, 1], sharey="row")
        for ax in axes[-1]:
            ax.axis("off")
        for (ax, tab), i in zip(axes, col):
            p = panels[i]
            draw(ax, p["bars"], p["floor_ms"], 6)
            ms_axis(ax, every)
            table(tab, [[percent(b["fraction"])] for b in p["bars"]], [], 6)
            ax.set_title(f"{p['model']} on {p['gpu']}, ctx {p['ctx']}", fontsize=7, loc="left")
    legend(fig, every, 7)
    return fig, sorted(i for b in every for i in b["ids"]), None
