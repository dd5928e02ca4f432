"""`floorline report`: the results database as an HTML page (images embedded, opens offline)
and a Markdown twin (images beside it)."""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

from floorline import stats
from floorline.forecast.accuracy import coverage, leave_one_out
from floorline.forecast.calibration import from_rows
from floorline.forecast.published import study_check
from floorline.measure.quality import describe as describe_quality
from floorline.records import VALID
from floorline.report import beside, figures, here
from floorline.report.headline import headline, small_multiples
from floorline.store import Store, quality_by_cell
from floorline.study import study

FIGURES = (
    ("headline", "The ladder of paths against the memory floor", "runs", headline),
    ("fraction", "Fraction of the memory floor against peak bandwidth", "cells",
     figures.fraction_vs_bandwidth),
    ("context", "ms/step against context, with each model's floor", "cells", figures.ms_vs_context),
    ("ab", "A/B experiments with 95% intervals, the study's beside", "ab", figures.ab_forest),
    ("quantised", "Quantised paths against their own floor and their 16-bit reference", "cells",
     figures.quantised),
    ("decomposition", "Where each millisecond of a step goes", "explanations",
     figures.decomposition),
    ("energy", "Energy per token against time per token, per path", "cells",
     figures.energy_vs_time),
    ("quality", "Speed against quality, per path", "quality", figures.speed_vs_quality),
    ("ladders", "Every path against the memory floor, per model, GPU and context", "runs",
     small_multiples),
    ("verify", "The verify step's cost against the tokens it checks", "cells",
     figures.verify_cost),
    ("speculation", "Speculative decoding per workload: ms per token against the floor",
     "speculation", figures.speculation),
)

SOURCE_NAMES = {"runs": "cells", "cells": "cells", "ab": "A/B experiments",
                "explanations": "explanations", "quality": "quality measurements",
                "speculation": "speculation measurements"}

QUALITY_NOTE = (
    "Each path is judged against transformers' own model of the same checkpoint in float32, on "
    "the same windows of the evaluation text (the start of Python's own reference "
    "documentation, as the measuring Python holds it): its perplexity and the increase over "
    "float32's, the mean KL divergence KL(float32 || path) per token, and greedy agreement over "
    "22 prompts of 32 new tokens each (a divergence where float32's top two tokens nearly tie is "
    "counted apart). A model's weights are what its directory holds: float32 is the quality of "
    "those values, not of the model its makers trained; SmolLM2-135M's directory, for one, holds "
    "its Q4_1 GGUF's values dequantised. Random weights have no quality to measure.")

BESIDE_NOTES = {
    "The study's published cells beside this database's": (
        "Each cell the study published, as it published it (ms per step where it printed one, "
        "else from its fraction of the floor), beside the same model, context, path and GPU here: "
        "the median over the runs of one provenance class, with its range and the number of "
        "runs. Both fractions of the floor count every parameter's bytes, as the study does; a "
        "cell this database lacks says not measured. Where this database holds an explain of "
        "the cell, the last column says how long the GPU was busy in the step and how long the "
        "step spent launching and idle per kernel: where a path launches every kernel from "
        "Python, that is its host's time, which differs from machine to machine."),
    "Forecast of the study's published cells": (
        "A path that launches every kernel from Python is forecast with the host its cells ran "
        "on in this database, so its error against the study's figure measures the two "
        "machines' hosts as much as the forecast."),
    "The study's A/B beside this database's": (
        "The study's A/B experiments beside the newest A/B here of the same arms, GPU and "
        "context: the mean ratio over fresh sessions with its 95% BCa interval."),
}

# How to read a figure, where it is not plain from its axes.
NOTES = {
    "headline": (
        "One model, GPU and context: of each model's shortest context with two paths or more "
        "(where the weights, which every path must stream, weigh most in a step), the one with "
        "the most paths. One bar per path, slowest at the top, on a log axis of ms per decode "
        "step: a bar runs from the memory floor of its weight format (the black tick; lower for "
        "a quantised format, whose bars are hatched) to its median step, so that its length is "
        "how many times its floor the step takes; the dashed line is the floor of 16-bit (or "
        "wider) weights. Beside each bar: its ms/step, its fraction of its floor (100% would be "
        "a step that only moves its bytes at the peak bandwidth) and how many runs of the same "
        "code and environment its median is of. Drawn are every 16-bit path and the quantised "
        "paths faster than the fastest of them; the last figure has every path, model and "
        "context."),
    "ladders": (
        "The headline's bars for every model, GPU and context, every path included, on one log "
        "axis of ms per decode step shared by all panels; beside each bar, its fraction of its "
        "floor."),
    "verify": (
        "One panel per model and GPU, one line per path and context: the median step that checks "
        "K tokens at once (the path option +verifyK: the current token and K - 1 drafted ones) "
        "over the median one-token step, on log axes. The dotted diagonal is K one-token steps; "
        "a curve near 1 means drafted tokens cost almost nothing to check, so that speculative "
        "decoding gains nearly every token it keeps."),
    "speculation": (
        "One bar per model, path, drafter, draft length (k) and GPU on a workload (a few prompts "
        "through the chat template, each reply greedy and capped at the same length): the "
        "decode's ms per token with speculative decoding, against the same replies decoded one "
        "token a step (the black tick), the floor of one step at the replies' mean context "
        "(grey) and that floor over the tokens a step gave, verify and plain steps together "
        "(the diamond): speculation beats the one-step floor where its bar ends left of the "
        "grey tick. Beside each bar: the share of drafted tokens kept, the tokens a step, the "
        "speedup over the plain decode and how many replies were the same token for token "
        "(greedy verification keeps them all the same)."),
    "quality": (
        "One panel per model and GPU; one colour per path, at its perplexity increase over "
        "float32 (the bar: its 95% interval over windows), a point per context measured, at its "
        "median ms per step. " + QUALITY_NOTE),
}


def empty_tables() -> dict[str, str]:
    """Why each table can be empty, and what fills it, on the machine building the report."""
    return {
        "Cells (the newest row of each)": figures.NO_CELLS,
        "Forecast, leave-one-out": (
            "This table is empty: each valid cell on a GPU of the catalogue is forecast from the "
            "other cells of this database, and no path here has two such cells (a CPU's cells are "
            "not forecast). `floorline sweep` on a GPU at two contexts or more fills it."),
        "Forecast of the study's published cells": (
            "This table is empty: the study's cells (transformers eager and quantised paths) are "
            "forecast from valid cells of the same paths on a GPU of the catalogue, and this "
            "database holds none. `floorline sweep --paths hf-eager` on a GPU fills it."),
        "A/B experiments": (f"This database holds no A/B experiment: {here.ab_command()} runs "
                            "one on this machine."),
        "Quality against float32": (
            "This database holds no quality measurement: `floorline quality --models DIR"
            f"{here.paths_option('engine', 'engine-fp8')}` measures one on this machine for a "
            "checkpoint with real weights (random weights have no quality to measure)."),
        "Speculative decoding": figures.NO_SPECULATION,
        "Environments": ("There are no cells, so no environments: `floorline sweep` records each "
                         "cell's."),
    }


def md(text: str) -> str:
    """Text from a path, config or database, escaped so that Markdown shows it as it is."""
    return re.sub(r"([\\`*_\[\]<>|&~#])", r"\\\1", str(text).replace("\n", " "))


def prose_html(text: str) -> str:
    """Text as HTML: escaped, with `code` spans (the Markdown form) as <code> elements."""
    return re.sub(r"`([^`]*)`", r"<code>\1</code>", html.escape(str(text)))


def _fmt(v, percent: bool = False) -> str:
    if v is None:
        return "-"
    if percent:
        return stats.percent(v)
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _table(header: list[str], rows: list[list], percent: tuple[str, ...] = ()) -> tuple[str, str]:
    """The same table as HTML and as Markdown; columns named in `percent` hold fractions."""
    cells = [[_fmt(v, h in percent) for h, v in zip(header, row)] for row in rows]
    h = ("<table><tr>" + "".join(f"<th>{html.escape(x)}</th>" for x in header) + "</tr>"
         + "".join("<tr>" + "".join(f"<td>{prose_html(v)}</td>" for v in r) + "</tr>"
                   for r in cells)
         + "</table>")
    m = "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                  + ["| " + " | ".join(md(v) for v in r) + " |" for r in cells])
    return h, m


def _reasons_below(header: list[str], rows: list[list]) -> tuple[list[list], list[str] | None]:
    """A table whose last column is "reason" (its first the row's id, its status a column):
    the rows without it, and the reasons as notes keyed by id and status, to print below the
    table (None where the table has no such column)."""
    if header[-1] != "reason":
        return rows, None
    status = header.index("status")
    notes = [f"{header[0]} {r[0]} ({r[status]}): {r[-1]}" for r in rows if r[-1]]
    return [r[:-1] for r in rows], notes


def _quality_row(q) -> list:
    """A row of the quality table: the measurement's key, figures as text, reason."""
    f = describe_quality(q)
    return [q.id, q.model, q.path, q.gpu, q.status, f"{q.tokens} in windows of {q.window}",
            f["ppl"], f["reference_ppl"], f["vs_fp32"], f["kl"], f["greedy"], q.reason]


def read_sources(store: Store) -> dict:
    """What the figures are drawn from, by the names FIGURES gives them."""
    # The ladders draw every stored row (runs merged from several databases, re-measures); the
    # rest, the newest row of each cell.
    sources = {"runs": store.rows(latest=False), "cells": store.rows(),
               "ab": store.ab_summaries(), "explanations": store.explanations(),
               "speculation": store.speculation_rows()}
    matched = quality_by_cell(sources["cells"], store.quality_rows())
    sources["quality"] = [(c, matched[c.id]) for c in sources["cells"]
                          if c.status == VALID and c.id in matched
                          and matched[c.id].status == VALID]
    return sources


def build_report(db: Path, out: Path) -> dict:
    """Writes index.html, report.md and one PNG per figure into `out`; returns what it wrote."""
    store = Store(db, read_only=True)
    sources = read_sources(store)
    quality = store.quality_rows()
    out.mkdir(parents=True, exist_ok=True)
    html_parts, md_parts, written = [], [], {"figures": [], "missing": []}
    title = f"floorline report: {db.name}"
    html_parts.append(f"<h1>{html.escape(title)}</h1>")
    md_parts.append(f"# floorline report: {md(db.name)}")
    for number, (key, caption, source, draw) in enumerate(FIGURES, 1):
        fig, ids, missing = draw(sources[source])
        heading = f"{number}. {caption}"
        html_parts.append(f"<h2>{html.escape(heading)}</h2>")
        md_parts.append(f"## {heading}")
        if key in NOTES and fig is not None:
            html_parts.append(f"<p>{prose_html(NOTES[key])}</p>")
            md_parts.append(NOTES[key])
        if missing:
            written["missing"].append(f"figure {number}: {missing}")
            html_parts.append(f"<p class='missing'>{prose_html(missing)}</p>")
            md_parts.append(f"*{missing}*")
        if fig is not None:
            png = figures.png(fig)
            name = f"fig{number}_{key}.png"
            (out / name).write_bytes(png)
            data = base64.b64encode(png).decode()
            # onload/onerror mark each image, so that a browser (or the test) can tell it loaded
            # and where it lies on the page.
            html_parts.append(f"<img alt='{html.escape(caption)}' onload='this.dataset.loaded=1;"
                              "this.dataset.bottom=this.getBoundingClientRect().bottom;"
                              "this.dataset.scale=this.width/this.naturalWidth' "
                              f"onerror='this.dataset.broken=1' "
                              f"src='data:image/png;base64,{data}'>")
            md_parts.append(f"![{caption}]({name})")
            written["figures"].append(name)
        drawn = (f"Drawn from {SOURCE_NAMES[source]} {', '.join(map(str, ids))} of this database"
                 if ids else f"Drawn from no {SOURCE_NAMES[source]} of this database")
        if key in ("fraction", "ab", "quantised"):
            drawn += f"; reference series from {study()['provenance']}"
        html_parts.append(f"<p class='source'>{prose_html(drawn)}.</p>")
        md_parts.append(drawn + ".")

    cal = from_rows(sources["cells"], sources["explanations"], store.probes(), "cell",
                    store.probe_devices())
    loo = leave_one_out(cal)
    forecast_rows = [[r["source"].removeprefix("cell "), r["model"], r["gpu"], r["ctx"], r["path"],
                      r["kind"], r["measured_ms"], r["forecast_ms"], f"{r['error']:+.1%}"]
                     for r in loo]
    study_rows = [[r["gpu"], r["model"], r["ctx"], r["path"], r["published_ms"], r["forecast_ms"],
                   f"{r['error']:+.1%}" if r["forecast_ms"] is not None else
                   "not forecast: no host was measured with this GPU (floorline probe there)"]
                  for r in study_check(cal, study(), loo)
                  if r["forecast_ms"] is not None or r["host_missing"]]
    cell_rows = [[c.id, c.model, c.ctx, c.path, c.gpu, c.status, c.median_ms,
                  c.floor_ms, c.fraction_of_floor, c.achieved_gbps, c.reason]
                 for c in sources["cells"]]
    sections = [("Cells (the newest row of each)",
                 ["id", "model", "ctx", "path", "gpu", "status", "ms/step", "floor ms", "of floor",
                  "GB/s", "reason"], cell_rows),
                ("The study's published cells beside this database's",
                 ["gpu", "model", "ctx", "path", "study ms", "study of floor", "ms here",
                  "of floor here", "where the step goes here"],
                 beside.cells(sources["runs"], sources["explanations"])),
                ("The study's A/B beside this database's",
                 ["gpu", "ctx", "arms", "study", "here"], beside.ab(sources["ab"]))]
    if loo:
        parts = [f"{k}: mean absolute error {v['mae']:.1%} over {v['cells']} cells, the 90% "
                 f"interval held {v['covered']} of {v['with_interval']}"
                 for k, v in coverage(loo).items()]
        text = f"Leave-one-out over {len(loo)} cells; " + "; ".join(parts) + "."
        html_parts.append(f"<h2>Forecast accuracy</h2><p>{html.escape(text)}</p>")
        md_parts.append(f"## Forecast accuracy\n\n{md(text)}")
    sections.append(("Forecast, leave-one-out",
                     ["cell", "model", "gpu", "ctx", "path", "kind", "measured ms", "forecast ms",
                      "error"], forecast_rows))
    sections.append(("Forecast of the study's published cells", ["gpu", "model", "ctx", "path",
                     "published ms", "forecast ms", "error"], study_rows))
    sections.append(("A/B experiments", ["id", "sentence"],
                     [[e["id"], e["sentence"]] for e in sources["ab"]]))
    sections.append(("Quality against float32",
                     ["id", "model", "path", "gpu", "status", "tokens", "ppl", "fp32 ppl",
                      "vs fp32", "KL nats/token", "greedy", "reason"],
                     [_quality_row(q) for q in quality]))
    sections.append(("Speculative decoding",
                     ["id", "model", "path", "drafter", "k", "dtype", "workload", "reply cap",
                      "gpu", "status", "kept", "tokens/step", "ms/token", "plain ms/token",
                      "speedup", "floor ms/token", "same", "reason"],
                     [[r.id, r.model, r.path, r.drafter, r.draft_tokens, r.dtype, r.workload,
                       r.max_new_tokens, r.gpu, r.status, r.acceptance, r.tokens_per_step,
                       r.ms_per_token, r.plain_ms_per_token, r.speedup, r.floor_ms_per_token,
                       None if r.prompts is None else f"{r.identical}/{r.prompts}", r.reason]
                      for r in store.speculation_rows()]))
    fingerprints = {c.fingerprint_key: c.fingerprint for c in sources["cells"]}
    env_fields = ("device", "driver", "cuda", "torch", "transformers", "floorline")
    sections.append(("Environments", ["key", *env_fields],
                     [[k, *(f.get(x) for x in env_fields)] for k, f in fingerprints.items()]))
    empty = empty_tables()
    for name, header, rows in sections:
        rows, notes = _reasons_below(header, rows)
        header = header[:-1] if notes is not None else header
        h, m = _table(header, rows,
                      percent=("of floor", "kept", "study of floor", "of floor here"))
        if notes:
            h += "<ul>" + "".join(f"<li>{prose_html(n)}</li>" for n in notes) + "</ul>"
            m += "\n\n" + "\n".join(f"- {md(n)}" for n in notes)
        if name == "Quality against float32" and rows:
            h, m = f"<p>{prose_html(QUALITY_NOTE)}</p>{h}", f"{QUALITY_NOTE}\n\n{m}"
        if name in BESIDE_NOTES:
            h, m = (f"<p>{prose_html(BESIDE_NOTES[name])}</p>{h}",
                    f"{BESIDE_NOTES[name]}\n\n{m}")
        html_parts.append(f"<h2>{html.escape(name)}</h2>"
                          + (h if rows else f"<p class='missing'>{prose_html(empty[name])}</p>"))
        md_parts.append(f"## {name}\n\n" + (m if rows else f"*{empty[name]}*"))
    style = ("body{font-family:sans-serif;max-width:1100px;margin:auto;padding:1em}"
             "img{max-width:100%}table{border-collapse:collapse;font-size:12px}"
             "td,th{border:1px solid #ccc;padding:2px 6px}.missing{color:#b00}"
             "code{background:#f3f3f3}.source{color:#555;font-size:12px}")
    (out / "index.html").write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{style}</style></head><body>{''.join(html_parts)}</body></html>\n")
    (out / "report.md").write_text("\n\n".join(md_parts) + "\n")
    return written
