"""One runner for every measurement: a job in a fresh child process, one result back.

A job names a function ("module:function") and its keyword arguments; the child calls it and
prints its JSON-able result on one tagged line (measure/child.py). The child is a new
interpreter, `python -m floorline.measure.runner JOB_JSON`, or, within warm_worker(), a fork of
a warm worker that has imported torch and the measuring code once (measure/worker.py). A
sweep's cell, an A/B session, an explanation and a path's quality measurement all run this way,
so that a native library that crashes, hangs or runs out of memory loses that one job, not the
command: the job comes back as a failure naming the cause.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict

from floorline.hardware import DeviceSpec
from floorline.measure.cell import CellRun, measure_prepared, prepare_cell
from floorline.measure.child import RESULT_TAG, execute, start
from floorline.measure.quality import measure_quality, prepare_quality
from floorline.measure.worker import FORKS, Worker
from floorline.models import resolve_model
from floorline.records import CellKey, CellResult, QualityKey, QualityResult

# The child's command, before the job, and the warm worker's, before its socket; tests point
# them at scripts that misbehave.
CHILD = [sys.executable, "-m", "floorline.measure.runner"]
WORKER = [sys.executable, "-m", "floorline.measure.worker"]
# Long enough for a 7-8B model's load, compilation and a long prompt on a GPU; a CPU demo cell
# takes seconds.
TIMEOUT_S = 1800.0
# After its group is killed, how long a child's pipes are read for what it printed last: a
# process that left the group (a daemon of a library, a session of its own) can hold them open.
STOP_READ_S = 10.0
OOM_HINTS = ("MemoryError", "OutOfMemoryError", "out of memory", "can't allocate memory")


class ChildFailed(Exception):
    """The child returned no result: the reason names the cause."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def failure(returncode: int, stderr: str) -> str:
    """Why a child that printed no result ended: a signal, memory, or an exit code with the
    last line it wrote to stderr."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    last = f": {lines[-1]}" if lines else ""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        # The kernel's OOM killer sends SIGKILL and leaves no message.
        return f"killed by {name}" + (" (perhaps out of memory)" if name == "SIGKILL" else "")
    if any(hint in (lines[-1] if lines else "") for hint in OOM_HINTS):
        return f"out of memory{last}"
    return f"exit code {returncode}{last}"


_worker: Worker | None = None  # while warm_worker() is entered where fork is safe


@contextmanager
def warm_worker(device: str) -> Iterator[None]:
    """Within it, each job's fresh process is forked from one warm worker (measure/worker.py),
    started at the first job, instead of being a new interpreter that imports it all again; on
    Linux and for the CPU only, elsewhere nothing changes. On a GPU a cell's second of start-up
    is small beside its model's load, and a CUDA driver initialised in the worker (a device
    count taken by an import is enough) would leave its forks unable to use the GPU. One job at
    a time, from the thread that entered it: the kernel kills the worker when that thread ends."""
    global _worker
    if not FORKS or device != "cpu" or _worker is not None:
        yield
        return
    _worker = Worker(WORKER)
    try:
        yield
    finally:
        _worker.close()
        _worker = None


def run_in_child(target: str, args: dict, timeout_s: float = TIMEOUT_S) -> dict:
    """`target(**args)` ("module:function", returning a JSON-able dict) in a fresh process:
    its result. ChildFailed where the child died by a signal, ran out of memory, ran past
    `timeout_s`, raised, or ended without a result; FloorlineError where it cannot start."""
    job = json.dumps({"target": target, "args": args})
    try:
        returncode, stdout, stderr = (fresh if _worker is None else _worker.run)(job, timeout_s)
    except subprocess.TimeoutExpired:
        raise ChildFailed(f"timed out after {timeout_s:g} s") from None
    for line in stdout.splitlines():
        if line.startswith(RESULT_TAG):
            out = json.loads(line[len(RESULT_TAG):])
            if "error" in out:
                raise ChildFailed(out["error"])
            return out["result"]
    raise ChildFailed(failure(returncode, stderr))


def fresh(job: str, timeout_s: float) -> tuple[int, str, str]:
    """`job` in a new interpreter: its exit code, stdout and stderr; subprocess.TimeoutExpired
    past `timeout_s`, its process group then killed."""
    proc = start(CHILD + [job], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except BaseException:  # a timeout, or Ctrl-C, which reaches only the parent's process group
        _stop(proc)
        raise
    return proc.returncode, stdout, stderr


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.communicate(timeout=STOP_READ_S)
    except subprocess.TimeoutExpired:  # the pipes outlive the group: stop reading them
        for pipe in (proc.stdout, proc.stderr):
            pipe.close()
        proc.wait()


def run_cell_in_child(key: CellKey, device: str, gpu: DeviceSpec, seed: int = 0,
                      trust_remote_code: bool = False,
                      timeout_s: float = TIMEOUT_S) -> CellResult:
    """One cell prepared here, its path parsed once, and measured in a fresh process
    (measure_prepared), which is sent the prepared cell whole. A cell that cannot run here is
    invalid without one; a child that fails makes an invalid cell naming the cause."""
    cell, run = prepare_cell(key, resolve_model(key.model, trust_remote_code), device, gpu, seed)
    if run is None:
        return cell
    args = {"cell": cell.as_dict(), "run": run.as_dict(), "device": device, "seed": seed,
            "trust_remote_code": trust_remote_code}
    try:
        return CellResult.from_dict(run_in_child("floorline.measure.runner:cell_job", args,
                                                 timeout_s))
    except ChildFailed as e:
        cell.reason = f"the cell's process failed: {e.reason}"
        return cell


def cell_job(cell: dict, run: dict, device: str, seed: int, trust_remote_code: bool) -> dict:
    """measure_prepared inside the child."""
    prepared = CellResult.from_dict(cell)
    model_spec = resolve_model(prepared.key.model, trust_remote_code)
    return measure_prepared(prepared, CellRun.from_dict(run), model_spec, device, seed).as_dict()


# The reference's greedy continuations of each model on each device, as this command's first
# quality measurement of it decoded them (seconds a path on a CPU): its later paths' reuse them.
_continuations: dict[tuple[str, str, bool], list[dict]] = {}


def run_quality_in_child(key: QualityKey, device: str, gpu: DeviceSpec, seed: int = 0,
                         trust_remote_code: bool = False,
                         timeout_s: float = TIMEOUT_S) -> QualityResult:
    """One path's quality measured in a fresh process (measure/quality.py); one that cannot be
    measured here (random weights, a path unavailable) is invalid without one, and a child that
    fails makes an invalid row naming the cause."""
    result, runnable = prepare_quality(key, resolve_model(key.model, trust_remote_code), device,
                                       gpu)
    if not runnable:
        return result
    reference = (key.model, device, trust_remote_code)
    args = {"key": asdict(key), "device": device, "gpu": asdict(gpu), "seed": seed,
            "trust_remote_code": trust_remote_code,
            "continuations": _continuations.get(reference)}
    try:
        out = run_in_child("floorline.measure.runner:quality_job", args, timeout_s)
    except ChildFailed as e:
        result.reason = f"the measurement's process failed: {e.reason}"
        return result
    if out["continuations"] is not None:
        _continuations[reference] = out["continuations"]
    return QualityResult.from_dict(out["quality"])


def quality_job(key: dict, device: str, gpu: dict, seed: int, trust_remote_code: bool,
                continuations: list[dict] | None) -> dict:
    """measure_quality inside the child: its row and the reference's continuations."""
    result, decoded = measure_quality(QualityKey(**key), device, DeviceSpec(**gpu), seed,
                                      trust_remote_code, continuations)
    return {"quality": result.as_dict(), "continuations": decoded}


def main(argv: list[str]) -> None:
    execute(argv[0])


if __name__ == "__main__":
    main(sys.argv[1:])
