"""Versions of the code against each other on one GPU: one results database per version, each
cell timed in fresh processes, as many runs as the caller made. Per cell and database, the
median step over its runs with range and N (floorline.report.quotes: the runs of the newest
provenance class, steady ones only) and its fraction of the floor; beside each database after
the first, its median over the first's.

    PYTHONPATH=src python bench/tree_compare.py main.db branch.db [other.db ...]
"""

import sys
from pathlib import Path

from floorline.report.quotes import of_floor, quote
from gpu_check_cells import rows_of  # beside this script


def compare(dbs: list[Path]) -> list[str]:
    rows = {db: rows_of(db) for db in dbs}
    cells = sorted({(r.model, r.ctx, r.path) for runs in rows.values() for r in runs})
    lines = ["| model | ctx | path | " + " | ".join(db.stem for db in dbs) + " |",
             "|---|---|---|" + "---|" * len(dbs)]
    for cell in cells:
        quotes = {db: quote(rows[db], *cell) for db in dbs}
        base = quotes[dbs[0]]
        texts = []
        for db, q in quotes.items():
            if q is None:
                texts.append("-")
                continue
            floor = quote(rows[db], *cell, figure=of_floor, klass=q.klass)
            text = q.text(".3f", " ms") + ("" if floor is None else f", {floor.value:.1%}")
            if db != dbs[0] and base is not None:
                text += f", x{q.value / base.value:.3f}"
            texts.append(text)
        lines.append(f"| {cell[0]} | {cell[1]} | {cell[2]} | " + " | ".join(texts) + " |")
    return lines


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("tree_compare: name two results databases or more, the baseline first")
    missing = [db for db in sys.argv[1:] if not Path(db).is_file()]
    if missing:
        sys.exit(f"tree_compare: no database at {', '.join(missing)}")
    print("\n".join(compare([Path(db) for db in sys.argv[1:]])))
