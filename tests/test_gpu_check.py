"""The GPU check's cells part (bench/gpu_check_cells.py): each cell against the newest committed
figure of the same model, context, path and GPU, one verdict line each, a regression a failure."""

import importlib.util
import subprocess
import sys
from pathlib import Path

from floorline import store as store_module
from floorline.records import INVALID, VALID, CellKey, CellResult
from floorline.store import Store

SCRIPT = Path(__file__).parents[1] / "bench" / "gpu_check_cells.py"


def add(db: Path, path: str, median: float, when: str, monkeypatch, gpu="h100-sxm5",
        status=VALID, reason=None):
    monkeypatch.setattr(store_module, "now", lambda: when)
    db.parent.mkdir(parents=True, exist_ok=True)
    store = Store(db)
    try:
        summary = None if status != VALID else {"n": 64, "median_ms": median,
                                                 "p10_ms": median, "p90_ms": median,
                                                 "mean_ms": median}
        store.add(CellResult(CellKey("qwen2.5-7b", 2048, path, 64, "auto"), gpu, status, reason,
                             [median] * 64 if summary else [], summary,
                             {"floor_ms": 4.0, "total_bytes": 10**9, "peak_gbps": 3350,
                              "weight_format": "bf16", "kv_dtype": "bf16"}, {}),
                  {"device": "test"}, "env")
    finally:
        store.close()


def test_each_cell_is_judged_against_the_newest_committed_figure_of_its_gpu(tmp_path,
                                                                           monkeypatch):
    results = tmp_path / "results"
    add(results / "old" / "a.db", "engine", 5.00, "2026-12-01T00:00:00+00:00", monkeypatch)
    add(results / "new" / "b.db", "engine", 5.10, "2026-12-05T00:00:00+00:00", monkeypatch)
    add(results / "new" / "b.db", "engine-int4", 2.20, "2026-12-05T00:00:00+00:00", monkeypatch)
    add(results / "new" / "b.db", "engine-fp8", 3.00, "2026-12-05T00:00:00+00:00", monkeypatch,
        gpu="h200")  # another GPU's: not this one's figure
    add(results / "new" / "b.db", "engine-int4-fp8head", 1.0, "2026-12-06T00:00:00+00:00",
        monkeypatch, status=INVALID, reason="out of memory")  # not a figure
    check = results / "h100-check" / "cells.db"  # the check's own, left out of the committed
    when = "2026-12-07T00:00:00+00:00"
    add(check, "engine", 5.20, when, monkeypatch)  # 1.020x the newest, 1.040x the oldest
    add(check, "engine-int4", 2.30, when, monkeypatch)  # 1.045x
    add(check, "engine-fp8", 3.18, when, monkeypatch)
    add(check, "engine-int4-fp8head", 1.0, when, monkeypatch, status=INVALID,
        reason="killed by SIGSEGV")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--db", str(check), "--results",
                           str(results)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines == [
        "cell: PASS engine qwen2.5-7b ctx 2048 on h100-sxm5: 5.200 ms (76.9% of the floor) "
        "against 5.100 ms committed (new/b.db, 2026-12-05): 1.020x",
        "cell: FAIL engine-int4 qwen2.5-7b ctx 2048 on h100-sxm5: 2.300 ms (173.9% of the "
        "floor) against 2.200 ms committed (new/b.db, 2026-12-05): 1.045x, slower than the 3% "
        "allowed",
        "cell: NEW engine-fp8 qwen2.5-7b ctx 2048 on h100-sxm5: 3.180 ms (125.8% of the floor); "
        "no committed figure for this GPU",
        "cell: FAIL engine-int4-fp8head qwen2.5-7b ctx 2048 on h100-sxm5: invalid, killed by "
        "SIGSEGV"]
    proc = subprocess.run([sys.executable, str(SCRIPT), "--db", str(check), "--results",
                           str(results), "--tolerance", "0.05"], capture_output=True, text=True,
                          timeout=120)
    assert "cell: PASS engine-int4" in proc.stdout and proc.returncode == 1  # the invalid one


def suite_stages():
    spec = importlib.util.spec_from_file_location("suite_stages", SCRIPT.parent / "suite_stages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_test_file_is_in_exactly_one_stage():
    stages = suite_stages().stage_files()
    files = [f.name for fs in stages.values() for f in fs]
    assert sorted(files) == sorted(p.name for p in (SCRIPT.parents[1] / "tests").glob("test_*.py"))
    assert len(files) == len(set(files)) and all(stages.values())


# Each outcome a stage must name, under xdist's controller as on the GPU machine, in one run: a
# hang past the per-test limit fails with its stack and the tests after it run; a hang with no
# such limit, cut off by the stage's limit, is unfinished and the tests after it, in the same
# file, are named as not run.
STAGE_TESTS = '''
import time
import pytest

def test_passes():
    pass

def test_fails():
    assert 1 == 2, "the planted failure"

@pytest.fixture
def broken():
    raise RuntimeError("the planted fixture error")

def test_errors(broken):
    pass

def test_hangs():
    time.sleep(600)

def test_after_the_timeout():
    pass

@pytest.mark.timeout(0)
def test_hangs_past_the_stage():
    time.sleep(600)

def test_after_the_hang():
    pass
'''


# The hang outlasts the cut-off and both signals' grace (on a 16-core GPU host running the suite,
# a planted hang of 30 s cut off at 8 s ran to its end within SIGINT's 30 s of grace and passed);
# the cut-off at 22 s leaves a loaded host 20 s to reach the second hang, past the first one's
# 2 s. SIGINT's grace is 5 s here, not the tool's 30: the verdict is read from the journal,
# whether SIGINT ends the run or, where it cannot (a pytest started with SIGINT ignored, as in
# the background), SIGKILL.
def test_a_stage_names_every_failure_and_what_did_not_finish(tmp_path):
    tests = tmp_path / "test_planted.py"
    tests.write_text(STAGE_TESTS)
    passed, lines = suite_stages().run_stage("planted", [tests], tmp_path, 2, 2, 22, grace=5)
    assert not passed
    assert lines[0].startswith("suite planted: FAIL 2 failed, 1 error, 1 unfinished, 2 passed, "
                               "1 not run (")
    assert lines[0].endswith(", cut off at the stage's limit)")
    # each named test by its file and name: its node id's folders follow pytest's rootdir,
    # which for a file outside the project depends on where the temporary folder lies
    named = [[*words[:-1], words[-1].rsplit("/", 1)[-1]]
             for words in (line.split() for line in lines[1:])]
    assert ["failed", "test_planted.py::test_fails"] in named
    assert ["failed", "test_planted.py::test_hangs"] in named
    assert ["error", "test_planted.py::test_errors"] in named
    assert ["unfinished", "test_planted.py::test_hangs_past_the_stage"] in named
    assert ["not", "run", "test_planted.py::test_after_the_hang"] in named
    failures = (tmp_path / "planted.failures").read_text()
    assert "the planted failure" in failures and "Timeout" in failures
    assert "PASSED" in (tmp_path / "planted.log").read_text()  # each outcome as it came
