"""What the results database holds, and what it says: `show`, `merge`, `report`, and `predict`,
the forecast for any catalogued GPU."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from floorline.cli.options import DB_OPTION, named_gpu, one_context, resolve_noted
from floorline.cli.render import cells_table, err, out, print_table, runs_table, speculation_table
from floorline.errors import FloorlineError
from floorline.measure.reduction import reductions
from floorline.paths import parse_path
from floorline.store import COLUMNS, Store, merge, quality_by_cell


def report(
    db: DB_OPTION = Path("floorline.db"),
    out_dir: Annotated[Path, typer.Option(
        "--out", help="Folder for index.html, report.md and PNGs.")] = Path("report"),
) -> None:
    """The results database as plots and tables: HTML (self-contained) and Markdown."""
    from floorline.report.build import build_report  # loads matplotlib: only for this command

    try:
        written = build_report(db, out_dir)
    except OSError as e:
        raise FloorlineError(f"cannot write the report to {out_dir}: {e.strerror}") from None
    out.print(f"wrote {out_dir / 'index.html'} and {out_dir / 'report.md'} "
              f"({len(written['figures'])} figures)", highlight=False, markup=False)
    for line in written["missing"]:
        err.print(f"missing: {line}", highlight=False, markup=False, soft_wrap=True)


def predict_cmd(
    model: Annotated[str, typer.Option(help="Shipped name or local directory.")],
    gpu: Annotated[str, typer.Option(help="Catalogue name of the GPU to forecast.")],
    path: Annotated[str, typer.Option(help="A path measured on a GPU (shipped or in --db).")],
    ctx: Annotated[str, typer.Option(help="Context length.")] = "2048",
    db: Annotated[Path | None, typer.Option(
        "--db", help="Your results database, added to the shipped H200 calibration; "
                     "default: floorline.db where it exists.")] = None,
    replace: Annotated[bool, typer.Option(
        "--replace", help="Fit from --db alone, without the shipped calibration.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the forecast as JSON.")] = False,
) -> None:
    """Forecast ms/step on any catalogued GPU from measured terms, with a 90% interval."""
    from floorline.forecast.accuracy import LEVEL, forecast
    from floorline.forecast.calibration import fitted_from

    if replace and db is None:
        raise FloorlineError("--replace needs --db: the database to fit from instead")
    # as the cells name them; the names checked before a model's config is read
    gpu, path = named_gpu(gpu).name, parse_path(path).name
    model = resolve_noted(model).name
    f = forecast(fitted_from(db, replace), model, gpu, one_context(ctx, "predict"), path)
    if as_json:
        print(json.dumps(f.as_dict(), indent=2))
        return
    interval = (f"{LEVEL:.0%} interval {f.low:.2f}-{f.high:.2f} ms from {f.errors_used} held-out "
                f"{f.fit.kind} cells" if f.low is not None else
                f"no interval: {f.errors_used} held-out {f.fit.kind} cells are too few for "
                f"{LEVEL:.0%}")
    s = f.step
    parts = ", ".join(f"{name} {ms:.2f}" for name, ms in s.parts.items() if ms)
    out.print(f"{f.fit.path} on {f.gpu}, {f.model} ctx {f.ctx}: {f.ms:.2f} ms/step ({interval})\n"
              f"  GPU side {s.gpu_ms:.2f} ms ({parts}); host side {s.host_ms:.2f} ms; the "
              f"{'GPU' if s.gpu_ms >= s.host_ms else 'host'} side governs",
              highlight=False, markup=False)
    out.print("  terms:", highlight=False, markup=False)
    for term in f.fit.terms.values():
        out.print(f"    {term.line()}", highlight=False, markup=False, soft_wrap=True)
    for note in f.notes():
        out.print(f"  - {note}", highlight=False, markup=False, soft_wrap=True)


def show(
    db: DB_OPTION = Path("floorline.db"),
    as_json: Annotated[bool, typer.Option(
        "--json", help="Every field, samples included, as JSON.")] = False,
    as_csv: Annotated[bool, typer.Option("--csv", help="One CSV row per cell.")] = False,
    history: Annotated[bool, typer.Option(
        "--all", help="Every row, not only each cell's newest.")] = False,
    runs: Annotated[bool, typer.Option(
        "--provenance", help="The runs that wrote the database: each one's command line, code "
                             "(commit, kernel and tuning hashes), GPU and flags; the cells "
                             "table names each row's run.")] = False,
) -> None:
    """The cells in the results database; in the table view, its speculative decoding
    measurements too (--json and --csv print the cells)."""
    store = Store(db, read_only=True)
    if runs and not (as_json or as_csv):
        print_table(out, runs_table(store.runs(), str(db)))
    rows = store.rows(latest=not history, skip_damaged=True)
    quality = quality_by_cell(rows, store.quality_rows(skip_damaged=True))
    if as_json:
        reduced = reductions(rows)
        print(json.dumps([{**r.as_dict(), "reduction": reduced.get(r.id),
                           "quality": quality[r.id].as_dict() if r.id in quality else None}
                          for r in rows], indent=2))
    elif as_csv:
        writer = csv.DictWriter(sys.stdout, fieldnames=COLUMNS)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: json.dumps(v) if isinstance(v, (list, dict)) else v
                             for k, v in r.as_dict().items()})
    else:
        if rows:
            print_table(out, cells_table(rows, str(db), store.probes(), quality, with_runs=runs))
        else:
            out.print(f"no cells in {db}", highlight=False, markup=False)
        speculation = store.speculation_rows(latest=not history, skip_damaged=True)
        if speculation:
            print_table(out, speculation_table(speculation, f"{db}: speculative decoding"))
    if store.damaged:
        more = "; ..." if len(store.damaged) > 3 else ""
        raise FloorlineError(f"{db}: {len(store.damaged)} damaged row(s) left out ("
                             + "; ".join(store.damaged[:3]) + more + ")")


def merge_cmd(
    target: Annotated[Path, typer.Argument(help="The database to merge into (made if absent).")],
    sources: Annotated[list[Path], typer.Argument(help="Databases to merge from (read only).")],
) -> None:
    """Merge results databases into one: every cell, quality and speculation measurement, A/B
    experiment, explanation and probe the target does not already hold; each merged cell
    records the file and row it came from."""
    resolved = target.resolve()
    if any(s.resolve() == resolved for s in sources):
        raise FloorlineError(f"{target} is both the target and a source")
    store = Store(target)
    for source, copied in merge(store, sources).items():
        counts = ", ".join(f"{n} {table.replace('_', ' ')}" for table, n in copied.items() if n)
        out.print(f"{escape(source)}: {escape(counts) if counts else 'nothing new'}")
    out.print(f"{store.cell_count()} cells in {escape(str(target))}")
