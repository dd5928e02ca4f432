"""What the commands print with: the consoles, progress bars, and the tables, columns and labels
of cells, runs, quality and speculation measurements."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from floorline.measure.energy import energy_problem
from floorline.measure.quality import RANDOM_WEIGHTS
from floorline.measure.quality import describe as describe_quality
from floorline.measure.reduction import describe, reductions
from floorline.models import model_label
from floorline.records import UNSTEADY, VALID
from floorline.stats import percent
from floorline.store import CellRow, QualityRow, SpeculationRow

# Wide when piped, so that tables in logs and CI keep their columns.
out = Console(width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, soft_wrap=True)  # messages whole, never broken at 80 columns


def progress_bar():
    """Progress on stderr with the time left, estimated from the items done so far (redrawn in
    place on a terminal; in a log, one line when it ends)."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(), console=err)


def fleet_progress():
    """progress_bar() with a line per worker under it: its GPU, the cell it is measuring and
    how many it has finished. Returns the bar and the lines, by worker, to update."""
    bar, lines = progress_bar(), {}
    bars = bar.get_renderables

    def renderables():
        yield from bars()
        for worker, line in sorted(list(lines.items())):
            yield Text(f"  worker {worker} {line}")

    bar.get_renderables = renderables
    return bar, lines


def num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def warmup_columns(details: dict) -> list[str]:
    """Warm-up steps (marked where the step never settled before the cap) and drift."""
    steps = details.get("warmup_steps")
    unsteady = " (not steady)" if details.get("steady") is False else ""
    label = "-" if steps is None else f"{steps}{unsteady}"
    return [label, num(details.get("drift"), ".3f")]


def energy_columns(e: dict | None) -> list[str]:
    """J/token (with its interval over windows where there is one; "not valid" where the
    reading failed its checks, the caption saying why), mean and limit watts, SM clock and
    temperature at start and end of metering."""
    if e is None:
        return ["-"] * 4
    start, end = e["at_start"], e["at_end"]
    span = lambda k: ("-" if start[k] is None and end[k] is None  # noqa: E731
                      else f"{num(start[k], 'd')}-{num(end[k], 'd')}")
    joules = f"{e['joules_per_token']:.4g}"
    if "joules_per_token_low" in e:
        joules += f" ({e['joules_per_token_low']:.4g}-{e['joules_per_token_high']:.4g})"
    return [f"not valid ({joules})" if energy_problem(e) else joules,
            f"{e['mean_watts']:.0f} ({num(e['power_limit_w'], '.0f')})",
            span("sm_clock_mhz"), span("temperature_c")]


def quality_columns(row: CellRow, q: QualityRow | None) -> list[str]:
    """A cell's quality (its model, base path and gpu's): the perplexity increase over float32
    and KL (`floorline quality` prints their intervals), or why there are none."""
    if q is not None and q.ppl is not None:
        return [f"{q.ppl_increase:+.2%}", f"{q.kl:.3g}"]
    if q is not None:
        return [q.reason or "-", "-"]
    return [RANDOM_WEIGHTS if row.details.get("real_weights") is False else "-", "-"]


def status_label(status: str, note: int | None = None) -> str:
    """A cell's status as the table shows it: valid plain, unsteady (figures kept, left out of
    reports) yellow, anything else red; with the number of its note below the table."""
    mark = "" if note is None else f" ({note})"
    if status == VALID:
        return status + mark
    return f"[{'yellow' if status == UNSTEADY else 'red'}]{escape(status + mark)}[/]"


class Notes:
    """Reasons and warnings keyed to table rows: each row with one gets the next number, and
    the table's caption lists them under it, one paragraph each, never a column of its own."""

    def __init__(self):
        self.lines: list[str] = []

    def add(self, who: str, text: str | None) -> int | None:
        """The number of `who`'s note `text` (None where there is none)."""
        if not text:
            return None
        self.lines.append(f"({len(self.lines) + 1}) {who}: {text}")
        return len(self.lines)


def caption(table: Table, lines: list[str]) -> None:
    """Lines under `table`, flush left, whole."""
    if lines:
        table.caption = escape("\n".join(lines))
        table.caption_justify = "left"


# Columns a narrow terminal leaves out first, in order (print_table): the rest are a cell's key,
# status and step time.
DROPPED_FIRST = ("°C", "SM MHz", "W (limit)", "J/token", "prefill tok/s", "TTFT ms", "drift",
                 "warm-up", "vs 16-bit: expected / realised (share)", "of measured", "KL",
                 "GB/s", "run", "fp32 ppl", "reply cap", "dtype", "gpu", "floor ms",
                 "plain ms/token", "floor ms/token", "same replies", "ppl (95% CI)",
                 "KL nats/token (95% CI)", "p10-p90 ms", "ppl vs fp32")


def print_table(console: Console, table: Table) -> None:
    """`table` on `console` one line a row: where it is wider than the console, columns of
    DROPPED_FIRST are left out, in order, until it fits, and its caption names them."""
    left_out, unbounded = [], console.options.update_width(10_000)
    for name in DROPPED_FIRST:
        if Measurement.get(console, unbounded, table).maximum <= console.width:
            break
        at = next((i for i, c in enumerate(table.columns) if c.header == name), None)
        if at is not None:
            left_out.append(table.columns.pop(at).header)
    if left_out:
        note = (f"left out at {console.width} columns: {', '.join(left_out)} (a wider "
                "terminal, or `floorline show --json`, shows them)")
        table.caption = f"{table.caption}\n{escape(note)}" if table.caption else escape(note)
        table.caption_justify = "left"
    console.print(table)


MEASURED_MARK = "*"


def measured_peak(row: CellRow) -> bool:
    """Whether a cell's floor is at a bandwidth measured when it ran (a CPU's: hardware.detect),
    not a datasheet's."""
    source = row.details.get("peak_source") or ""
    return source.startswith("measured") or (not source and row.gpu == "cpu")


def measured_mark(row: CellRow) -> str:
    return MEASURED_MARK if row.floor_ms is not None and measured_peak(row) else ""


def measured_floor_note(rows: list[CellRow]) -> list[str]:
    """The caption line for floors marked measured_mark: at what bandwidth."""
    peaks = sorted({r.peak_gbps for r in rows if measured_mark(r) and r.peak_gbps})
    if not peaks:
        return []
    at = f"{peaks[0]:g}" if len(peaks) == 1 else f"{peaks[0]:g}-{peaks[-1]:g}"
    return [f"floor ms {MEASURED_MARK}: at the read bandwidth its sweep measured on this host "
            f"({at} GB/s), not a datasheet figure; it moves with the host's load"]


def cells_table(rows: list[CellRow], title: str, probes: dict[str, dict],
                quality: dict[int, QualityRow] | None = None, with_runs: bool = False) -> Table:
    """Cells with their fraction of the datasheet floor and, where this environment was probed,
    of the floor at the measured streaming-read bandwidth; with their quality (`quality`, by
    cell id: quality_by_cell), or a note where every cell runs random weights; `with_runs`:
    each row's run first."""
    quality = quality or {}
    random_only = not quality and all(r.details.get("real_weights") is False for r in rows)
    reduced = reductions(rows)
    columns = ["model", "ctx", "path", "gpu", "status", "ms/step", "p10-p90 ms", "floor ms",
               "of floor", "of measured", "GB/s"]
    if reduced:
        columns.append("vs 16-bit: expected / realised (share)")
    prefilled = any("prefill_ms" in r.details for r in rows)  # paths that time their prefill
    if prefilled:
        columns += ["TTFT ms", "prefill tok/s"]
    warmed = any("warmup_steps" in r.details for r in rows)  # cells since warm-up was recorded
    if warmed:
        columns += ["warm-up", "drift"]
    energy = any("energy" in r.details for r in rows)
    if energy:
        columns += ["J/token", "W (limit)", "SM MHz", "°C"]
    if not random_only:
        columns += ["ppl vs fp32", "KL"]
    table = Table(*(["run"] if with_runs else []), *columns, title=escape(title))
    notes = sorted({r.details["energy_note"] for r in rows if "energy_note" in r.details})
    notes += sorted({f"{r.model} ctx {r.ctx} {r.path}: not valid, {problem}" for r in rows
                     if "energy" in r.details and (problem := energy_problem(r.details["energy"]))})
    keyed = Notes()
    pct = lambda v: "-" if v is None else percent(v)  # noqa: E731
    for r in rows:
        spread = f"{r.p10_ms:.2f}-{r.p90_ms:.2f}" if r.p10_ms is not None else "-"
        note = keyed.add(f"{model_label(r.model)} ctx {r.ctx} {r.path}", r.reason)
        table.add_row(
            *([num(r.run_id, "d")] if with_runs else []),
            escape(model_label(r.model)), str(r.ctx), escape(r.path), escape(r.gpu),
            status_label(r.status, note),
            num(r.median_ms, ".2f"), spread, num(r.floor_ms, ".3f") + measured_mark(r),
            pct(r.fraction_of_floor), pct(r.fraction_of_measured(probes)),
            num(r.achieved_gbps, ".0f" if (r.achieved_gbps or 0) >= 100 else ".2f"),
            *([describe(reduced.get(r.id))] if reduced else []),
            *([num(r.details.get("prefill_ms"), ".1f"),
               num(r.details.get("prefill_tokens_per_s"), ".0f")] if prefilled else []),
            *(warmup_columns(r.details) if warmed else []),
            *(energy_columns(r.details.get("energy")) if energy else []),
            *(map(escape, quality_columns(r, quality.get(r.id))) if not random_only else []),
        )
    products = sorted({(r.path, r.details["cpu_products"]) for r in rows
                       if "cpu_products" in r.details})
    caption(table, keyed.lines + (["energy per token: " + "; ".join(notes)] if notes else [])
            + ([f"quality: {RANDOM_WEIGHTS}"] if random_only else []) + measured_floor_note(rows)
            + [f"{path}'s products on this CPU: {routes}" for path, routes in products])
    return table


def print_cell_notes(console: Console, cell, name: str) -> None:
    """After a sweep's cell: why it is not valid (unsteady in yellow, invalid plain), and in
    yellow the warning of a host that was busy while it ran."""
    if cell.reason:
        line = f"{cell.status}: {name}: {cell.reason}"
        console.print(f"[yellow]{escape(line)}[/]" if cell.status == UNSTEADY else line,
                      highlight=False, markup=cell.status == UNSTEADY)
    warning = cell.details.get("host_warning")
    if warning:
        console.print(f"[yellow]{escape(f'busy host: {name}: {warning}')}[/]", highlight=False)


def print_again(console: Console, n: int) -> None:
    """Before a sweep's second attempt at the cells it found unsteady."""
    console.print(f"measuring the {n} unsteady cell(s) once more, after the others",
                  highlight=False, markup=False)


def runs_table(runs: list[dict], title: str) -> Table:
    """One line per run: what ran, when, and the provenance that decides its class."""
    table = Table("run", "command", "label", "started", "ended", "code", "kernels", "tuning",
                  "gpu", "flags", "rows", title=escape(f"runs of {title}"))
    for r in runs:
        p = r["provenance"]
        code = p.get("code") or {}
        gpu = p.get("gpu") or {}
        card = " ".join(str(x) for x in (p.get("device"), gpu.get("uuid"),
                                         gpu.get("power_limit_w") and f"{gpu['power_limit_w']:g} W")
                        if x)
        merged = r["options"].get("merged_from")
        table.add_row(str(r["id"]), escape(r["command"] + (f" from {merged}" if merged else "")),
                      escape(r["label"] or "-"), r["started_at"], r["finished_at"] or
                      "[yellow]did not finish[/]", escape(code.get("version", "not recorded")),
                      code.get("kernels_sha256", "-")[:12], code.get("tuning_sha256", "-")[:12],
                      escape(card or "-"),
                      escape(" ".join(f"{k}={v}" for k, v in (p.get("flags") or {}).items())
                             or "-"),
                      ", ".join(f"{n} {t}" for t, n in r["rows"].items() if n) or "0")
    return table


def quality_table(rows: list[QualityRow], title: str) -> Table:
    """Quality measurements: each path's perplexity, its increase over float32's and KL with
    their 95% intervals over windows, and greedy agreement; or why one has none."""
    table = Table("model", "path", "gpu", "status", "ppl (95% CI)", "fp32 ppl",
                  "vs fp32 (95% CI)", "KL nats/token (95% CI)", "greedy, 32 new tokens",
                  title=escape(title))
    keyed = Notes()
    for q in rows:
        f = describe_quality(q)
        table.add_row(escape(model_label(q.model)), escape(q.path), escape(q.gpu),
                      status_label(q.status, keyed.add(f"{model_label(q.model)} {q.path}",
                                                       q.reason)),
                      f["ppl"], f["reference_ppl"], f["vs_fp32"], f["kl"], escape(f["greedy"]))
    caption(table, keyed.lines)
    return table


def speculation_table(rows: list[SpeculationRow], title: str) -> Table:
    """Speculative decoding per drafter and workload: drafts kept, tokens a step, ms a token
    with it and without it (the same replies), the floor per token, and how many replies were
    the same token for token; or why a row has none."""
    table = Table("model", "path", "drafter", "k", "dtype", "workload", "reply cap", "gpu",
                  "status", "kept", "tokens/step", "ms/token", "plain ms/token", "speedup",
                  "floor ms/token", "same replies", title=escape(title))
    keyed = Notes()
    for r in rows:
        valid = r.status == VALID
        note = keyed.add(f"{model_label(r.model)} {r.path} {r.drafter} {r.workload}", r.reason)
        table.add_row(escape(model_label(r.model)), escape(r.path), escape(r.drafter),
                      str(r.draft_tokens), r.dtype, escape(r.workload), str(r.max_new_tokens),
                      escape(r.gpu), status_label(r.status, note),
                      num(r.acceptance, ".0%"), num(r.tokens_per_step, ".2f"),
                      num(r.ms_per_token, ".3f"), num(r.plain_ms_per_token, ".3f"),
                      num(r.speedup, ".2f"), num(r.floor_ms_per_token, ".3f"),
                      f"{r.identical}/{r.prompts}" if valid else "-")
    caption(table, keyed.lines)
    return table
