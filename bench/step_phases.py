"""Each cell's timed steps before and after a given step, from its stored samples: whether a
step changed speed partway through a cell (transformers' eager step on some lent H100s ran
about three times as slow until its 64th step, where a cell first rewinds its cache).

    PYTHONPATH=src python bench/step_phases.py RESULTS.db [--at 32] [--last 16]

Per row of the database (every run, not only each cell's newest): its warm-up steps, the
median of its timed steps before timed step --at and from it on, and the median of its last
--last steps, in ms.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from gpu_check_cells import rows_of  # beside this script


def phases(db: Path, at: int, last: int) -> list[str]:
    lines = [f"| model | ctx | path | status | warm-up | steps before {at} | from {at} on | "
             f"last {last} |", "|---|---|---|---|---|---|---|---|"]
    for r in rows_of(db):
        s = r.samples_ms or []
        if len(s) <= at:
            continue
        lines.append(f"| {r.model} | {r.ctx} | {r.path} | {r.status} | "
                     f"{(r.details or {}).get('warmup_steps', '-')} | "
                     f"{statistics.median(s[:at]):.2f} | {statistics.median(s[at:]):.2f} | "
                     f"{statistics.median(s[-last:]):.2f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("db", type=Path)
    parser.add_argument("--at", type=int, default=32)
    parser.add_argument("--last", type=int, default=16)
    args = parser.parse_args()
    if not args.db.is_file():
        sys.exit(f"step_phases: no results database at {args.db}")
    print("\n".join(phases(args.db, args.at, args.last)))


if __name__ == "__main__":
    main()
