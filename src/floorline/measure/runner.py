"""One runner for every measurement: a job in a fresh child process, one result back.

The parent runs `python -m floorline.measure.runner JOB_JSON`, where the job names a function
("module:function") and its keyword arguments; the child calls it and prints its JSON-able
result on one tagged line. A sweep's cell, an A/B session, an explanation and a path's quality
measurement all run this way, so that a native library that crashes, hangs or runs out of memory
loses that one job, not the command: the job comes back as a failure naming the cause.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict

from floorline.errors import FloorlineError, exception_line, one_line, out_of_memory
from floorline.hardware import DeviceSpec
from floorline.measure.cell import measure_cell, prepare_cell
from floorline.measure.quality import measure_quality, prepare_quality
from floorline.models import resolve_model
from floorline.records import CellKey, CellResult, QualityKey, QualityResult

# The child's command, before the job; tests point it at a script that misbehaves.
CHILD = [sys.executable, "-m", "floorline.measure.runner"]
RESULT_TAG = "floorline-child-result "
# Long enough for a 7-8B model's load, compilation and a long prompt on a GPU; a CPU demo cell
# takes seconds.
TIMEOUT_S = 1800.0
PR_SET_PDEATHSIG = 1
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


def run_in_child(target: str, args: dict, timeout_s: float = TIMEOUT_S) -> dict:
    """`target(**args)` ("module:function", returning a JSON-able dict) in a fresh process:
    its result. ChildFailed where the child died by a signal, ran out of memory, ran past
    `timeout_s`, raised, or ended without a result; FloorlineError where it cannot start."""
    job = json.dumps({"target": target, "args": args})
    try:
        # Its own process group, so that a timeout stops whatever the child started as well.
        proc = subprocess.Popen(CHILD + [job], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True,
                                preexec_fn=die_with(os.getpid()))
    except OSError as e:  # every job would fail alike: the command stops, with one line
        raise FloorlineError(f"cannot start the measuring process {CHILD[0]}: "
                             f"{e.strerror or one_line(e)}") from None
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop(proc)
        raise ChildFailed(f"timed out after {timeout_s:g} s") from None
    except BaseException:  # Ctrl-C reaches only the parent's process group
        _stop(proc)
        raise
    for line in stdout.splitlines():
        if line.startswith(RESULT_TAG):
            out = json.loads(line[len(RESULT_TAG):])
            if "error" in out:
                raise ChildFailed(out["error"])
            return out["result"]
    raise ChildFailed(failure(proc.returncode, stderr))


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.communicate()


def run_job(job: str, key, device: str, gpu: DeviceSpec, seed: int, trust_remote_code: bool,
            timeout_s: float) -> dict:
    """`job` (a function of this module taking a key, device, gpu, seed and trust_remote_code)
    run on `key` in a fresh process; its result as a dict."""
    args = {"key": asdict(key), "device": device, "gpu": asdict(gpu), "seed": seed,
            "trust_remote_code": trust_remote_code}
    return run_in_child(f"floorline.measure.runner:{job}", args, timeout_s)


def run_cell_in_child(key: CellKey, device: str, gpu: DeviceSpec, seed: int = 0,
                      trust_remote_code: bool = False,
                      timeout_s: float = TIMEOUT_S) -> CellResult:
    """One cell measured in a fresh process (measure_cell). A cell that cannot run here is
    invalid without one; a child that fails makes an invalid cell naming the cause."""
    cell, budget = prepare_cell(key, resolve_model(key.model, trust_remote_code), device, gpu,
                                seed)
    if budget is None:
        return cell
    try:
        return CellResult.from_dict(run_job("cell_job", key, device, gpu, seed,
                                            trust_remote_code, timeout_s))
    except ChildFailed as e:
        cell.reason = f"the cell's process failed: {e.reason}"
        return cell


def cell_job(key: dict, device: str, gpu: dict, seed: int, trust_remote_code: bool) -> dict:
    """measure_cell inside the child."""
    return measure_cell(CellKey(**key), device, DeviceSpec(**gpu), seed,
                        trust_remote_code).as_dict()


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
    try:
        return QualityResult.from_dict(run_job("quality_job", key, device, gpu, seed,
                                               trust_remote_code, timeout_s))
    except ChildFailed as e:
        result.reason = f"the measurement's process failed: {e.reason}"
        return result


def quality_job(key: dict, device: str, gpu: dict, seed: int, trust_remote_code: bool) -> dict:
    """measure_quality inside the child."""
    return measure_quality(QualityKey(**key), device, DeviceSpec(**gpu), seed,
                           trust_remote_code).as_dict()


def die_with(parent: int):
    """For Popen's preexec_fn: the child, between fork and exec, has the kernel kill it when its
    parent dies (Linux's PR_SET_PDEATHSIG; a parent killed outright cannot stop it), so that no
    orphaned job holds the GPU into the next run; and exits where the parent died before that.
    None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None).prctl  # looked up here: the forked child only calls it

    def in_child() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(1)

    return in_child


def main(argv: list[str]) -> None:
    job = json.loads(argv[0])
    module, function = job["target"].split(":")
    try:
        out = {"result": getattr(importlib.import_module(module), function)(**job["args"])}
    except FloorlineError as e:  # already a sentence for the user
        out = {"error": one_line(e)}
    except Exception as e:  # reported to the parent as this job's failure
        out = {"error": ("out of memory: " if out_of_memory(e) else "") + exception_line(e)}
    print(RESULT_TAG + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
