"""The study's published cells beside the forecast of the same path, GPU and model."""

from __future__ import annotations

from floorline.errors import FloorlineError
from floorline.forecast.accuracy import forecast
from floorline.forecast.calibration import Calibration
from floorline.forecast.model import HostNotMeasured
from floorline.hardware import lookup
from floorline.models import resolve_model
from floorline.traffic import floor

# The study's quantised runs by floorline's path names; they are eager, as its bf16 baseline.
STUDY_PATHS = {"bf16": "hf-eager", "bnb-nf4": "bnb-nf4", "AutoAWQ+Marlin": "awq-marlin",
               "GPTQ+ExLlamaV2": "gptq-exllamav2"}


def published_cells(study: dict) -> list[dict]:
    """ms/step as published: printed where printed, else from the published fraction of the
    floor under the study's every-parameter byte count. The quantised table names its model
    "7B", read as the Qwen2.5-7B of its fraction-of-floor cells at their context."""
    rows, printed = [], {(q["gpu"], STUDY_PATHS[q["path"]]): q["ms"] for q in study["quantised_ms"]}
    for ref in study["fraction_of_floor"]:
        f = floor(resolve_model(ref["model"]), lookup(ref["gpu"]), ref["ctx"])
        ms = printed.pop((ref["gpu"], ref["path"]), None) or f.floor_ms_all_params / ref["value"]
        rows.append({"gpu": ref["gpu"], "model": ref["model"], "ctx": ref["ctx"],
                     "path": ref["path"], "published_ms": ms})
    base = study["fraction_of_floor"][0]
    rows += [{"gpu": gpu, "model": base["model"], "ctx": base["ctx"], "path": path,
              "published_ms": ms} for (gpu, path), ms in printed.items()]
    return rows


def study_check(cal: Calibration, study: dict, loo: list[dict]) -> list[dict]:
    out = []
    for ref in published_cells(study):
        try:
            f = forecast(cal, ref["model"], ref["gpu"], ref["ctx"], ref["path"], loo)
        except FloorlineError as e:
            out.append({**ref, "forecast_ms": None, "low": None, "high": None, "error": None,
                        "missing": str(e), "host_missing": isinstance(e, HostNotMeasured)})
            continue
        out.append({**ref, "forecast_ms": f.ms, "low": f.low, "high": f.high,
                    "error": (f.ms - ref["published_ms"]) / ref["published_ms"], "missing": None,
                    "host_missing": False})
    return out
