"""The A/B experiment: interval arithmetic, coverage, and fresh sessions end to end."""

import json
import sys

import numpy as np
import pytest
from scipy.stats import bootstrap

from conftest import run_here
from floorline.measure import runner
from floorline.measure.ab import Plan, SessionResult, run_sessions, summarise_sessions
from floorline.measure.session import block_order
from floorline.stats import mean_interval


def test_interval_is_scipys_bca_on_the_same_data():
    data = np.array([1.21, 1.27, 1.24, 1.30, 1.22, 1.26, 1.25, 1.28, 1.23, 1.29])
    ours = mean_interval(data, seed=11)
    ref = bootstrap((data,), np.mean, n_resamples=10_000, method="BCa",
                    rng=np.random.default_rng(11)).confidence_interval
    assert ours.estimate == pytest.approx(data.mean())
    assert (ours.low, ours.high) == (pytest.approx(ref.low), pytest.approx(ref.high))
    assert ours.low < data.mean() < ours.high


def test_no_interval_from_one_or_identical_sessions():
    assert mean_interval([1.2], seed=0).low is None
    assert mean_interval([1.2, 1.2, 1.2], seed=0).high is None


def test_intervals_cover_the_true_mean_about_95_percent_of_the_time():
    # Simulated experiments: N=10 session ratios from a known distribution (true mean 1.259).
    rng = np.random.default_rng(2026)
    trials, covered = 400, 0
    for t in range(trials):
        ratios = rng.normal(1.259, 0.01, size=10)
        iv = mean_interval(ratios, seed=t, resamples=2000)
        covered += iv.low <= 1.259 <= iv.high
    # BCa at N=10 under-covers slightly; a broken interval lands far outside this band.
    assert 0.88 <= covered / trials <= 0.98


def test_abba_blocks():
    assert block_order(0, 2) == [0, 1, 1, 0, 0, 1, 1, 0]
    assert block_order(1, 1) == [1, 0, 0, 1]


def test_summary_rests_on_the_sessions_that_ran():
    plan = Plan("hf-static", "hf-static+graphs", "m", 8, "cpu", "l4", sessions=3)
    sessions = [SessionResult(0, "ok", None, "hf-static", [2.0, 2.0], [1.0, 1.0]),
                SessionResult(1, "failed", "exit code 1: boom"),
                SessionResult(2, "ok", None, "hf-static", [3.0], [2.0])]
    s = summarise_sessions(plan, sessions)
    assert s.speedup.estimate == pytest.approx((2.0 + 1.5) / 2) and s.speedup.n == 2
    d = s.as_dict()
    assert (d["sessions"], d["failed"], d["sessions_requested"]) == (2, 1, 3)
    assert "N=2 fresh sessions" in d["sentence"] and "1 failed" in d["sentence"]


def test_ab_end_to_end_paired_with_three_fresh_sessions(tmp_path):
    db = tmp_path / "r.db"
    proc = run_here("ab", "--a", "hf-static", "--b", "hf-static", "--model", "tiny-llama",
                    "--ctx", "32", "--sessions", "3", "--steps", "8", "--block", "2",
                    "--seed", "5", "--db", db, "--gpu", "l4", "--json", check=True)
    out = json.loads(proc.stdout)  # the progress went to stderr, leaving the JSON whole
    assert out["paired"] and out["sessions"] == 3 and out["seed"] == 5
    progress = [line for line in proc.stderr.splitlines() if "3/3" in line]
    assert len(progress) == 1 and " left " in progress[0], proc.stderr
    keys = {"a", "b", "model", "ctx", "gpu", "sessions", "speedup", "ci_low", "ci_high",
            "per_session"}
    assert keys <= set(out)
    ratios = [s["ratio"] for s in out["per_session"]]
    assert all(s["ratio"] == pytest.approx(s["ms_a"] / s["ms_b"]) for s in out["per_session"])
    assert out["speedup"] == pytest.approx(np.mean(ratios))
    assert out["sentence"].startswith("hf-static is ") and "N=3 fresh sessions" in out["sentence"]
    import sqlite3

    con = sqlite3.connect(db)
    assert con.execute("SELECT COUNT(*) FROM ab_sessions WHERE status='ok'").fetchone()[0] == 3
    stored = json.loads(con.execute("SELECT summary FROM ab_experiments").fetchone()[0])
    assert stored["speedup"] == out["speedup"]

    # cut off after its second session (its machine lost): --resume runs the third alone
    with con:
        con.execute("UPDATE ab_experiments SET summary=NULL, finished_at=NULL")
        con.execute("DELETE FROM ab_sessions WHERE idx=2")
    kept = con.execute("SELECT idx, samples_a, samples_b FROM ab_sessions").fetchall()
    again = run_here("ab", "--a", "hf-static", "--b", "hf-static", "--model", "tiny-llama",
                     "--ctx", "32", "--sessions", "3", "--steps", "8", "--block", "2",
                     "--db", db, "--gpu", "l4", "--json", "--resume", check=True)
    assert "seed 5" in again.stderr and ("resuming the A/B cut off in " + str(db) +
                                         ": 2 of its sessions are stored, 1 to run") in again.stderr
    resumed = json.loads(again.stdout)
    assert resumed["sessions"] == 3 and resumed["seed"] == 5
    assert [s["index"] for s in resumed["per_session"]] == [0, 1, 2]
    assert con.execute("SELECT COUNT(*) FROM ab_experiments").fetchone()[0] == 1
    assert con.execute("SELECT idx, samples_a, samples_b FROM ab_sessions WHERE idx < 2"
                       ).fetchall() == kept
    assert json.loads(con.execute("SELECT summary FROM ab_experiments").fetchone()[0])[
        "per_session"] == resumed["per_session"]


def every_session(plan, on_session=lambda s: None):
    """The plan's sessions run here, as the command runs them, and their summary."""
    return summarise_sessions(plan, run_sessions(plan, list(range(plan.sessions)), on_session))


def test_ab_unpaired_runs_each_arm_in_its_own_session():
    with runner.warm_worker("cpu"):  # as the command runs it on the CPU: a fork per arm
        out = every_session(Plan("hf-eager", "hf-static", "tiny-qwen2", 16, "cpu", "l4",
                                 sessions=2, steps=4, block=2, warmup=1, seed=3))
    assert not out.plan.paired and len(out.ok) == 2
    assert all(len(s.samples_a) == len(s.samples_b) == 4 for s in out.ok)
    assert "unpaired" in out.sentence()


def test_a_crashing_session_is_recorded_and_the_others_kept(tmp_path, monkeypatch):
    # A session (index 1) that dies before measuring anything, forked by a warm worker as the
    # CPU's sessions are (a fresh interpreter per session would import torch each time).
    crasher = tmp_path / "worker.py"
    crasher.write_text(
        "import json, os, sys\n"
        "from floorline.measure import worker\n"
        "execute = worker.execute\n"
        "def crash_second(job):\n"
        "    if json.loads(job)['args']['seed'] % 1_000_003 == 1:\n"
        "        print('CUDA error: an illegal memory access', file=sys.stderr); os._exit(3)\n"
        "    execute(job)\n"
        "worker.execute = crash_second\n"
        "worker.main(sys.argv[1:])\n")
    monkeypatch.setattr(runner, "WORKER", [sys.executable, str(crasher)])
    seen = []
    with runner.warm_worker("cpu"):
        out = every_session(Plan("hf-static", "hf-static", "tiny-llama", 16, "cpu", "l4",
                                 sessions=3, steps=4, block=2, warmup=1, seed=0),
                            on_session=seen.append)
    assert [s.status for s in out.sessions] == ["ok", "failed", "ok"]
    assert out.sessions[1].reason == "exit code 3: CUDA error: an illegal memory access"
    assert [s.index for s in seen] == [0, 1, 2]
    assert out.speedup.n == 2


def test_ab_bad_input(tmp_path):
    # on the CPU by name: on a GPU machine the default device would run this A/B
    proc = run_here("ab", "--a", "hf-static", "--b", "hf-static+graphs", "--model", "tiny-llama",
                    "--ctx", "16", "--db", tmp_path / "r.db", "--gpu", "l4", "--device", "cpu")
    assert proc.returncode == 2 and "+graphs needs a CUDA device" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("command, line", [
    (("ab", "--a", "hf-static", "--b", "hf-static", "--sessions", "2"),
     "no session of hf-static vs hf-static succeeded (2 tried): timed out after 1 s"),
    (("explain", "--path", "hf-eager"),
     "explaining hf-eager at ctx 16 failed: timed out after 1 s"),
], ids=["ab", "explain"])
def test_a_command_whose_every_measurement_failed_exits_1_in_one_line(tmp_path, command, line):
    # 1 s is too short for a child to import torch: every session, or the one explanation,
    # times out.
    db = tmp_path / "r.db"
    proc = run_here(*command, "--model", "tiny-llama", "--ctx", "16", "--timeout", "1",
                    "--device", "cpu", "--gpu", "l4", "--db", db)
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr
    assert proc.stderr.splitlines()[-1] == f"floorline: error: {line}", proc.stderr
    assert proc.stderr.count("floorline: error:") == 1 and "Traceback" not in proc.stderr


class Sessions:
    """A bench's session runner that makes up each session from its index and seed (the first
    arm and energy too), and can be cut off after a number of sessions, as a killed run is."""

    def __init__(self, cut_after: int | None = None):
        self.cut_after, self.ran = cut_after, []

    def __call__(self, plan, indices, on_session):
        out = []
        for i in indices:
            if self.cut_after is not None and len(self.ran) == self.cut_after:
                raise KeyboardInterrupt
            rng = np.random.default_rng(plan.seed * 1000 + i)
            first = plan.a if rng.random() < 0.5 else plan.b
            s = SessionResult(i, "ok", None, first, list(rng.uniform(2, 3, 4)),
                              list(rng.uniform(1, 2, 4)), [8, 8 + i],
                              {"joules_per_token": 2.0 + i, "error_bound": 0.001},
                              {"joules_per_token": 1.0, "error_bound": 0.001})
            self.ran.append(i)
            on_session(s)
            out.append(s)
        return out


def recorded(tmp_path, sessions, seed=7, env=None, resume=True, any_seed=False, n=5):
    from floorline.measure.ab import Bench, Recording

    plan = Plan("hf-static", "hf-static+graphs", "tiny-llama", 16, "cuda", "h100-sxm5",
                sessions=n, seed=seed)
    env = env or {"device": "NVIDIA H100", "torch": "2.11.0", "floorline": "0.2.0"}
    return Recording(Bench(plan, env, sessions), tmp_path / "r.db", {}, None, resume, any_seed)


def test_a_cut_off_ab_resumed_ends_as_an_uninterrupted_one(tmp_path):
    (tmp_path / "whole").mkdir()
    (tmp_path / "cut").mkdir()
    whole = recorded(tmp_path / "whole", Sessions()).run()
    with pytest.raises(KeyboardInterrupt):
        recorded(tmp_path / "cut", Sessions(cut_after=3)).run()
    rest = Sessions()
    again = recorded(tmp_path / "cut", rest, seed=99, any_seed=True)  # the seed adopted
    assert again.plan.seed == 7 and [s.index for s in again.resumed] == [0, 1, 2]
    summary = again.run()
    assert rest.ran == [3, 4]
    assert summary.as_dict() == whole.as_dict()  # energy and warm-up kept through the database
    assert summary.energy is not None and summary.energy.n == 5
    from floorline.store import Store

    assert Store(tmp_path / "cut" / "r.db").ab_summaries()[0]["speedup"] == whole.speedup.estimate


@pytest.mark.parametrize("change", ["no --resume", "another seed asked", "another environment",
                                    "more sessions", "finished"])
def test_only_a_cut_off_ab_of_the_same_plan_and_environment_is_resumed(tmp_path, change):
    with pytest.raises(KeyboardInterrupt):
        recorded(tmp_path, Sessions(cut_after=2)).run()
    if change == "finished":
        recorded(tmp_path, Sessions()).run()  # a new A/B, resuming the cut-off one, ends it
        assert recorded(tmp_path, Sessions()).experiment is None
        return
    kwargs = {"no --resume": {"resume": False}, "another seed asked": {"seed": 8},
              "another environment": {"env": {"device": "NVIDIA H200", "torch": "2.11.0"}},
              "more sessions": {"n": 6}}[change]
    fresh = recorded(tmp_path, Sessions(), **kwargs)
    assert fresh.experiment is None and fresh.resumed == [] and fresh.to_run() == list(
        range(fresh.plan.sessions))
