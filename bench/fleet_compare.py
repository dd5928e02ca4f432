"""Per-cell medians of a sweep through `--cluster` against the same grid swept in one process.

    python3 bench/fleet_compare.py IN_PROCESS.db FLEET.db [--json OUT] [--tolerance 0.01]

Pairs the newest valid row of each cell (model, ctx, path, steps, warm-up) in the two databases
and prints fleet/in-process per cell. The check: every graph-replayed cell (+graphs, the engine,
llama.cpp) within the tolerance; eager paths are printed but not held to it (their step is the
host's Python, noisier from run to run). Exit code 1 where the check fails or nothing pairs.
"""

import argparse
import json
import sys

from floorline.forecast.terms import GPU_GOVERNED, kind
from floorline.store import Store


def newest_valid(db: str) -> dict:
    rows = Store(db, read_only=True).rows()
    return {(r.model, r.ctx, r.path, r.steps, r.warmup): r
            for r in rows if r.status == "valid"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("in_process")
    parser.add_argument("fleet")
    parser.add_argument("--json", help="also write the pairs and the verdict here")
    parser.add_argument("--tolerance", type=float, default=0.01)
    args = parser.parse_args()
    local, fleet = newest_valid(args.in_process), newest_valid(args.fleet)
    pairs = []
    for cell in sorted(set(local) & set(fleet), key=str):
        a, b = local[cell], fleet[cell]
        pairs.append({"model": cell[0], "ctx": cell[1], "path": cell[2],
                      "graph_replayed": kind(cell[2]) == GPU_GOVERNED,
                      "in_process_ms": a.median_ms, "fleet_ms": b.median_ms,
                      "ratio": b.median_ms / a.median_ms,
                      "same_environment": a.fingerprint_key == b.fingerprint_key,
                      "fleet_worker": b.details.get("worker", {}).get("name")})
    print(f"{'model':<16} {'ctx':>6} {'path':<26} {'in-process':>11} {'fleet':>9} {'ratio':>7}")
    for p in pairs:
        eager = "" if p["graph_replayed"] else "  (eager)"
        print(f"{p['model']:<16} {p['ctx']:>6} {p['path']:<26} {p['in_process_ms']:>11.3f} "
              f"{p['fleet_ms']:>9.3f} {p['ratio']:>7.4f}{eager}")
    unpaired = sorted(str(c) for c in set(local) ^ set(fleet))
    graphed = [p for p in pairs if p["graph_replayed"]]
    worst = max((abs(p["ratio"] - 1) for p in graphed), default=None)
    ok = bool(graphed) and worst <= args.tolerance
    verdict = (f"{len(graphed)} graph-replayed cells, largest difference {worst:.2%} "
               f"({'within' if ok else 'NOT within'} {args.tolerance:.0%})" if graphed
               else "no graph-replayed cell in both databases")
    print(f"{len(pairs)} cells paired, {len(unpaired)} valid in one database only; {verdict}; "
          f"same environment in every pair: {all(p['same_environment'] for p in pairs)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"pairs": pairs, "unpaired": unpaired, "tolerance": args.tolerance,
                       "largest_graph_replayed_difference": worst, "ok": ok}, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
