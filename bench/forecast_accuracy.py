"""The forecast's leave-one-out accuracy over the shipped H200 calibration (or over a results
database alone, given its path), per kind of path, and the study's published cells beside
their forecasts.

    PYTHONPATH=src python bench/forecast_accuracy.py > bench/results/forecast/forecast_accuracy.txt
    PYTHONPATH=src python bench/forecast_accuracy.py bench/results/merged/h200_all.db \
        > bench/results/forecast/forecast_accuracy_h200_all.txt
"""

import sys

from floorline.forecast.accuracy import coverage, leave_one_out
from floorline.forecast.calibration import from_rows, shipped
from floorline.forecast.published import study_check
from floorline.store import Store
from floorline.study import study


def main() -> None:
    if len(sys.argv) > 1:
        store = Store(sys.argv[1], read_only=True)
        cal = from_rows(store.rows(), store.explanations(), store.probes(), "cell")
    else:
        cal = shipped()
    loo = leave_one_out(cal)
    print(f"{'path':28s} {'model':16s} {'ctx':>6s} {'measured':>9s} {'forecast':>9s} {'error':>7s}")
    for r in sorted(loo, key=lambda r: (r["kind"], r["path"], r["model"], r["ctx"])):
        print(f"{r['path']:28s} {r['model']:16s} {r['ctx']:6d} {r['measured_ms']:9.3f} "
              f"{r['forecast_ms']:9.3f} {r['error']:+7.1%}")
    held = {(r["path"], r["model"], r["ctx"]) for r in loo}
    left = [c for c in cal.cells if (c["path"], c["model"], c["ctx"]) not in held]
    unforecast = ", ".join(f"{c['path']} {c['model']} ctx {c['ctx']}" for c in left) or "none"
    print(f"\n{len(loo)} of {len(cal.cells)} cells forecast held out; not forecastable without "
          f"themselves: {unforecast}")
    for k, v in coverage(loo).items():
        print(f"{k}: mean absolute error {v['mae']:.1%} over {v['cells']} cells; the 90% interval "
              f"from the other cells' errors held {v['covered']} of {v['with_interval']} "
              f"({v['covered'] / v['with_interval']:.1%})")
    print("\nThe study's published cells (its figures) against the forecast:")
    for r in study_check(cal, study(), loo):
        got = (f"{r['forecast_ms']:.2f} ms (90% interval {r['low']:.2f}-{r['high']:.2f}), "
               f"{r['error']:+.1%}" if r["forecast_ms"] is not None else r["missing"])
        print(f"  {r['path']} on {r['gpu']}, {r['model']} ctx {r['ctx']}: published "
              f"{r['published_ms']:.2f} ms, forecast {got}")


if __name__ == "__main__":
    main()
