"""Writes the forecast's shipped calibration (src/floorline/forecast/h200.json) from the
committed H200 results: every valid cell of the merged database and the engine's re-measured
quantised cells (the newest of each model, ctx and path; a path re-measured after its kernels
or their launch configurations changed keeps only its re-measured cells, as older ones time
other kernels), the explain
decompositions in the database and in the explain JSON files (h200_explain_*.json in any folder
of bench/results/), and the probe.

    PYTHONPATH=src python bench/forecast_calibration.py
"""

import json
from pathlib import Path

from floorline.forecast.calibration import SHIPPED, combine, explain_record, from_rows, probe_record
from floorline.store import Store

RESULTS = Path(__file__).parent / "results"
OUT = Path(__file__).parents[1] / "src" / "floorline" / "forecast" / SHIPPED


def main() -> None:
    merged = Store(RESULTS / "merged" / "h200_all.db", read_only=True)
    cal = from_rows(merged.rows(), merged.explanations(), merged.probes(), "H200 results")
    quant = Store(RESULTS / "h200-engine-retimed" / "h200_engine_quant_retimed.db", read_only=True)
    requant = from_rows(quant.rows(), [], {}, "H200 engine quantised results")
    # the engine's quantised paths, whose kernels changed; the rest of that run (engine bf16)
    # joins the merged cells like any other newer measurement
    again = {c["path"] for c in requant.cells if c["path"].startswith("engine-")}
    cal.cells = [c for c in cal.cells if c["path"] not in again]
    cal = combine(cal, requant)
    in_db = {(e["path"], e["model"], e["ctx"]) for e in cal.explanations}
    for f in sorted(RESULTS.glob("*/h200_explain_*.json"), key=lambda f: f.name):
        e = json.loads(f.read_text())
        if (e["path"], e["model"], e["ctx"]) not in in_db:
            name = f.stem.removeprefix("h200_explain_")
            cal.explanations.append(explain_record(e, f"H200 explain {name}"))
    probe = json.loads((RESULTS / "h200-explain" / "h200_probe.json").read_text())
    cal.probes.append(probe_record(probe, "h200", "H200 probe"))
    cells = sorted(cal.cells, key=lambda c: (c["path"], c["model"], c["ctx"]))
    for c in cells:
        c.pop("finished_at")
    OUT.write_text(json.dumps({"cells": cells, "explanations": cal.explanations,
                               "probes": cal.probes}, indent=1) + "\n")
    print(f"wrote {OUT}: {len(cells)} cells, {len(cal.explanations)} explain, "
          f"{len(cal.probes)} probes")


if __name__ == "__main__":
    main()
