"""The forecast for the catalogue's GPUs, as the Markdown table in docs/forecast.md: the engine,
its int4 and the best stock path (the fastest forecast of the paths measured outside the engine)
for Qwen2.5-7B and Llama-3.1-8B at ctx 2048 and 16384, the study's published cells beside them.

    PYTHONPATH=src python bench/forecast_table.py > bench/results/forecast/forecast_table.md
"""

from floorline.errors import FloorlineError
from floorline.forecast.accuracy import forecast, leave_one_out
from floorline.forecast.calibration import shipped
from floorline.forecast.published import published_cells
from floorline.forecast.terms import family
from floorline.study import study

GPUS = ("l4", "l40s", "a100-80gb-sxm4", "h100-sxm5", "jetson-agx-orin", "b200")
MODELS, CONTEXTS = ("qwen2.5-7b", "llama-3.1-8b"), (2048, 16384)


def cell(cal, loo, model, gpu, ctx, path) -> tuple[str, float | None]:
    try:
        f = forecast(cal, model, gpu, ctx, path, loo)
    except FloorlineError as e:
        return f"no forecast ({e})", None
    return f"{f.ms:.2f} ({f.low:.2f}-{f.high:.2f})", f.ms


def main() -> None:
    cal = shipped()
    loo = leave_one_out(cal)
    stock = sorted({c["path"] for c in cal.cells if not family(c["path"]).startswith("engine")})
    published: dict[tuple, list[str]] = {}
    for r in published_cells(study()):
        published.setdefault((r["gpu"], r["model"], r["ctx"]), []).append(
            f"{r['published_ms']:.2f} ({r['path']})")
    print("| GPU | model | ctx | engine ms | engine-int4 ms | best stock path | its ms "
          "| study's published ms (path) |")
    print("|---|---|---|---|---|---|---|---|")
    for gpu in GPUS:
        for model in MODELS:
            for ctx in CONTEXTS:
                engine = cell(cal, loo, model, gpu, ctx, "engine")[0]
                int4 = cell(cal, loo, model, gpu, ctx, "engine-int4")[0]
                options = [(cell(cal, loo, model, gpu, ctx, p), p) for p in stock]
                (best, _), best_path = min(((t, p) for t, p in options if t[1] is not None),
                                           key=lambda x: x[0][1])
                ref_text = "; ".join(published.get((gpu, model, ctx), []))
                print(f"| {gpu} | {model} | {ctx} | {engine} | {int4} | {best_path} | {best} "
                      f"| {ref_text} |")


if __name__ == "__main__":
    main()
