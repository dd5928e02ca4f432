"""A job's own process: how it is started so that it dies with its parent, and what it does: call
the job's function and print its JSON-able result on one tagged line (measure/runner.py reads
it). The process is a fresh interpreter, or a fork of the warm worker (measure/worker.py)."""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import signal
import subprocess
import sys

from floorline.errors import FloorlineError, exception_line, one_line, out_of_memory

RESULT_TAG = "floorline-child-result "
PR_SET_PDEATHSIG = 1


def execute(job: str) -> None:
    """Run `job` ({"target": "module:function", "args": {...}}) and print its result, or the
    error that stopped it, on the tagged line."""
    job = json.loads(job)
    module, function = job["target"].split(":")
    try:
        out = {"result": getattr(importlib.import_module(module), function)(**job["args"])}
    except FloorlineError as e:  # already a sentence for the user
        out = {"error": one_line(e)}
    except Exception as e:  # reported to the parent as this job's failure
        out = {"error": ("out of memory: " if out_of_memory(e) else "") + exception_line(e)}
    print(RESULT_TAG + json.dumps(out), flush=True)


def start(command: list[str], **popen) -> subprocess.Popen:
    """`command` started in a process group of its own (so that a timeout stops whatever it
    starts as well) that dies with this process; one line where it cannot start, since every
    job would fail alike."""
    try:
        return subprocess.Popen(command, start_new_session=True, preexec_fn=die_with(os.getpid()),
                                **popen)
    except OSError as e:
        raise FloorlineError(f"cannot start the measuring process {command[0]}: "
                             f"{e.strerror or one_line(e)}") from None


def die_with(parent: int):
    """For Popen's preexec_fn, or a forked child: the child, between fork and exec, has the kernel
    kill it when its parent dies (Linux's PR_SET_PDEATHSIG; a parent killed outright cannot stop
    it), so that no orphaned job holds the GPU into the next run; and exits where the parent died
    before that. None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None).prctl  # looked up here: the forked child only calls it

    def in_child() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(1)

    return in_child
