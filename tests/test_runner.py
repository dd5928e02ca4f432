"""The runner: every cell in a fresh child process, a new interpreter or a fork of the warm
worker. A child that dies by a signal, hangs past its timeout or runs out of memory is an
invalid cell naming the cause, and the sweep goes on."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import needs_bnb, run_here
from floorline.hardware import lookup
from floorline.measure import cell as cell_module
from floorline.measure import runner
from floorline.measure.cell import CellRun, measure_cell, prepare_cell, step_budget
from floorline.measure.explain import explain_in_child
from floorline.measure.sweep import Sweep
from floorline.models import resolve_model
from floorline.paths import parse_path
from floorline.records import CellKey, CellResult
from floorline.store import Store
from floorline.timing import StepPlan
from floorline.traffic import floor

# A script run in place of the runner's child, or of the warm worker (its first argument
# "worker"), whose forks then misbehave alike: each job misbehaves as the cell's context says,
# then (where it is still alive) runs as the real one. Memory is exhausted under a limit on the
# process's address space 256 MiB above what it holds, so that it cannot hurt the machine.
MISBEHAVING = '''
import json, os, resource, signal, subprocess, sys, time

def exhaust_memory():
    pages = int(open("/proc/self/statm").read().split()[0])
    held = pages * resource.getpagesize()
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (held + (256 << 20), hard))
    hoard = []
    while True:
        hoard.append(bytearray(16 << 20))

def misbehave(job):
    args = json.loads(job)["args"]
    ctx = args["cell"]["key"]["ctx"] if "cell" in args else args["ctx"]  # a cell's, explain's
    if ctx == 16:
        os.kill(os.getpid(), signal.SIGKILL)
    if ctx == 24:  # hangs, with a grandchild holding its pipes
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open(os.environ["PIDS_FILE"], "w").write(f"{os.getpid()} {sleeper.pid}")
        time.sleep(600)
    if ctx == 64:  # hangs, with a grandchild of a session of its own holding its pipes
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                   start_new_session=True)
        open(os.environ["PIDS_FILE"], "w").write(f"{sleeper.pid}")
        time.sleep(600)
    if ctx == 48:  # before the job: the process dies of an uncaught MemoryError
        exhaust_memory()
    if ctx == 56:  # as a native library that dereferences a bad pointer
        os.kill(os.getpid(), signal.SIGSEGV)
    if ctx == 32:  # inside the cell, where its session would allocate the model
        from floorline.measure import cell
        cell.open_session = lambda *args, **kwargs: exhaust_memory()

if sys.argv[1] == "worker":
    from floorline.measure import worker
    execute = worker.execute
    worker.execute = lambda job: (misbehave(job), execute(job))
    worker.main(sys.argv[2:])
else:
    misbehave(sys.argv[1])
    from floorline.measure.runner import main
    main(sys.argv[1:])
'''
GPU = lookup("l4")
MODES = ["fresh", "warm"]  # each job a new interpreter, or forked from the warm worker


def jobs_in(mode: str):
    """The runner's jobs, within this block, in new interpreters or forks of a warm worker."""
    return runner.warm_worker("cpu") if mode == "warm" else contextlib.nullcontext()


@pytest.fixture(params=MODES)
def misbehaving_child(request, tmp_path, monkeypatch):
    script = tmp_path / "misbehaving.py"
    script.write_text(MISBEHAVING)
    monkeypatch.setattr(runner, "CHILD", [sys.executable, str(script)])
    monkeypatch.setattr(runner, "WORKER", [sys.executable, str(script), "worker"])
    monkeypatch.setenv("PIDS_FILE", str(tmp_path / "pids"))
    with jobs_in(request.param):
        yield tmp_path


def key(ctx: int) -> CellKey:
    return CellKey("tiny-llama", ctx, "hf-eager", 4, 1)


def stored(db: Path) -> list[tuple[int, str, str | None]]:
    return [(r.ctx, r.status, r.reason) for r in Store(db, read_only=True).rows()]


def test_cells_whose_process_dies_are_invalid_and_the_sweep_goes_on(misbehaving_child):
    db = misbehaving_child / "r.db"
    sweep = Sweep(Store(db), "cpu", GPU)
    for ctx in (16, 32, 48, 56, 40):
        sweep.run_cell(key(ctx))
    failed = "the cell's process failed: "
    rows = stored(db)
    assert rows[:4] == [
        (16, "invalid", failed + "killed by SIGKILL (perhaps out of memory)"),
        (32, "invalid", "out of memory: MemoryError"),  # the cell caught it and said so
        (48, "invalid", failed + "out of memory: MemoryError"),  # its stderr's last line
        (56, "invalid", failed + "killed by SIGSEGV"),
    ]
    assert rows[4] == (40, "valid", None)
    cells = {r.ctx: r for r in Store(db, read_only=True).rows()}
    assert len(cells[40].samples_ms) == 4
    # A failed cell keeps what the parent knows of it: its floor and what it was to run.
    f = floor(resolve_model("tiny-llama"), GPU, 16)
    assert (cells[16].total_bytes, cells[16].floor_ms) == (f.total_bytes, f.floor_ms)
    assert cells[16].details["prompt_tokens"] == 16 and cells[16].samples_ms == []


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    except FileNotFoundError:
        return True


def test_a_cell_that_hangs_is_stopped_at_its_timeout_with_what_it_started(misbehaving_child,
                                                                          request):
    db = misbehaving_child / "r.db"
    # a warm worker starts at the first job, inside its timeout: on a busy host, seconds
    timeout = 15 if request.node.callspec.params["misbehaving_child"] == "warm" else 5
    sweep = Sweep(Store(db), "cpu", GPU, timeout_s=timeout)
    start = time.monotonic()
    sweep.run_cell(key(24))
    assert time.monotonic() - start < 60  # not held by the grandchild's open pipes
    # the next cell, with time for a new worker to start on a busy host (a GPU machine's suite)
    Sweep(Store(db), "cpu", GPU, timeout_s=120).run_cell(key(16))
    assert stored(db) == [
        (24, "invalid", f"the cell's process failed: timed out after {timeout} s"),
        (16, "invalid", "the cell's process failed: killed by SIGKILL (perhaps out of memory)"),
    ]
    pids = [int(p) for p in (misbehaving_child / "pids").read_text().split()]
    deadline = time.monotonic() + 10
    while not all(gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(p) for p in pids)


@pytest.mark.parametrize("misbehaving_child", ["fresh"], indirect=True)  # a fork's go to files
def test_pipes_held_outside_the_childs_group_do_not_hold_the_sweep(misbehaving_child,
                                                                   monkeypatch):
    monkeypatch.setattr(runner, "STOP_READ_S", 2.0)
    db = misbehaving_child / "r.db"
    start = time.monotonic()
    Sweep(Store(db), "cpu", GPU, timeout_s=5).run_cell(key(64))
    try:
        assert time.monotonic() - start < 60  # the grandchild sleeps for 120
        assert stored(db) == [(64, "invalid", "the cell's process failed: timed out after 5 s")]
    finally:
        os.kill(int((misbehaving_child / "pids").read_text()), signal.SIGKILL)


def test_explain_runs_in_a_child_and_its_death_is_one_reason(misbehaving_child):
    with pytest.raises(runner.ChildFailed, match="^killed by SIGSEGV$"):
        explain_in_child("tiny-llama", 56, "hf-eager", "cpu", GPU, steps=2, warmup=1)


@pytest.mark.parametrize("returncode, stderr, reason", [
    (-11, "", "killed by SIGSEGV"),
    (-9, "", "killed by SIGKILL (perhaps out of memory)"),
    (-6, "terminate called after throwing\n", "killed by SIGABRT"),
    (1, "Traceback (most recent call last):\n  ...\ntorch.OutOfMemoryError: CUDA out of memory.\n",
     "out of memory: torch.OutOfMemoryError: CUDA out of memory."),
    (3, "CUDA error: an illegal memory access\n\n",
     "exit code 3: CUDA error: an illegal memory access"),
    (1, "", "exit code 1"),
])
def test_how_a_child_without_a_result_is_described(returncode, stderr, reason):
    assert runner.failure(returncode, stderr) == reason


def test_a_cell_comes_back_from_its_child_whole():
    # A new interpreter, as on a GPU (a warm worker's fork returns its result the same way)
    five = CellKey("tiny-llama", 8, "hf-eager", 5, 1)
    cell = runner.run_cell_in_child(five, "cpu", GPU, seed=3)
    assert cell.key == five and cell.status == "valid" and cell.details["seed"] == 3
    assert len(cell.samples_ms) == 5 and cell.summary["median_ms"] == sorted(cell.samples_ms)[2]
    assert cell.fraction_of_floor == cell.floor["floor_ms"] / cell.summary["median_ms"]
    # The same cell as one measured in this process, but for what the clock and the host give.
    here = measure_cell(five, "cpu", GPU, seed=3)
    timed = {"samples_ms", "summary", "details"}
    varying = {"host_load", "host_warning", "clocks_after_timing", "drift", "interruptions"}
    assert {k: v for k, v in cell.as_dict().items() if k not in timed} == \
        {k: v for k, v in here.as_dict().items() if k not in timed}
    assert ({k: v for k, v in cell.details.items() if k not in varying}
            == {k: v for k, v in json.loads(json.dumps(here.details)).items()
                if k not in varying})


@pytest.mark.parametrize("path", ["engine-int4+verify8", pytest.param("bnb-nf4+graphs",
                                                                     marks=needs_bnb),
                                  "hf-static+compile+graphs"])
def test_the_child_gets_the_prepared_cell_as_the_parent_decided_it(path):
    # What the parent sends (JSON) is what it decided: the path parsed, the budget, the cell.
    cell, run = prepare_cell(CellKey("tiny-qwen2", 256, path, 64, "auto"),
                             resolve_model("tiny-qwen2"), "cuda", lookup("h200"), 0)
    assert run.path == parse_path(path)
    assert CellRun.from_dict(json.loads(json.dumps(run.as_dict()))) == run
    assert CellResult.from_dict(json.loads(json.dumps(cell.as_dict()))) == cell


def test_a_cell_parses_its_path_once(monkeypatch):
    # Prepared here and measured in the child (run in this process, its arguments through
    # JSON as they travel): the path is parsed once, by prepare_cell, and never in the child.
    def in_process(target, args, timeout_s):
        module, function = target.split(":")
        return getattr(sys.modules[module], function)(**json.loads(json.dumps(args)))

    parsed = []
    monkeypatch.setattr(runner, "run_in_child", in_process)
    monkeypatch.setattr(cell_module, "parse_path",
                        lambda text: parsed.append(text) or parse_path(text))
    cell = runner.run_cell_in_child(CellKey("tiny-llama", 8, "hf-eager", 2, 0), "cpu", GPU)
    assert cell.status == "valid" and len(cell.samples_ms) == 2 and parsed == ["hf-eager"]


# A job module for the warm worker's forks: what each sees of the process it runs in.
VISITOR = '''
import os, signal, sys, time

from floorline.measure import cell


def visit(mark):
    seen = getattr(cell, "visited", None)  # a module the worker imported before forking
    cell.visited = mark
    return {"pid": os.getpid(), "parent": os.getppid(), "seen": seen,
            "torch": "torch" in sys.modules}


def kill_worker():
    os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(600)
'''


@pytest.fixture
def visitor(tmp_path, monkeypatch):
    (tmp_path / "visitor.py").write_text(VISITOR)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))


def test_each_job_forked_from_the_warm_worker_has_a_process_of_its_own(visitor):
    with runner.warm_worker("cpu"):
        a, b = [runner.run_in_child("visitor:visit", {"mark": m}) for m in ("a", "b")]
    assert len({a["pid"], b["pid"], os.getpid()}) == 3
    assert a["parent"] == b["parent"] != os.getpid()  # one worker forked both
    assert a["torch"] and b["torch"]  # imported there before either began
    assert a["seen"] is None and b["seen"] is None  # nothing left by the job before


def test_where_fork_is_unsafe_each_job_is_a_new_interpreter(visitor, monkeypatch):
    monkeypatch.setattr(runner, "FORKS", False)  # as off Linux
    with runner.warm_worker("cpu"):
        job = runner.run_in_child("visitor:visit", {"mark": "a"})
    assert job["parent"] == os.getpid() and not job["torch"]


def test_on_a_gpu_each_job_is_a_new_interpreter(visitor):
    # a CUDA driver initialised in the worker would leave its forks without the GPU
    with runner.warm_worker("cuda"):
        job = runner.run_in_child("visitor:visit", {"mark": "a"})
    assert job["parent"] == os.getpid() and not job["torch"]


def test_a_warm_worker_that_dies_takes_only_its_job_with_it(visitor):
    with runner.warm_worker("cpu"):
        with pytest.raises(runner.ChildFailed, match=r"^killed by SIGKILL \(perhaps out of"):
            runner.run_in_child("visitor:kill_worker", {})
        first = runner.run_in_child("visitor:visit", {"mark": "a"})
        assert first["seen"] is None and first["torch"]  # a new worker forked it


# A warm worker that fails on its own: it prints its error, closes its socket, and takes a second
# (an interpreter's shutdown) to exit.
FAILING_WORKER = '''
import socket, sys, time
sock = socket.socket(fileno=int(sys.argv[1]))
socket.recv_fds(sock, 1024, 2)
print("RuntimeError: the worker cannot go on", file=sys.stderr, flush=True)
sock.close()
time.sleep(1)
sys.exit(3)
'''


def test_a_warm_worker_that_fails_reports_its_own_error_not_the_kill_after_it(tmp_path,
                                                                               monkeypatch):
    (tmp_path / "worker.py").write_text(FAILING_WORKER)
    monkeypatch.setattr(runner, "WORKER", [sys.executable, str(tmp_path / "worker.py")])
    with runner.warm_worker("cpu"):
        with pytest.raises(runner.ChildFailed) as failed:
            runner.run_in_child("visitor:visit", {"mark": "a"})
    assert failed.value.reason == "exit code 3: RuntimeError: the worker cannot go on"


def test_one_step_budget_for_cells_sessions_and_explanations():
    # tiny-qwen2 has 1024 positions. A sweep's cell at ctx 1000 with +graphs, automatic
    # warm-up and 64 timed steps: 21 positions of room, so the warm-up's cap falls to its
    # floor of two windows (64), and the prompt gives way: 1024 - (3 + 64 + 64) = 893.
    b = step_budget(StepPlan(None, 64), 1000, 1024, graphs=True)
    assert (b.plan.warmup_cap, b.decode, b.prompt, b.graph) == (64, 131, 893, 3)
    # An A/B session of two arms, 8 warm-up and 16 timed steps each, no graphs: 48 steps.
    b = step_budget(StepPlan(8, 16), 1000, 1024, graphs=False, arms=2)
    assert (b.decode, b.prompt) == (48, 976)
    # explain: 8 warm-up, 16 timed and 16 profiled steps; room to spare, the prompt is ctx.
    b = step_budget(StepPlan(8, 16), 500, 1024, graphs=False, extra=16)
    assert (b.decode, b.prompt) == (40, 500)
    # No limit (a model without max_position_embeddings): nothing is cut.
    b = step_budget(StepPlan(None, None), 500, None, graphs=False)
    assert (b.plan.warmup_cap, b.plan.steps_cap, b.prompt) == (512, 2048, 500)
    # A session that rewinds every 64 steps holds 3 + 64 positions after its prompt however
    # many steps run, so the caps stay whole; the prompt gives way to those 67 alone.
    b = step_budget(StepPlan(None, None), 1000, 1024, graphs=True, rewind=64)
    assert (b.plan.warmup_cap, b.plan.steps_cap, b.window) == (512, 2048, 64)
    assert (b.prompt, b.positions, b.decode) == (957, 1024, 3 + 512 + 2048)
    # ... and no rewind where the steps fit in the window
    assert step_budget(StepPlan(8, 16), 500, 1024, graphs=False, rewind=64).window is None


@pytest.mark.parametrize("mode", MODES)
def test_a_child_dies_with_its_parent(tmp_path, mode):
    # A parent killed outright cannot stop its child; the kernel does, so that no orphaned
    # cell goes on holding the device. A forked job dies with its worker, which dies with the
    # parent.
    (tmp_path / "sleepy.py").write_text(
        "import os, time\n"
        "def nap(pid_file):\n"
        "    open(pid_file + '.tmp', 'w').write(f'{os.getpid()} {os.getppid()}')\n"
        "    os.rename(pid_file + '.tmp', pid_file)\n"
        "    time.sleep(600)\n")
    pid_file = tmp_path / "child.pid"
    jobs = "warm_worker(\"cpu\")" if mode == "warm" else "contextlib.nullcontext()"
    parent = subprocess.Popen(
        [sys.executable, "-c", "import contextlib; from floorline.measure.runner import *\n"
                               f"with {jobs}: run_in_child('sleepy:nap', "
                               f"{{'pid_file': {str(pid_file)!r}}})"],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])})
    deadline = time.monotonic() + 120
    while not pid_file.exists():
        assert time.monotonic() < deadline and parent.poll() is None
        time.sleep(0.1)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    pids = [int(p) for p in pid_file.read_text().split()]  # the job's, and its parent's
    deadline = time.monotonic() + 10
    while not all(gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(p) for p in pids)


@pytest.mark.parametrize("command, value", [
    (("sweep", "--models", "tiny-llama", "--ctx", "16"), "nan"),
    (("ab", "--a", "hf-eager", "--b", "hf-static", "--model", "tiny-llama", "--ctx", "16"), "0"),
    (("explain", "--model", "tiny-llama", "--ctx", "16"), "2e6"),
])
def test_a_bad_timeout_is_one_line(tmp_path, command, value):
    proc = run_here(*command, "--timeout", value, "--gpu", "l4", "--db", tmp_path / "r.db")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert f"--timeout must be from 1 to 1000000 seconds, got {float(value):g}" in lines[0]
    assert not (tmp_path / "r.db").exists()


def marked(mark: str) -> list[int]:
    """The live processes whose environment holds `mark` (what a process started inherits)."""
    pids = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if mark.encode() in environ.read_bytes().split(b"\0"):
                pids.append(int(environ.parent.name))
        except OSError:  # gone, or not ours
            continue
    return [p for p in pids if not gone(p)]


def runner_children(pid: int) -> list[int]:
    """The children of `pid` that run the runner's child or its warm worker (not yet while only
    forked)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(") ", 1)[1].split()[1])
            command = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if ppid == pid and any(m in command for m in (b"floorline.measure.runner",
                                                     b"floorline.measure.worker")):
            kids.append(int(stat.parent.name))
    return kids


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_sweep_killed_as_its_cell_starts_leaves_no_process(tmp_path, sig):
    # Killed while its child (the warm worker) is still starting (importing torch): the child
    # goes with it, not at the end of its cell.
    mark = f"FLOORLINE_TEST_MARK={tmp_path.name}-{sig.name}"
    name, value = mark.split("=")
    sweep = subprocess.Popen(
        [sys.executable, "-m", "floorline", "sweep", "--db", str(tmp_path / "r.db"), "--models",
         "tiny-llama", "--ctx", "16", "--paths", "hf-eager", "--steps", "64", "--device", "cpu",
         "--gpu", "l4"],
        env={**os.environ, name: value}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not runner_children(sweep.pid):
        assert sweep.poll() is None and time.monotonic() < deadline
        time.sleep(0.005)
    sweep.send_signal(sig)
    assert sweep.wait() == -sig
    deadline = time.monotonic() + 3
    while marked(mark) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marked(mark) == []


@pytest.mark.parametrize("command", [
    ("sweep", "--models", "tiny-llama", "--ctx", "16", "--paths", "hf-eager"),
    ("ab", "--a", "hf-eager", "--b", "hf-static", "--model", "tiny-llama", "--ctx", "16"),
    ("explain", "--model", "tiny-llama", "--ctx", "16", "--path", "hf-eager"),
], ids=["sweep", "ab", "explain"])
def test_a_child_that_cannot_start_stops_the_command_in_one_line(tmp_path, command,
                                                                monkeypatch):
    python = tmp_path / "python"
    python.write_text("")  # not executable
    monkeypatch.setattr(runner, "CHILD", [str(python), *runner.CHILD[1:]])
    monkeypatch.setattr(runner, "WORKER", [str(python), *runner.WORKER[1:]])
    proc = run_here(*command, "--device", "cpu", "--gpu", "l4", "--db", tmp_path / "r.db")
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1:] == [
        f"floorline: error: cannot start the measuring process {python}: Permission denied"
    ], proc.stderr
    assert "Traceback" not in proc.stderr and stored(tmp_path / "r.db") == []


def test_a_cell_found_unsteady_is_measured_once_more_after_the_others(tmp_path, monkeypatch):
    """A first pass in order; then each unsteady cell again, once (an attempt unsteady twice
    stays so), named in the later row; every attempt kept, the newest the cell's."""
    attempts = {16: ["unsteady", "valid"], 32: ["valid"], 64: ["unsteady", "unsteady"]}
    order = []

    def child(key, *args):
        order.append(key.ctx)
        status = attempts[key.ctx].pop(0)
        return CellResult(key, GPU.name, status,
                          None if status == "valid" else f"drift at ctx {key.ctx}",
                          summary={"median_ms": 1.0, "p10_ms": 1.0, "p90_ms": 1.0,
                                   "mean_ms": 1.0, "n": 64})
    monkeypatch.setattr("floorline.measure.sweep.run_cell_in_child", child)
    sweep = Sweep(Store(tmp_path / "r.db"), "cpu", GPU)
    seen, told = [], []
    measured = sweep.run_cells([key(16), key(32), key(64)], lambda k: seen.append(k.ctx),
                               lambda k, r: seen.append(r.status), told.append)
    assert measured == 3 and told == [2]
    assert order == [16, 32, 64, 16, 64]
    assert seen == [16, "unsteady", 32, "valid", 64, "unsteady", 16, "valid", 64, "unsteady"]
    store = Store(tmp_path / "r.db", read_only=True)
    assert len(store.rows(latest=False)) == 5
    newest = {r.ctx: r for r in store.rows()}
    assert newest[16].status == "valid" and newest[64].status == "unsteady"
    assert newest[16].details["measured_again"] == (
        "after an unsteady attempt: drift at ctx 16")
    assert "measured_again" not in newest[32].details
    # a second sweep skips the valid cells and measures the unsteady one, alone, again
    attempts[64] = ["valid"]
    order.clear()
    assert Sweep(Store(tmp_path / "r.db"), "cpu", GPU).run_cells(
        [key(16), key(32), key(64)]) == 1
    assert order == [64]
