"""What a forecast is fitted from: cells, explain decompositions and probes, as plain records.

The shipped calibration (h200.json, written by bench/forecast_calibration.py from the committed
H200 measurements) lets `predict` run on a fresh install; a user's database adds to it or
replaces it. Records carry a `source` naming where each came from, printed with the forecast.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from floorline.hardware import catalogue_names, match_device_name
from floorline.records import VALID
from floorline.store import CellRow, Store, check_cell, host_layers

SHIPPED = "h200.json"
DEFAULT_DB = Path("floorline.db")  # read where it exists and no database is named


@dataclass
class Calibration:
    # model ctx path gpu ms weight_format kv_dtype source
    cells: list[dict] = field(default_factory=list)
    # path model ctx gpu kernels_per_step classes source
    explanations: list[dict] = field(default_factory=list)
    # gpu eager_us graph_us stream_read_gbps host_layers source
    probes: list[dict] = field(default_factory=list)
    # paths with valid cells on a non-catalogue device
    cpu_paths: set[str] = field(default_factory=set)

    def without(self, cell: dict) -> Calibration:
        return Calibration([c for c in self.cells if c is not cell], self.explanations,
                           self.probes, self.cpu_paths)


def cell_record(row: CellRow, source: str) -> dict:
    return {"model": row.model, "ctx": row.ctx, "path": row.path, "gpu": row.gpu,
            "ms": row.median_ms, "weight_format": row.weight_format,
            "kv_dtype": row.kv_dtype, "finished_at": row.finished_at, "source": source}


def explain_record(results: dict, source: str) -> dict:
    return {"path": results["path"], "model": results["model"], "ctx": results["ctx"],
            "gpu": results["gpu"], "kernels_per_step": results["kernels_per_step"],
            "classes": {k: {"kernels_per_step": v["kernels_per_step"], "ms": v["ms"]}
                        for k, v in results["classes"].items()},
            "source": source}


def probe_record(results: dict, gpu: str, source: str) -> dict:
    return {"gpu": gpu, **{k: results[k] for k in ("eager_us", "graph_us", "stream_read_gbps")},
            "host_layers": results.get("host_layers") or host_layers([results]), "source": source}


def from_rows(rows: list[CellRow], explanations: list[dict], probes: dict[str, dict],
              label: str, probe_devices: dict[str, str] | None = None) -> Calibration:
    """A database's contents as records: valid cells of catalogued GPUs (the newest of each
    model, ctx, path and GPU); CPU cells only noted, as they say nothing about a GPU; explain
    results of catalogued GPUs that count kernels by class (the terms read those counts); probes
    of a catalogued GPU, known by the cells of their environment or by the device they recorded
    (`probe_devices`). A GPU cell with figures no measured cell has (a zero median) is refused
    in one line."""
    gpus = set(catalogue_names())
    newest: dict[tuple, CellRow] = {}
    cpu_paths = set()
    for r in rows:
        if r.status != VALID:  # an unsteady cell is no evidence of a term
            continue
        if r.gpu not in gpus:
            cpu_paths.add(r.path)
            continue
        check_cell(r.as_dict(), f"{label} cell {r.id}")
        key = (r.model, r.ctx, r.path, r.gpu)
        if key not in newest or r.finished_at >= newest[key].finished_at:
            newest[key] = r
    cells = [cell_record(r, f"{label} cell {r.id}") for r in newest.values()]
    env_gpu = {key: spec.name for key, name in (probe_devices or {}).items()
               if (spec := match_device_name(name)) is not None}
    env_gpu.update({r.fingerprint_key: r.gpu for r in rows if r.gpu in gpus})
    probe_list = [probe_record(p, env_gpu[k], f"{label} probe")
                  for k, p in probes.items() if k in env_gpu]
    expl = [explain_record(e, f"{label} explain {e['id']}") for e in explanations
            if e["gpu"] in gpus and "classes" in e and "kernels_per_step" in e]
    return Calibration(cells, expl, probe_list, cpu_paths)


def shipped() -> Calibration:
    data = json.loads(resources.files("floorline.forecast").joinpath(SHIPPED).read_text())
    return Calibration(data["cells"], data["explanations"], data["probes"], set())


def combine(base: Calibration, user: Calibration) -> Calibration:
    """The user's records added to the shipped ones; a cell the user measured (same model,
    ctx, path and GPU) replaces the shipped one."""
    mine = {(c["model"], c["ctx"], c["path"], c["gpu"]) for c in user.cells}
    kept = [c for c in base.cells if (c["model"], c["ctx"], c["path"], c["gpu"]) not in mine]
    return Calibration(kept + user.cells, base.explanations + user.explanations,
                       base.probes + user.probes, user.cpu_paths)


def fitted_from(db: Path | None, replace: bool = False) -> Calibration:
    """What a forecast fits from: the shipped calibration with the records of the results
    database `db` (or of DEFAULT_DB where it exists) combined into it; with `replace`, the
    database's records alone."""
    cal = shipped() if not replace else Calibration()
    if db is not None or DEFAULT_DB.is_file():
        store = Store(db or DEFAULT_DB, read_only=True)
        mine = from_rows(store.rows(), store.explanations(), store.probes(), f"{store.path}",
                         store.probe_devices())
        cal = mine if replace else combine(cal, mine)
    return cal
