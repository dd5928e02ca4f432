"""The table of the quantised paths on the H200 in docs/results-h200.md, printed from the
committed results (bench/results/h200-quantised/h200_quantised_cells.json, written by
`floorline show --json`).

    python3 bench/quantised_table.py
"""

import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "h200-quantised" / "h200_quantised_cells.json"


def main() -> None:
    cells = json.loads(RESULTS.read_text())
    print("| path | ctx | floor ms | ms/step (p10-p90) | of floor | expected reduction | "
          "realised (vs) | share realised |")
    print("|---|---|---|---|---|---|---|---|")
    for c in sorted(cells, key=lambda c: (c["path"].endswith("+graphs"), c["path"], c["ctx"])):
        r = c.get("reduction") or {}
        if c["status"] != "valid":
            print(f"| {c['path']} | {c['ctx']} | {c['floor_ms']:.2f} | invalid: {c['reason']} "
                  f"| | | | |")
            continue
        realised = f"{r['realised']:.2f}x ({r['reference_path']})" if r.get("realised") else "-"
        share = f"{r['share']:.0%}" if r.get("share") is not None else "-"
        expected = f"{r['expected']:.2f}x" if r else "-"
        print(f"| {c['path']} | {c['ctx']} | {c['floor_ms']:.2f} | {c['median_ms']:.2f} "
              f"({c['p10_ms']:.2f}-{c['p90_ms']:.2f}) | {c['fraction_of_floor']:.1%} | {expected} "
              f"| {realised} | {share} |")


if __name__ == "__main__":
    main()
