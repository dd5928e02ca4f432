"""bench/tree_compare.py: versions of the code side by side, each cell's median over its runs
in each database and its ratio to the first's."""

import importlib.util
from pathlib import Path

from floorline.records import UNSTEADY, VALID, CellKey, CellResult
from floorline.store import Store

ROOT = Path(__file__).parents[1]


def tree_compare(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # the scripts it imports, as when run there
    spec = importlib.util.spec_from_file_location("tree_compare",
                                                  ROOT / "bench" / "tree_compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def add(store, model, ms, status=VALID):
    key = CellKey(model, 128, "engine", 64, "auto")
    store.add(CellResult(key, "h100-sxm5", status, None, [ms] * 4,
                         {"median_ms": ms, "p10_ms": ms, "p90_ms": ms, "mean_ms": ms, "n": 4},
                         {"floor_ms": 0.5, "total_bytes": 10**6, "weight_bytes": 9 * 10**5,
                          "kv_bytes": 10**5, "peak_gbps": 1.0, "weight_format": "bf16",
                          "kv_dtype": "bf16"}, {}),
              {"device": "h100-sxm5", "code": {}}, "env")


def test_each_cell_median_over_runs_and_ratio_to_the_first_database(tmp_path, monkeypatch):
    main, branch = Store(tmp_path / "main.db"), Store(tmp_path / "branch.db")
    for ms in (1.00, 1.04, 1.02):
        add(main, "a", ms)
    for ms in (0.90, 0.92):
        add(branch, "a", ms)
    add(branch, "a", 0.50, status=UNSTEADY)  # not a run the median counts
    add(branch, "b", 2.0)  # a cell the baseline lacks: no ratio
    lines = tree_compare(monkeypatch).compare([tmp_path / "main.db", tmp_path / "branch.db"])
    assert lines[0] == "| model | ctx | path | main | branch |"
    a = next(line for line in lines if line.startswith("| a |"))
    # medians 1.02 and 0.91; of the floor, the median of 0.5 ms over each run; 0.91 / 1.02
    branch_floor = (0.5 / 0.90 + 0.5 / 0.92) / 2
    assert a == ("| a | 128 | engine | 1.020 ms (median of 3 runs, 1.000-1.040), "
                 f"{0.5 / 1.02:.1%} | 0.910 ms (median of 2 runs, 0.900-0.920), "
                 f"{branch_floor:.1%}, x{0.91 / 1.02:.3f} |")
    b = next(line for line in lines if line.startswith("| b |"))
    assert b == "| b | 128 | engine | - | 2.000 ms (one run), 25.0% |"
