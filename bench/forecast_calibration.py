"""The forecast's calibration from the committed results of one GPU, and the shipped one
(src/floorline/forecast/h200.json) written from the H200's.

The H200's: every valid cell of the merged database and the engine's re-measured quantised
cells (the newest of each model, ctx and path; a path re-measured after its kernels or their
launch configurations changed keeps only its re-measured cells, as older ones time other
kernels), the explain decompositions in the database and in the explain JSON files
(h200_explain_*.json in any folder of bench/results/), and the probe.

The H100's: the newest valid row of each cell over every database in the H100's folders
(bench/results/h100-*/), the one-token step's only (a verify step of K tokens is no cell the
model describes) and of models this machine can resolve (a local directory on the GPU's machine,
such as a GGUF file's, is not here: LEFT_OUT counts those), with its explain and probe JSON files
(h100_explain_*.json, h100_probe.json) where they exist.

    PYTHONPATH=src python bench/forecast_calibration.py     # writes the shipped calibration
"""

import json
from pathlib import Path

from floorline.errors import FloorlineError
from floorline.forecast.calibration import (
    SHIPPED,
    Calibration,
    combine,
    explain_record,
    from_rows,
    probe_record,
)
from floorline.models import resolve_model
from floorline.paths import verify_tokens
from floorline.store import Store

RESULTS = Path(__file__).parent / "results"
OUT = Path(__file__).parents[1] / "src" / "floorline" / "forecast" / SHIPPED
GPUS = {"h200": "H200", "h100-sxm5": "H100"}  # catalogue name: the results' prefix, upper case


def _files(cal: Calibration, gpu: str) -> None:
    """The GPU's explain and probe JSON files of any folder under bench/results/, added to
    `cal` where its databases do not already hold them (a probe's file is written beside its
    stored row, which counts once)."""
    prefix = GPUS[gpu].lower()
    in_db = {(e["path"], e["model"], e["ctx"]) for e in cal.explanations}
    for f in sorted(RESULTS.glob(f"*/{prefix}_explain_*.json"), key=lambda f: f.name):
        e = json.loads(f.read_text())
        if (e["path"], e["model"], e["ctx"]) not in in_db:
            name = f.stem.removeprefix(f"{prefix}_explain_")
            cal.explanations.append(explain_record(e, f"{GPUS[gpu]} explain {name}"))
    for f in sorted(RESULTS.glob(f"*/{prefix}_probe.json")):
        record = probe_record(json.loads(f.read_text()), gpu, f"{GPUS[gpu]} probe")
        if not any(_same_probe(record, p) for p in cal.probes):  # the file of a stored probe
            cal.probes.append(record)


def _same_probe(a: dict, b: dict) -> bool:
    return all(a[k] == b[k] for k in ("gpu", "eager_us", "graph_us", "stream_read_gbps"))


def h200() -> Calibration:
    merged = Store(RESULTS / "merged" / "h200_all.db", read_only=True)
    cal = from_rows(merged.rows(), merged.explanations(), merged.probes(), "H200 results")
    quant = Store(RESULTS / "h200-engine-retimed" / "h200_engine_quant_retimed.db", read_only=True)
    requant = from_rows(quant.rows(), [], {}, "H200 engine quantised results")
    # the engine's quantised paths, whose kernels changed; the rest of that run (engine bf16)
    # joins the merged cells like any other newer measurement
    again = {c["path"] for c in requant.cells if c["path"].startswith("engine-")}
    cal.cells = [c for c in cal.cells if c["path"] not in again]
    cal = combine(cal, requant)
    _files(cal, "h200")
    return cal


LEFT_OUT: list[dict] = []  # the H100's cells of models not on this machine (h100())


def at_hand(model: str) -> bool:
    try:
        resolve_model(model)
    except FloorlineError:
        return False
    return True


def h100(databases: list[Path] | None = None) -> Calibration:
    """`databases` (by default every one of the H100's folders) as one calibration: the newest
    valid row of each one-token cell of a model at hand (the others in LEFT_OUT)."""
    newest: dict[tuple, dict] = {}
    cal = Calibration()
    LEFT_OUT.clear()
    for db in databases or sorted(RESULTS.glob("h100-*/*.db")):
        store = Store(db, read_only=True)
        mine = from_rows(store.rows(), store.explanations(), store.probes(),
                         f"H100 {db.parent.name}/{db.name}", store.probe_devices())
        for c in mine.cells:
            key = (c["model"], c["ctx"], c["path"], c["gpu"])
            if not at_hand(c["model"]):
                LEFT_OUT.append(c)
            elif verify_tokens(c["path"]) == 1 and (key not in newest or c["finished_at"]
                                                    >= newest[key]["finished_at"]):
                newest[key] = c
        cal.explanations += mine.explanations
        cal.probes += mine.probes
    cal.cells = list(newest.values())
    _files(cal, "h100-sxm5")
    return cal


def main() -> None:
    cal = h200()
    cells = sorted(cal.cells, key=lambda c: (c["path"], c["model"], c["ctx"]))
    for c in cells:
        c.pop("finished_at")
    OUT.write_text(json.dumps({"cells": cells, "explanations": cal.explanations,
                               "probes": cal.probes}, indent=1) + "\n")
    print(f"wrote {OUT}: {len(cells)} cells, {len(cal.explanations)} explain, "
          f"{len(cal.probes)} probes")


if __name__ == "__main__":
    main()
