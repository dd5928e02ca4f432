"""Provenance: every row's environment names the code, software, GPU and flags it was measured
with; what can change a result is in the key that decides "already measured"; runs are
records that round-trip and survive a merge."""

import json
import shutil
import sqlite3
from pathlib import Path

import pytest

from conftest import run_here
from floorline.measure import provenance
from floorline.measure.fingerprint import environment, fingerprint_key
from floorline.records import VALID, CellKey, CellResult
from floorline.store import Store, merge

KEY = CellKey("m", 128, "engine", 8, 2)


def cell(ms: float = 2.0) -> CellResult:
    return CellResult(KEY, "cpu", VALID, None, [ms] * 8,
                      {"median_ms": ms, "p10_ms": ms, "p90_ms": ms, "mean_ms": ms, "n": 8},
                      {"floor_ms": 1.0, "total_bytes": 10**6, "weight_bytes": 9 * 10**5,
                       "kv_bytes": 10**5, "peak_gbps": 1.0, "weight_format": "bf16",
                       "kv_dtype": "bf16"})


def test_the_environment_names_code_software_flags_and_host(monkeypatch):
    monkeypatch.setenv("FLOORLINE_PDL", "0")
    env = environment("cpu")
    code = env["code"]
    assert len(code["kernels_sha256"]) == 64 and len(code["tuning_sha256"]) == 64
    assert code["version"].startswith("0.2.0+")
    # a checkout of this repository: the commit is the one git names
    assert code["commit"] is None or len(code["commit"]) == 40
    assert env["flags"]["FLOORLINE_PDL"] == "0" and env["triton"] is not None
    assert env["host"]["cpus"] >= 1 and env["python"]


def test_the_kernel_and_tuning_hashes_follow_the_files(tmp_path, monkeypatch):
    before = provenance.tuning_sha256()
    monkeypatch.setenv("FLOORLINE_CACHE", str(tmp_path))
    (tmp_path / "engine-gemv.json").write_text("{}")  # a local table over the shipped ones
    assert provenance.tuning_sha256() != before
    files = [tmp_path / "a.py"]
    files[0].write_text("x = 1")
    one = provenance.hash_files(files, tmp_path)
    files[0].write_text("x = 2")
    assert provenance.hash_files(files, tmp_path) != one


def test_a_changed_kernel_hash_or_flag_makes_a_cell_not_yet_measured(tmp_path, monkeypatch):
    store = Store(tmp_path / "r.db")
    env = environment("cpu")
    store.add(cell(), env, fingerprint_key(env))
    assert store.has_valid(KEY, fingerprint_key(env))
    assert fingerprint_key(environment("cpu")) == fingerprint_key(env)  # nothing changed

    monkeypatch.setattr(provenance, "kernels_sha256", lambda: "0" * 64)
    assert not store.has_valid(KEY, fingerprint_key(environment("cpu")))
    monkeypatch.undo()
    monkeypatch.setenv("FLOORLINE_PDL", "0")  # changes the engine's launches: a new class
    assert not store.has_valid(KEY, fingerprint_key(environment("cpu")))
    monkeypatch.setenv("FLOORLINE_LLAMA_LOG", "1")  # only a log: the same class as PDL=0 alone
    monkeypatch.delenv("FLOORLINE_PDL")
    assert store.has_valid(KEY, fingerprint_key(environment("cpu")))


def test_a_run_round_trips_and_its_rows_point_at_it(tmp_path):
    store = Store(tmp_path / "r.db")
    env = environment("cpu")
    options = {"models": ["m"], "contexts": [128], "paths": ["engine"], "steps": 8,
               "warmup": 2, "force": False}
    run = store.begin_run("sweep", options, env, fingerprint_key(env), label="headline-1")
    store.add(cell(), env, fingerprint_key(env))
    store.end_run()
    store.close()
    reader = Store(tmp_path / "r.db", read_only=True)
    (stored,) = reader.runs()
    assert stored["id"] == run and stored["command"] == "sweep"
    assert stored["label"] == "headline-1" and stored["options"] == options
    assert stored["provenance"] == json.loads(json.dumps(env)) and stored["finished_at"]
    assert stored["argv"][0] == "floorline" and stored["rows"]["cells"] == 1
    assert [r.run_id for r in reader.rows()] == [run]


def test_a_killed_run_keeps_its_rows_and_shows_it_did_not_end(tmp_path):
    store = Store(tmp_path / "r.db")
    store.begin_run("sweep", {}, {"device": "cpu"}, "k")
    store.add(cell(), {"device": "cpu"}, "k")
    store.db.close()  # the process dies before end_run
    (run,) = Store(tmp_path / "r.db", read_only=True).runs()
    assert run["finished_at"] is None and run["rows"]["cells"] == 1


def test_merge_keeps_runs_and_gives_older_rows_one_of_their_own(tmp_path):
    source, old, target = tmp_path / "s.db", tmp_path / "old.db", tmp_path / "t.db"
    s = Store(source)
    s.begin_run("sweep", {"force": True}, {"device": "cpu"}, "k", label="a")
    s.add(cell(2.0), {"device": "cpu"}, "k")
    s.end_run()
    s.close()
    o = Store(old)  # rows measured before runs were recorded
    o.add(cell(3.0), {"device": "cpu", "torch": "2.4"}, "k-old")
    o.add(cell(3.1), {"device": "cpu", "torch": "2.4"}, "k-old")
    o.close()
    t = Store(target)
    merge(t, [source, old])
    merge(t, [source, old])  # nothing is copied twice
    runs = {r["id"]: r for r in t.runs()}
    rows = t.rows(latest=False)
    assert len(rows) == 3 and len(runs) == 2
    new, *older = rows
    assert runs[new.run_id]["label"] == "a" and runs[new.run_id]["options"] == {"force": True}
    assert {r.run_id for r in older} == {r for r in runs if r != new.run_id}
    legacy = runs[older[0].run_id]
    assert legacy["command"] == "merge" and legacy["options"]["merged_from"] == "old.db"
    assert legacy["provenance"] == {"device": "cpu", "torch": "2.4"}
    assert legacy["started_at"] <= legacy["finished_at"]


def test_a_database_from_before_runs_gains_the_column_when_written(tmp_path):
    db = tmp_path / "old.db"
    results = Path(__file__).parents[1] / "bench" / "results"
    shutil.copy(results / "h200-fleet" / "h200_fleet.db", db)
    raw = sqlite3.connect(db)
    assert raw.execute("PRAGMA user_version").fetchone()[0] < 4  # from before runs
    raw.close()
    before = len(Store(db, read_only=True).rows(latest=False))
    store = Store(db)
    store.begin_run("sweep", {}, {"device": "cpu"}, "k")
    store.add(cell(), {"device": "cpu"}, "k")
    rows = Store(db, read_only=True).rows(latest=False)
    assert len(rows) == before + 1 and {r.run_id for r in rows[:-1]} == {None}
    assert rows[-1].run_id == store.run_id


@pytest.mark.parametrize("name", sorted(provenance.FLAGS))
def test_every_flag_floorline_reads_is_listed(name):
    """FLAGS is the list of variables floorline reads: each is read somewhere in the package."""
    sources = "".join(p.read_text() for p in provenance.PACKAGE.rglob("*.py")
                      if p.name != "provenance.py")
    assert name in sources or name in ("CUDA_VISIBLE_DEVICES", "TRITON_INTERPRET")


def test_a_sweep_records_its_run_and_show_lists_it(tmp_path, monkeypatch):
    db = tmp_path / "r.db"
    monkeypatch.setenv("FLOORLINE_RUN_LABEL", "bench stage x")
    run_here("sweep", "--db", db, "--models", "tiny-llama", "--ctx", "16", "--paths", "engine",
             "--steps", "8", "--warmup", "2", "--device", "cpu", check=True)
    (run,) = Store(db, read_only=True).runs()
    assert run["command"] == "sweep" and run["label"] == "bench stage x" and run["finished_at"]
    assert run["argv"][:2] == ["floorline", "sweep"] and run["rows"]["cells"] == 1
    assert run["options"]["paths"] == ["engine"] and run["options"]["steps"] == 8
    assert run["options"]["warmup"] == 2 and run["options"]["gpu"]["name"] == "cpu"
    shown = run_here("show", "--db", db, "--provenance", check=True).stdout
    assert "bench stage x" in shown and run["provenance"]["code"]["kernels_sha256"][:12] in shown
