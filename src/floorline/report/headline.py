"""The headline figure: for each model, GPU and context, every path measured as a bar of
ms/step on one linear axis, the memory floor as a line, each bar labelled with its fraction of
the floor."""

from __future__ import annotations

from statistics import median

from floorline.report.figures import NO_CELLS, plt
from floorline.report.quotes import one_class, steady
from floorline.stats import percent
from floorline.store import CellRow
from floorline.traffic import WEIGHT_FORMATS

UNQUANTISED, QUANTISED = "tab:blue", "tab:orange"


def is_quantised(weight_format: str) -> bool:
    fmt = WEIGHT_FORMATS.get(weight_format)
    return fmt is not None and fmt.bits < 16


def ladder(cells: list[CellRow]) -> list[dict]:
    """The figure's numbers: one panel per (model, GPU, context), one bar per path, slowest
    first. A path measured more than once is drawn at the median of its runs in the class of
    its newest (report/quotes.py: the same code and environment), each run kept in `runs`;
    unsteady runs are left out. A bar's fraction is its own floor (that of its weight format)
    over its ms/step; the panel's `floor_ms` is the floor of its 16-bit bars, None when it
    has only quantised ones."""
    groups: dict[tuple, dict[str, list[CellRow]]] = {}
    for c in cells:
        if steady(c) and c.median_ms and c.floor_ms:
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


def label(bar: dict) -> str:
    runs = f", median of {len(bar['runs'])} runs" if len(bar["runs"]) > 1 else ""
    own = " of its floor" if bar["quantised"] else " of the floor"
    return f"{percent(bar['fraction'])}{own}{runs}"


def headline(cells: list[CellRow]):
    """The headline figure; returns (figure, cell ids, what is missing)."""
    panels = ladder(cells)
    if not panels:
        return None, [], NO_CELLS
    heights = [len(p["bars"]) * 0.32 + 0.9 for p in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, sum(heights) + 0.8), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, panel in zip(axes[:, 0], panels):
        bars = panel["bars"]
        y = range(len(bars))
        ax.barh(y, [b["ms"] for b in bars], height=0.7,
                color=[QUANTISED if b["quantised"] else UNQUANTISED for b in bars],
                hatch=["//" if b["quantised"] else "" for b in bars], edgecolor="white")
        for i, b in zip(y, bars):
            ax.plot([b["floor_ms"]] * 2, [i - 0.4, i + 0.4], color="black", lw=1.5)
            if len(b["runs"]) > 1:
                ax.plot(b["runs"], [i] * len(b["runs"]), "k.", ms=4)
            ax.annotate(label(b), (max(b["ms"], *b["runs"]), i), xytext=(4, 0),
                        textcoords="offset points", va="center", fontsize=7)
        if panel["floor_ms"] is not None:
            ax.axvline(panel["floor_ms"], color="black", ls="--", lw=1)
        top = max(max(b["ms"], *b["runs"]) for b in bars)
        ax.set_xlim(0, top * 1.45)  # room for the labels right of the longest bar
        ax.set_yticks(list(y), [b["path"] for b in bars], fontsize=8)
        ax.set_ylim(len(bars) - 0.5, -0.5)
        ax.set_title(f"{panel['model']} on {panel['gpu']}, ctx {panel['ctx']}", fontsize=9,
                     loc="left")
        ax.tick_params(axis="x", labelsize=7)
    axes[-1, 0].set_xlabel("ms per decode step (median; shorter is faster)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=UNQUANTISED),
               plt.Rectangle((0, 0), 1, 1, facecolor=QUANTISED, hatch="//", edgecolor="white"),
               plt.Line2D([], [], color="black", ls="--"),
               plt.Line2D([], [], color="black", lw=1.5)]
    fig.legend(handles, ["16-bit (or wider) weights", "quantised weights",
                         "memory floor of 16-bit weights",
                         "the bar's own floor (its weight format)"],
               loc="upper center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.55 / (sum(heights) + 0.8)))
    return fig, sorted(i for p in panels for b in p["bars"] for i in b["ids"]), None
