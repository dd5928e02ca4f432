"""The sweep as a user runs it: end to end on tiny models, resumption, a killed run, two
writers, and the bad inputs a user gives."""

import csv
import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from conftest import cpu_only, gpu_only, run_cli, run_here
from floorline.hardware import lookup
from floorline.models import resolve_model
from floorline.traffic import floor

GPU = "l4"  # a catalogue entry, so that the floor does not depend on this host's bandwidth


def rows(db):
    """`floorline show --json`'s cells, run in this process (test_sweep_end_to_end runs `show`
    as a user does)."""
    return json.loads(run_here("show", "--db", db, "--json", check=True).stdout)


def test_sweep_end_to_end(tmp_path):
    db = tmp_path / "r.db"
    proc = run_cli("sweep", "--db", db, "--models", "tiny-llama,tiny-qwen2", "--ctx", "32",
                   "--paths", "hf-eager,hf-static,hf-static+graphs", "--steps", "5",
                   "--warmup", "2", "--device", "cpu", "--gpu", GPU, check=True)
    assert "6 measured, 0 already valid" in proc.stdout
    cells = rows(db)
    assert len(cells) == 6
    for c in cells:
        if c["path"] == "hf-static+graphs":  # not on the CPU: an invalid cell with its reason
            assert c["status"] == "invalid"
            assert c["reason"] == "path unavailable: +graphs needs a CUDA device"
            assert c["median_ms"] is None and c["samples_ms"] == []
            continue
        assert c["status"] == "valid", c["reason"]
        f = floor(resolve_model(c["model"]), lookup(GPU), c["ctx"])
        assert (c["total_bytes"], c["floor_ms"]) == (f.total_bytes, pytest.approx(f.floor_ms))
        samples = sorted(c["samples_ms"])
        assert len(samples) == 5 and c["median_ms"] == samples[2]
        assert c["fraction_of_floor"] == pytest.approx(c["floor_ms"] / c["median_ms"])
        assert c["achieved_gbps"] == pytest.approx(c["total_bytes"] / c["median_ms"] / 1e6)
        assert c["fingerprint"]["torch"] and c["details"]["seed"] == 0
    table = csv.DictReader(io.StringIO(run_cli("show", "--db", db, "--csv", check=True).stdout))
    assert len(list(table)) == 6
    assert json.loads(run_cli("show", "--db", db, "--json", check=True).stdout) == cells


@gpu_only("CUDA graphs")
def test_graphed_paths_are_valid_cells_on_a_gpu(tmp_path):
    db = tmp_path / "r.db"
    run_cli("sweep", "--db", db, "--models", "tiny-llama", "--ctx", "32", "--paths",
            "hf-static+graphs,engine", "--steps", "8", "--warmup", "4", check=True)
    cells = {c["path"]: c for c in rows(db)}
    assert all(c["status"] == "valid" and len(c["samples_ms"]) == 8 for c in cells.values())
    assert set(cells) == {"hf-static+graphs", "engine"}


def test_resume_skips_valid_cells_and_force_remeasures(tmp_path):
    db = tmp_path / "r.db"
    args = ("sweep", "--db", db, "--models", "tiny-llama", "--ctx", "16", "--steps", "3",
            "--warmup", "2", "--paths", "hf-eager,hf-static+graphs", "--device", "cpu", "--gpu",
            GPU)
    run_here(*args, check=True)
    first = {c["id"] for c in rows(db)}
    again = run_here(*args, check=True)
    # The valid cell is skipped; the invalid one is tried again.
    assert "1 measured, 1 already valid" in again.stdout
    assert sum(c["status"] == "valid" for c in rows(db)) == 1
    run_here(*args, "--force", check=True)
    history = json.loads(run_here("show", "--db", db, "--json", "--all", check=True).stdout)
    assert len(history) == 2 + 1 + 2 and first < {c["id"] for c in history}


def wait_for_cells(db, n: int, timeout_s: float = 120) -> None:
    """Until the database holds `n` cells (a sweep commits each as it ends)."""
    deadline, done = time.time() + timeout_s, 0
    while time.time() < deadline and done < n:
        time.sleep(0.2)
        if db.exists():
            try:
                done = sqlite3.connect(db).execute("SELECT COUNT(*) FROM cells").fetchone()[0]
            except sqlite3.OperationalError:
                pass


# The next two are of the database and the processes, the same on any device: on the CPU by
# name. On a GPU machine each of their tiny cells takes tens of seconds (a fresh process, the
# warm-up, the energy windows): on an H100 the first took 238 s and the second was still
# running after 200 s.
def test_a_killed_sweep_keeps_its_cells_and_resumes(tmp_path):
    db = tmp_path / "r.db"
    contexts = "16,24,32,40,48"
    args = [sys.executable, "-m", "floorline", "sweep", "--db", str(db), "--models", "tiny-llama",
            "--ctx", contexts, "--paths", "hf-eager", "--steps", "60", "--gpu", GPU,
            "--device", "cpu"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_cells(db, 2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    kept = rows(db)
    assert 2 <= len(kept) < 5, "the sweep should die halfway"
    # 60 timed steps are judged for steadiness: on a busy host a kept cell may be unsteady,
    # which the resumed sweep measures again; either way its samples were all kept.
    assert all(c["status"] in ("valid", "unsteady") and len(c["samples_ms"]) == 60
               for c in kept)
    assert sqlite3.connect(db).execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    resumed = run_cli(*args[3:], check=True)
    valid = {c["id"] for c in kept if c["status"] == "valid"}
    assert f"{5 - len(valid)} measured, {len(valid)} already valid" in resumed.stdout
    final = rows(db)
    assert sorted(c["ctx"] for c in final) == [int(c) for c in contexts.split(",")]
    assert valid <= {c["id"] for c in final}


def test_ctrl_c_ends_a_sweep_in_one_line_keeping_its_cells(tmp_path):
    db = tmp_path / "r.db"
    proc = subprocess.Popen(
        [sys.executable, "-m", "floorline", "sweep", "--db", str(db), "--models", "tiny-llama",
         "--ctx", "16,24,32,40,48,56", "--paths", "hf-eager", "--steps", "8", "--warmup", "2",
         "--gpu", GPU], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        # Ctrl-C as at a terminal: a test run in the background inherits SIGINT ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    wait_for_cells(db, 1)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert stderr.splitlines()[-1] == ("floorline: interrupted; every finished cell is in the "
                                       "database"), stderr
    kept = rows(db)
    assert 1 <= len(kept) < 6 and all(len(c["samples_ms"]) == 8 for c in kept)


def test_ctrl_c_ends_generate_in_one_line(monkeypatch):
    from typer.testing import CliRunner

    from floorline import cli
    from floorline.engine import generate

    def interrupted(*args, on_text, **kwargs):
        on_text("w1 w2")
        raise KeyboardInterrupt
    monkeypatch.setattr(generate, "generate", interrupted)
    result = CliRunner().invoke(cli.app, ["generate", "--model", "m", "--prompt", "p",
                                          "--device", "cpu", "--gpu", GPU])
    assert result.exit_code == 130
    assert result.stdout == "w1 w2\n"  # the text so far, its line ended
    assert result.stderr == "floorline: interrupted; generation stopped\n"


def test_two_sweeps_on_one_database_lose_nothing(tmp_path):
    db = tmp_path / "r.db"
    base = [sys.executable, "-m", "floorline", "sweep", "--db", str(db), "--paths", "hf-eager",
            "--steps", "3", "--gpu", GPU, "--device", "cpu"]
    procs = [subprocess.Popen(base + ["--models", m, "--ctx", "8,16,24"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for m in ("tiny-llama", "tiny-qwen2")]
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stderr.read()
    assert len(rows(db)) == 6


def test_context_above_the_model_limit_is_an_invalid_cell(tmp_path):
    # tiny-qwen2 has 1024 positions; 4 timed and 8 warm-up steps. At ctx 1024 the prompt is
    # shortened to 1012 tokens so that the last timed step takes the last position.
    db = tmp_path / "r.db"
    proc = run_here("sweep", "--db", db, "--models", "tiny-qwen2", "--ctx", "16,1024,1025",
                   "--steps", "4", "--warmup", "8", "--gpu", GPU, "--paths", "hf-eager")
    assert proc.returncode == 0
    by_ctx = {c["ctx"]: c for c in rows(db)}
    assert by_ctx[16]["status"] == "valid" and by_ctx[16]["details"]["prompt_tokens"] == 16
    assert by_ctx[1024]["status"] == "valid"
    assert by_ctx[1024]["details"]["prompt_tokens"] == 1024 - 4 - 8
    assert by_ctx[1024]["details"]["timed_steps_read"] == [1020, 1023]
    assert by_ctx[16]["details"]["timed_steps_read"] == [24, 27]  # after 8 warm-up steps
    assert by_ctx[1025]["status"] == "invalid"
    assert by_ctx[1025]["reason"] == ("context above the model's limit: ctx 1025 with 12 decode "
                                      "steps does not fit in 1024 positions")


def test_a_long_timing_rewinds_within_64_positions_past_the_context(tmp_path):
    # 8 warm-up and 100 timed steps run in a session of 64 positions past the prompt, rewound
    # every 64 steps, so the timed steps read 16-79 cached tokens at ctx 16; at ctx 1024,
    # tiny-qwen2's last position, the prompt gives way to the 64 alone. transformers' sliding-
    # window model cannot rewind: its steps go on from the prompt (8 warm-up, then 100 timed).
    db = tmp_path / "r.db"
    proc = run_here("sweep", "--db", db, "--models", "tiny-qwen2,tiny-mistral-swa", "--ctx",
                    "16,1024", "--steps", "100", "--warmup", "8", "--gpu", GPU, "--paths",
                    "hf-static,engine")
    assert proc.returncode == 0, proc.stderr
    cells = {(c["model"], c["path"], c["ctx"]): c for c in rows(db)}
    # measured (steps timed on a busy CPU may be stored as unsteady; their positions are kept)
    assert {c["status"] for c in cells.values()} <= {"valid", "unsteady"}
    for path in ("hf-static", "engine"):
        d = cells["tiny-qwen2", path, 16]["details"]
        assert (d["rewound_every"], d["prompt_tokens"], d["timed_steps_read"]) == (64, 16, [16, 79])
        d = cells["tiny-qwen2", path, 1024]["details"]
        assert (d["prompt_tokens"], d["timed_steps_read"]) == (960, [960, 1023])
    d = cells["tiny-mistral-swa", "engine", 16]["details"]
    assert (d["rewound_every"], d["timed_steps_read"]) == (64, [16, 79])
    d = cells["tiny-mistral-swa", "hf-static", 16]["details"]
    assert "rewound_every" not in d and d["timed_steps_read"] == [24, 123]


def one_line_error(proc, *fragments):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    for f in fragments:
        assert f in lines[0], proc.stderr


@pytest.mark.parametrize("args, fragments", [
    (["floor", "--model", "qwen9", "--gpu", "h200"], ["unknown model 'qwen9'"]),
    (["floor", "--model", "qwen2.5-7b", "--gpu", "h300"], ["unknown GPU 'h300'"]),
    pytest.param(["floor", "--model", "qwen2.5-7b"], ["pass --gpu"],
                 marks=cpu_only("on a GPU machine the floor's GPU is the one detected")),
    (["floor", "--model", "qwen2.5-7b", "--gpu", "h200", "--ctx", "-5"], ["positive", "-5"]),
    (["floor", "--model", "qwen2.5-7b", "--gpu", "h200", "--ctx", "2k"], ["whole number", "'2k'"]),
    (["sweep", "--models", "tiny-llama", "--ctx", "abc"], ["whole number", "'abc'"]),
    (["sweep", "--models", "nope"], ["unknown model 'nope'"]),
    (["sweep", "--models", "tiny-llama", "--paths", "hf-turbo"], ["unknown path 'hf-turbo'"]),
    (["sweep", "--models", "tiny-llama", "--db", "/proc/no/such/dir/x.db", "--gpu", GPU],
     ["cannot use results database"]),
    (["show", "--db", "/nonexistent/r.db"], ["no results database"]),
])
def test_bad_input_is_one_clear_line(args, fragments):
    one_line_error(run_here(*args), *fragments)


@cpu_only("a machine with a GPU has the CUDA device this asks for")
def test_a_cuda_device_where_there_is_none_is_one_clear_line():
    one_line_error(run_here("sweep", "--models", "tiny-llama", "--device", "cuda"),
                   "no CUDA device")


def test_bad_model_directories(tmp_path):
    one_line_error(run_here("floor", "--model", tmp_path, "--gpu", "h200"), "has no config.json")
    (tmp_path / "config.json").write_text("{oops")
    one_line_error(run_here("floor", "--model", tmp_path, "--gpu", "h200"), "not valid JSON")


def test_a_file_that_is_not_a_database(tmp_path):
    bogus = tmp_path / "r.db"
    bogus.write_text("not sqlite at all, just some text " * 100)
    one_line_error(run_here("show", "--db", bogus), "cannot use results database")


def test_floor_json(tmp_path):
    proc = run_cli("floor", "--model", "qwen2.5-7b", "--gpu", "h200", "--ctx", "2048,16384",
                   "--json", check=True)
    out = json.loads(proc.stdout)
    assert [o["ctx"] for o in out] == [2048, 16384]
    keys = {"model", "gpu", "ctx", "weight_bytes", "kv_bytes", "total_bytes", "peak_gbps",
            "floor_ms", "total_bytes_all_params", "floor_ms_all_params"}
    assert keys <= set(out[0])
    assert out[0]["floor_ms"] == pytest.approx(out[0]["total_bytes"] / 4.8e9)


def test_listing_commands():
    models = run_cli("models", check=True).stdout
    assert "qwen2.5-7b" in models and "7.616 B" in models
    gpus = run_cli("gpus", check=True).stdout
    assert "jetson-agx-orin" in gpus and "4800" in gpus
