"""The H200 table of docs/results-h200.md, printed from the committed results files.

    python3 bench/readme_table.py
"""

import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "h200-study"


def load(name: str) -> dict:
    cells = json.loads((RESULTS / name).read_text())
    return {(c["model"], c["ctx"], c["path"]): c for c in cells if c["status"] == "valid"}


def main() -> None:
    first, repeat = load("h200_cells.json"), load("h200_eager_repeat_cells.json")
    print("| model | ctx | path | floor ms | ms/step (p10-p90) | of floor | GB/s "
          "| repeat run ms/step |")
    print("|---|---|---|---|---|---|---|---|")
    for key, c in first.items():
        again = f"{repeat[key]['median_ms']:.2f}" if key in repeat else "-"
        print(f"| {key[0]} | {key[1]} | {key[2]} | {c['floor_ms']:.2f} | {c['median_ms']:.2f} "
              f"({c['p10_ms']:.2f}-{c['p90_ms']:.2f}) | {c['fraction_of_floor']:.1%} | "
              f"{c['achieved_gbps']:.0f} | {again} |")

if __name__ == "__main__":
    main()
