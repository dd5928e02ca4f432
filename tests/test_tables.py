"""Tables that stay tables: a row's reason is a note under the table, keyed to the row by its
number, and a narrow terminal leaves columns out rather than wrapping a row; the report alike."""

import io

from rich.console import Console

from floorline.cli.render import cells_table, print_table
from floorline.records import INVALID, UNSTEADY, VALID, CellKey, CellResult
from floorline.report.build import build_report
from floorline.store import Store

REASON = ("the automatic warm-up stopped at its cap (512 steps or 5 s) after 96 steps; its "
          "p10-p90 39.1-154 ms spans 168% of its median 68 ms (bound 50%). Measure it again on "
          "an idle host")


def store_of(tmp_path) -> Store:
    store = Store(tmp_path / "t.db")
    for path, status, reason in (("engine", VALID, None), ("hf-eager", UNSTEADY, REASON),
                                 ("hf-static", INVALID, "path unavailable: no such library")):
        median = None if status == INVALID else 40.0
        summary = None if median is None else {"n": 64, "median_ms": median, "p10_ms": 39.0,
                                               "p90_ms": 45.0, "mean_ms": median}
        store.add(CellResult(CellKey("smollm2-135m", 128, path, 64, "auto"), "cpu", status,
                             reason, [] if median is None else [median] * 64, summary,
                             {"floor_ms": 10.0, "total_bytes": 10**8, "peak_gbps": 30.0,
                              "weight_format": "bf16", "kv_dtype": "bf16"},
                             {"drift": 1.0, "warmup_steps": 30, "prefill_ms": 100.0,
                              "prefill_tokens_per_s": 1000.0}),
                  {"device": "test"}, "env")
    return store


def printed(store: Store, width: int) -> list[str]:
    console = Console(width=width, file=io.StringIO(), color_system=None)
    print_table(console, cells_table(store.rows(), "t", {}))
    return console.file.getvalue().splitlines()


def test_reasons_are_notes_below_the_table_keyed_to_their_rows(tmp_path):
    lines = printed(store_of(tmp_path), 200)
    rows = [line for line in lines if line.startswith("│")]
    assert len(rows) == 3 and "reason" not in lines[1] + lines[2]
    assert any("unsteady (1)" in r for r in rows) and any("invalid (2)" in r for r in rows)
    below = "\n".join(lines[lines.index(next(x for x in lines if x.startswith("└"))):])
    assert "(1) smollm2-135m ctx 128 hf-eager: the automatic warm-up" in below
    assert "(2) smollm2-135m ctx 128 hf-static: path unavailable" in below


def test_a_narrow_terminal_keeps_one_line_per_cell(tmp_path):
    lines = printed(store_of(tmp_path), 80)
    rows = [line for line in lines if line.startswith("│")]
    assert len(rows) == 3 and all(len(line) <= 80 for line in lines)
    assert all(cell in " ".join(rows) for cell in ("engine", "hf-eager", "unsteady (1)", "40.00"))
    assert any(line.startswith("left out at 80 columns: ") for line in lines)


def test_the_reports_tables_give_reasons_below(tmp_path):
    store_of(tmp_path)
    build_report(tmp_path / "t.db", tmp_path / "report")
    md = (tmp_path / "report" / "report.md").read_text()
    cells = md[md.index("## Cells"):md.index("## Forecast")]
    header = next(line for line in cells.splitlines() if line.startswith("| id"))
    assert "reason" not in header
    assert "- id 2 (unsteady): the automatic warm-up" in cells
    assert "- id 3 (invalid): path unavailable" in cells
