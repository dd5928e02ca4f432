"""The engine's headline cells, one per weight format, against the last committed figure for the
same GPU: one verdict line per cell. A cell that is not valid, or whose step is slower than the
committed one by more than --tolerance, fails; a cell with no committed figure for its GPU is
reported as new.

    python bench/gpu_check_cells.py --db CHECK.db [--results bench/results] [--tolerance 0.03]

The committed figure is the newest valid row of the same model, context, path and GPU in any
database under --results (the check's own database left out); exits 1 where a line fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from floorline.errors import FloorlineError
from floorline.records import VALID
from floorline.store import Store

RESULTS = Path(__file__).parent / "results"


def rows_of(path: Path) -> list:
    store = Store(path, read_only=True)
    try:
        return store.rows(latest=False)
    finally:
        store.close()


def committed(results: Path, leave_out: Path) -> dict[tuple, tuple]:
    """(model, ctx, path, gpu) -> (newest valid row, its database) under `results`."""
    newest: dict[tuple, tuple] = {}
    for db in sorted(results.rglob("*.db")):
        if db.resolve() == leave_out.resolve():
            continue
        for row in rows_of(db):
            key = (row.model, row.ctx, row.path, row.gpu)
            if row.status == VALID and (key not in newest
                                        or row.finished_at > newest[key][0].finished_at):
                newest[key] = (row, db)
    return newest


def verdicts(checked: list, before: dict, tolerance: float, root: Path) -> list[tuple[bool, str]]:
    out = []
    for row in checked:
        cell = f"{row.path} {row.model} ctx {row.ctx} on {row.gpu}"
        if row.status != VALID:
            out.append((False, f"cell: FAIL {cell}: {row.status}, {row.reason}"))
            continue
        now = f"{row.median_ms:.3f} ms ({row.fraction_of_floor:.1%} of the floor)"
        earlier = before.get((row.model, row.ctx, row.path, row.gpu))
        if earlier is None:
            out.append((True, f"cell: NEW {cell}: {now}; no committed figure for this GPU"))
            continue
        then, db = earlier
        ratio = row.median_ms / then.median_ms
        ok = ratio <= 1 + tolerance
        out.append((ok, f"cell: {'PASS' if ok else 'FAIL'} {cell}: {now} against "
                        f"{then.median_ms:.3f} ms committed ({db.relative_to(root)}, "
                        f"{then.finished_at[:10]}): {ratio:.3f}x"
                        f"{'' if ok else f', slower than the {tolerance:.0%} allowed'}"))
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", type=Path, required=True, help="the check's own cells")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--tolerance", type=float, default=0.03)
    args = parser.parse_args()
    try:
        checked = rows_of(args.db)
    except FloorlineError as e:
        print(f"gpu_check_cells: {e}", file=sys.stderr)
        return 2
    if not checked:
        print(f"cell: FAIL {args.db} holds no cells")
        return 1
    lines = verdicts(checked, committed(args.results, args.db), args.tolerance,
                     args.results)
    for _, line in lines:
        print(line)
    return 0 if all(ok for ok, _ in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
