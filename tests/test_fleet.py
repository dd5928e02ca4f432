"""Sweeps on a Dask cluster of CPU worker processes: the same cells as the in-process sweep,
resumed the same way, and a worker killed mid-cell with every cell still stored exactly once."""

import json
import os
import re
import signal
import sqlite3
import threading
from functools import partial

import pytest
import torch

from conftest import run_here

distributed = pytest.importorskip("distributed")

GPU = "l4"  # a catalogue entry, so that the floor does not depend on the host's bandwidth
# A cell for each worker: one measured, on the engine (its process starts sooner than one that
# imports transformers' models), and one invalid without a GPU (graphs)
GRID = ("--models", "tiny-llama", "--ctx", "32", "--paths", "engine,hf-static+graphs",
        "--steps", "5", "--warmup", "2", "--gpu", GPU)


@pytest.fixture(scope="module")
def cluster():
    """Two worker processes, each with one GPU resource, as `dask worker --resources GPU=1`
    starts them; on the loopback, without dashboards."""
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  resources={"GPU": 1}, host="127.0.0.1", dashboard_address=None,
                                  memory_limit=0) as c:
        yield c


def content(rows):
    """What must match between two databases of the same grid measured on one host: each cell's
    identity, status, reason, floor and environment, and the details' fields (not values:
    timings differ from run to run; nor the run, or a warning about the host's load, which
    depend on how each was started and what else ran)."""
    skip = {"id", "finished_at", "median_ms", "p10_ms", "p90_ms", "mean_ms", "fraction_of_floor",
            "achieved_gbps", "samples_ms", "fingerprint", "details", "run_id"}
    return sorted((tuple((k, v) for k, v in sorted(r.as_dict().items()) if k not in skip),
                   len(r.samples_ms), sorted(set(r.details) - {"worker", "drift", "host_warning"}))
                  for r in rows)


def test_fleet_sweep_stores_the_in_process_sweeps_cells(tmp_path, cluster):
    from floorline.hardware import lookup
    from floorline.measure.runner import warm_worker
    from floorline.measure.sweep import Grid, Sweep
    from floorline.store import Store

    fleet_db, local_db = tmp_path / "fleet.db", tmp_path / "local.db"
    # through main() in this process: the cells run on the workers' processes either way
    proc = run_here("sweep", "--db", fleet_db, "--cluster", cluster.scheduler_address,
                    "--device", "cpu", *GRID, check=True)
    assert "2 measured, 0 already valid (skipped), on 2 worker(s)" in proc.stdout
    assert "fleet" in proc.stderr and "2/2" in proc.stderr
    # The same grid swept in this process, as `floorline sweep` does without --cluster (its
    # cells forked from a warm worker)
    in_process = Sweep(Store(local_db), "cpu", lookup(GPU))
    with warm_worker("cpu"):
        for key in Grid(("tiny-llama",), (32,), ("engine", "hf-static+graphs")).cells(5, 2):
            in_process.run_cell(key)
    fleet, local = Store(fleet_db).rows(), Store(local_db).rows()
    assert len(fleet) == 2 and content(fleet) == content(local)
    assert sum(c.status == "valid" for c in fleet) == 1
    # Each cell names the worker that measured it, and both workers measured.
    names = {str(w.name) for w in cluster.scheduler.workers.values()}
    assert {c.details["worker"]["name"] for c in fleet} == names
    # The environment stored is the worker's: on this host, the in-process sweep's.
    assert {c.fingerprint_key for c in fleet} == {in_process.env_key}


def hang_or_die(marker_dir, key, device, gpu, seed, trust_remote_code, timeout_s):
    """A test's cell runner on the workers: ctx 24 hangs until the test kills its worker (the
    test marks it killed first, so that its next attempt does not hang); ctx 40 kills its own
    worker every time; ctx 16 is measured. In the worker's own process: measure_one's fresh
    process for each cell is the fleet sweep's test, and its start would only slow this one."""
    from floorline.measure.cell import measure_cell

    if key.ctx == 24 and not (marker_dir / "killed").exists():
        threading.Event().wait(120)  # the test kills this worker first
    if key.ctx == 40:
        os.kill(os.getpid(), signal.SIGKILL)
    return measure_cell(key, device, gpu, seed, trust_remote_code)


def unsteady_at_first(marker_dir, key, device, gpu, seed, trust_remote_code, timeout_s):
    """A test's cell runner on the workers: ctx 16's first attempt and every one of ctx 24's
    come back unsteady (as a disturbed host's would), the rest as measured."""
    from floorline.measure.cell import measure_cell

    cell = measure_cell(key, device, gpu, seed, trust_remote_code)
    marker = marker_dir / f"attempted-{key.ctx}"
    if key.ctx == 24 or (key.ctx == 16 and not marker.exists()):
        cell.status, cell.reason = "unsteady", f"a disturbed attempt at ctx {key.ctx}"
    marker.touch()
    return cell


def test_a_fleet_measures_each_unsteady_cell_once_more_after_the_others(tmp_path, cluster):
    """As the sweep in one process does: every attempt kept, the later naming the earlier."""
    from floorline.hardware import lookup
    from floorline.measure import fleet
    from floorline.records import CellKey
    from floorline.store import Store

    keys = [CellKey("tiny-llama", ctx, "engine", 4, 1) for ctx in (16, 24, 32)]
    store, told = Store(tmp_path / "r.db"), []
    with fleet.Fleet(cluster.scheduler_address) as f:
        fleet.sweep(f, store, keys, "cpu", lookup(GPU), on_again=told.append,
                    task_fn=partial(fleet.run_task, measure=partial(unsteady_at_first, tmp_path)))
    assert told == [2]
    rows = store.rows(latest=False)
    assert sorted(r.ctx for r in rows) == [16, 16, 24, 24, 32]
    newest = {r.ctx: r for r in store.rows()}
    assert newest[16].status == "valid" and newest[32].status == "valid"
    assert newest[24].status == "unsteady"  # unsteady twice: stays so, not tried a third time
    for ctx in (16, 24):
        assert newest[ctx].details["measured_again"] == (
            f"after an unsteady attempt: a disturbed attempt at ctx {ctx}")
    assert "measured_again" not in newest[32].details


@pytest.mark.skipif(torch.cuda.device_count() == 1, reason="two workers pinned to GPUs 0 and 1: "
                    "Dask's workers ask NVML for the GPU each is pinned to, and this machine "
                    "has one")
def test_a_worker_killed_mid_cell_loses_no_cell_and_stores_none_twice(tmp_path, monkeypatch):
    from floorline.hardware import lookup
    from floorline.measure import fleet
    from floorline.measure.fingerprint import environment
    from floorline.records import CellKey
    from floorline.store import Store

    # The environment stored must be the worker's: this process's would say so
    monkeypatch.setattr(fleet, "environment", lambda device: {"device": "the driver's"})
    keys = [CellKey("tiny-llama", ctx, "engine", 4, 1) for ctx in (16, 24, 40)]
    store = Store(tmp_path / "r.db")
    # Two workers as `local-cuda` starts them for two GPUs (on the CPU here)
    cluster = fleet.local_cuda_cluster(["0", "1"])
    with cluster, distributed.Client(cluster, set_as_default=False) as client:
        pinned = client.run(lambda: os.environ["CUDA_VISIBLE_DEVICES"])
        assert sorted(pinned.values()) == ["0", "1"]
        workers = cluster.scheduler.workers.values()
        assert all(w.address.startswith("tcp://127.0.0.1:") for w in workers)
        f = fleet.Fleet(cluster.scheduler_address)
        starts, killed = [], []

        def on_start(key, started):
            starts.append((key.ctx, started.worker, started.pid))
            if key.ctx == 24 and not killed:  # it now hangs: kill its worker from outside
                killed.append(started.pid)
                (tmp_path / "killed").touch()
                os.kill(started.pid, signal.SIGKILL)

        with f:
            todo, env_keys = fleet.to_measure(f, store, keys, "cpu", lookup(GPU))
            assert todo == keys
            # A cell is tried on two workers, then stored invalid
            fleet.sweep(f, store, todo, "cpu", lookup(GPU), attempts=2, on_start=on_start,
                        task_fn=partial(fleet.run_task, measure=partial(hang_or_die, tmp_path)))
            # Resumed, only the lost cell is measured again; with --force, every cell.
            assert fleet.to_measure(f, store, keys, "cpu", lookup(GPU))[0] == keys[2:]
            assert fleet.to_measure(f, store, keys, "cpu", lookup(GPU), force=True)[0] == keys
    rows = store.rows(latest=False)
    assert sorted(r.ctx for r in rows) == [16, 24, 40]  # each stored once
    assert {r.fingerprint["device"] for r in rows} == {environment("cpu")["device"]}
    by_ctx = {r.ctx: r for r in rows}
    assert all(by_ctx[c].status == "valid" and len(by_ctx[c].samples_ms) == 4 for c in (16, 24))
    assert by_ctx[24].fingerprint_key in env_keys
    # ctx 24 started twice: hung on the worker that was killed, then measured on another.
    tries = [(w, pid) for ctx, w, pid in starts if ctx == 24]
    assert len(tries) == 2 and tries[0][1] == killed[0] and tries[1][1] != killed[0]
    assert by_ctx[24].details["worker"]["name"] == tries[1][0]
    lost = by_ctx[40]
    assert lost.status == "invalid" and lost.gpu == GPU
    # Killed at once, before its start reached the driver: named from the workers' survey
    lost_on = re.fullmatch(r"worker lost: the worker running this cell died, 2 time\(s\) "
                           r"\((gpu[01]), (gpu[01])\); a worker's log says why \(out of "
                           r"memory, a crash\)", lost.reason)
    assert lost_on and lost.details["worker"]["name"] == lost_on[2]
    assert lost.samples_ms == [] and lost.fingerprint_key in env_keys
    check = sqlite3.connect(tmp_path / "r.db").execute("PRAGMA integrity_check").fetchone()
    assert check[0] == "ok"


def test_ab_spreads_its_sessions_over_the_fleet(tmp_path, cluster):
    import random

    db = tmp_path / "ab.db"
    # two of the engine's formats: unpaired (two bases), their processes quick to start
    proc = run_here("ab", "--db", db, "--cluster", cluster.scheduler_address, "--device", "cpu",
                    "--gpu", GPU, "--a", "engine", "--b", "engine-fp8", "--model", "tiny-llama",
                    "--ctx", "32", "--sessions", "2", "--steps", "4", "--block", "2",
                    "--warmup", "1", "--seed", "7", "--json", check=True)
    summary = json.loads(proc.stdout)
    assert summary["sessions"] == 2 and summary["failed"] == 0 and summary["gpu"] == GPU
    # Each session ran with its own seed: unpaired, the seed picks which arm goes first.
    for s in summary["per_session"]:
        first = random.Random(7 * 1_000_003 + s["index"]).randrange(2)
        assert s["first_arm"] == ("engine", "engine-fp8")[first]
        assert s["ratio"] == pytest.approx(s["ms_a"] / s["ms_b"])
    db_rows = sqlite3.connect(db).execute("SELECT idx, status FROM ab_sessions ORDER BY idx")
    assert db_rows.fetchall() == [(0, "ok"), (1, "ok")]


def test_ab_refuses_a_fleet_of_mixed_gpus():
    from floorline.errors import FloorlineError
    from floorline.measure import fleet

    class Mixed:
        address = "tcp://10.0.0.1:8786"

        def survey(self, device, gpu):
            return {"tcp://10.0.0.2:1": {"gpu": "h200", "env_key": "a"},
                    "tcp://10.0.0.3:1": {"gpu": "l4", "env_key": "b"}}

    with pytest.raises(FloorlineError) as e:
        fleet.one_kind(Mixed(), "cuda", None)
    assert str(e.value) == ("an A/B compares sessions on one kind of GPU and environment, and the "
                            "workers at tcp://10.0.0.1:8786 have 2 (h200, l4): give it workers "
                            "of one kind")


def test_a_workers_address_is_refused_as_not_the_scheduler(cluster):
    from floorline.errors import FloorlineError
    from floorline.measure import fleet

    worker = next(iter(cluster.scheduler.workers))
    with pytest.raises(FloorlineError) as e:
        fleet.Fleet(worker)
    assert str(e.value) == (f"{worker} is a Dask Worker, not a scheduler: give the scheduler's "
                            "address")
