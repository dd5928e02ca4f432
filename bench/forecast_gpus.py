"""The forecast left one GPU out: calibrated on one GPU's committed results alone
(bench/forecast_calibration.py: its cells, explain decompositions and probes), each cell of the
other GPU forecast as for a GPU not in hand, the error per family of paths (small models under
2 B parameters; the engine per weight format; the stock paths by kind), and every cell; then
again with the other GPU's probes (`floorline probe`, a minute on the GPU, no cells) beside the
calibration, as for a GPU whose probe a user has taken; and the terms each GPU's results give
alone, which a forecast from one carries to the other.

The H100's fp8 cells use the tensor cores' kernel where its tuning table chose it, which the
H200's table does not: the H100's cells timed with the CUDA cores' table (runs labelled cores-N,
bench/results/h100-fp8-dots/) are forecast as well, as the same kernels as the H200's.

The H100's SmolLM2-135M cells need that model's config: `floorline models fetch smollm2-135m`.

    PYTHONPATH=src python bench/forecast_gpus.py > bench/results/forecast/forecast_gpus.md
"""

import sys

from floorline.errors import FloorlineError
from floorline.forecast.accuracy import by_family, leave_one_gpu_out
from floorline.forecast.calibration import Calibration, from_rows
from floorline.forecast.model import ATTENTION, ATTENTION_TIME, FIXED, SM, STREAM, fit
from floorline.forecast.terms import formats
from floorline.hardware import lookup
from floorline.models import resolve_model
from floorline.store import Store
from forecast_calibration import LEFT_OUT, RESULTS, h100, h200

FP8_DOTS = RESULTS / "h100-fp8-dots"


def cores_cells() -> list[dict]:
    """The H100's engine cells of the fp8 runs timed with the CUDA cores' table, the newest
    of each."""
    newest: dict[tuple, dict] = {}
    for name in ("h100_engine_fp8dots.db", "h100_engine_fp8dots_more.db"):
        store = Store(FP8_DOTS / name, read_only=True)
        cores = {r["id"] for r in store.runs() if (r.get("label") or "").startswith("cores-")}
        rows = [r for r in store.rows(latest=False) if r.run_id in cores]
        for c in from_rows(rows, [], {}, f"H100 h100-fp8-dots/{name}").cells:
            key = (c["model"], c["ctx"], c["path"])
            if key not in newest or c["finished_at"] >= newest[key]["finished_at"]:
                newest[key] = c
    return list(newest.values())


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def summary(rows: list[dict], held_in: str, held_out: str, probes: str | None = None) -> list[str]:
    lines = [f"Calibrated on the {held_in} alone"
             + (f" and {probes} (no cell of it)" if probes else "")
             + f", forecast on the {held_out}:", "",
             "| family | cells forecast | mean absolute error | largest | 90% interval held | "
             "not forecast |", "|---|---|---|---|---|---|"]
    for name, f in by_family(rows).items():
        mae = "-" if f["mae"] is None else f"{f['mae']:.1%}"
        held = f"{f['held']} of {f['with_interval']}" if f["with_interval"] else "-"
        lines.append(f"| {name} | {f['cells']} | {mae} | {pct(f['worst'])} | {held} | "
                     f"{f['not_forecast'] or ''} |")
    missing = [r for r in rows if r["missing"]]
    unmeasured = sorted({r["path"] for r in missing if "no GPU cell of" in r["missing"]})
    reasons = {
        f"the {held_in}'s results hold no probe, whose streaming read the model needs":
            sum("streaming read is missing" in r["missing"] for r in missing),
        f"path not measured on the {held_in} ({', '.join(unmeasured)})":
            sum("no GPU cell of" in r["missing"] for r in missing),
        f"host-bound, and no host was measured with the {held_out}":
            sum("no host was measured" in r["missing"] for r in missing),
        f"an fp8 KV cache's attention: the {held_in}'s cells of it are of one context, which "
        "does not separate its bandwidth":
            sum("fp8 KV paths is missing" in r["missing"] for r in missing)}
    if missing:
        lines += ["", "Not forecast:"] + [f"- {n} cells: {why}" for why, n in reasons.items()
                                          if n]
        assert sum(reasons.values()) == len(missing), "a reason not accounted for"
    return lines + [""]


def cells(rows: list[dict]) -> list[str]:
    lines = ["| family | path | model | ctx | measured ms | forecast ms | error | interval held |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted((r for r in rows if r["error"] is not None),
                    key=lambda r: (r["family"], r["path"], r["model"], r["ctx"])):
        held = "-" if r["held"] is None else ("yes" if r["held"] else "no")
        lines.append(f"| {r['family']} | {r['path']} | {r['model']} | {r['ctx']} | "
                     f"{r['measured_ms']:.3f} | {r['forecast_ms']:.3f} | {pct(r['error'])} | "
                     f"{held} |")
    return lines + [""]


def main() -> None:
    try:
        resolve_model("smollm2-135m")
    except FloorlineError as e:
        sys.exit(f"forecast_gpus: {e} (the H100's SmolLM2 cells need its config)")
    h2, h1 = h200(), h100()
    both = Calibration(h2.cells + h1.cells, h2.explanations + h1.explanations,
                       h2.probes + h1.probes)
    out = ["# The forecast left one GPU out", "",
           f"H200: {len(h2.cells)} cells, {len(h2.explanations)} explain, {len(h2.probes)} "
           f"probes; H100: {len(h1.cells)} cells, {len(h1.explanations)} explain, "
           f"{len(h1.probes)} probes (bench/forecast_calibration.py)"
           + (f"; left out, their models local directories of the GPU's machine: "
              f"{len(LEFT_OUT)} H100 cells ({', '.join(sorted({c['model'] for c in LEFT_OUT}))})"
              if LEFT_OUT else "") + ".", ""]
    runs = {}
    directions = (("H200", "H100", "h100-sxm5"), ("H100", "H200", "h200"))
    for held_in, held_out, gpu in directions:
        runs[gpu] = leave_one_gpu_out(both, gpu)
        out += summary(runs[gpu], held_in, held_out)
    for held_in, held_out, gpu in directions:
        out += summary(leave_one_gpu_out(both, gpu, probed=True), held_in, held_out,
                       f"the {held_out}'s probes")
    cores = Calibration(h2.cells + [c for c in h1.cells if c["path"] not in
                                    {d["path"] for d in cores_cells()}] + cores_cells(),
                        both.explanations, both.probes)
    fp8 = [r for r in leave_one_gpu_out(cores, "h100-sxm5")
           if "fp8" in formats(r["path"])[0] and r["model"] != "smollm2-135m"]
    out += ["The H100's fp8 cells timed with the CUDA cores' table (the H200's kernels), "
            "calibrated on the H200 alone:", ""] + cells(fp8)
    out += terms_table({"H200": (h2, "h200"), "H100": (h1, "h100-sxm5")})
    out += ["## Every cell forecast, H200 to H100", ""] + cells(runs["h100-sxm5"])
    print("\n".join(out))


def terms_table(cals: dict[str, tuple[Calibration, str]]) -> list[str]:
    """The terms each GPU's results (name: its calibration and catalogue name) give alone, for
    Qwen2.5-7B on that GPU: what a forecast from one carries to the other."""
    lines = ["## Each GPU's terms, from its own results", "",
             "| term | " + " | ".join(cals) + " |", "|---|" + "---|" * len(cals)]
    fits = {name: {path: fit(cal, path, gpu, "qwen2.5-7b")
                   for path in ("engine-int4", "engine-fp8", "hf-static+graphs")}
            for name, (cal, gpu) in cals.items()}
    rows = [("memory's streaming read", "engine-int4", STREAM),
            ("engine: attention's fraction of peak", "engine-int4", ATTENTION),
            ("engine: fixed cost per layer (Qwen2)", "engine-int4", FIXED),
            ("engine-int4: SM time per weight GB", "engine-int4", SM),
            ("engine-fp8: SM time per weight GB", "engine-fp8", SM)]
    for label, path, term in rows:
        lines.append(f"| {label} | " + " | ".join(
            f"{f[path].terms[term].value:.4g} {f[path].terms[term].unit}".rstrip()
            for f in fits.values()) + " |")
    # transformers' attention: the fraction of peak its time per GB comes to on each GPU
    ms_per_gb = {name: f["hf-static+graphs"].terms[ATTENTION_TIME].value
                 for name, f in fits.items()}
    lines.append("| transformers: attention's fraction of peak | " + " | ".join(
        f"{1e9 / (ms_per_gb[name] * lookup(gpu).peak_gbps * 1e6):.1%}"
        for name, (_, gpu) in cals.items()) + " |")
    return lines + [""]


if __name__ == "__main__":
    main()
