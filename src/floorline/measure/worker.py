"""The warm worker: one process per command (a sweep, an A/B, ...) that imports torch,
floorline's measuring modules and engine, and transformers' model code once, then forks a fresh
process for each job, which so starts without the seconds a new interpreter spends importing
them. Each job still runs in a process of its own (a cell never shares one with another, nor
sees what an earlier one left in a module), in a process group of its own, and dies with the
worker, which dies with the command (PR_SET_PDEATHSIG both times).

A process that has initialised CUDA cannot fork one that uses it: the worker only imports, and
checks that torch has not initialised CUDA before it forks anything.

The sweep and the worker talk over a Unix socket: the sweep sends a job with two anonymous files
for its stdout and stderr; the worker answers with the pid of the process it forked for it, then,
once that has ended, its exit status.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import suppress
from typing import NoReturn

from floorline.measure.child import die_with, execute, start

# Linux only: elsewhere os.fork is missing, or (macOS) unsafe once the system's frameworks are
# loaded, and no kernel ties a child's life to its parent's; there each job starts a fresh
# interpreter (measure/runner.py).
FORKS = sys.platform.startswith("linux")
# What the worker imports before it forks: floorline's measuring modules (named, not imported
# at the top: they import the runner, which imports this module) and its engine, and
# transformers' model classes and caches. Llama's model imports what every transformers model
# shares (about 1.7 s on 2 cores; another family's own module then takes milliseconds), and its
# configuration, which the engine reads too.
PRELOADED = ("floorline.measure.runner", "floorline.measure.session",
             "floorline.measure.speculation", "floorline.measure.explain", "floorline.engine",
             "transformers.models.auto.modeling_auto", "transformers.cache_utils",
             "transformers.models.llama.modeling_llama")
ENDING_S = 10.0  # for a worker that closed its socket to finish exiting (its error printed)
JOB_BYTES = 1 << 20  # room for one job's message, larger than the socket lets one be


class Worker:
    """The sweep's side of a warm worker (`command` followed by its socket's descriptor),
    started at its first job."""

    def __init__(self, command: list[str]):
        self.command = command
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.log = None  # the worker's own stderr

    def run(self, job: str, timeout_s: float) -> tuple[int, str, str]:
        """`job` (runner.py's JSON) in a process the worker forks: its exit code (minus the
        signal that ended it), stdout and stderr, as Popen gives them; subprocess.TimeoutExpired
        past `timeout_s`. Where the worker itself ended, its exit code and stderr stand for the
        job's. On a timeout or any exception the job's process group is killed and the worker
        closed: the next job starts another."""
        deadline = time.monotonic() + timeout_s
        if self.proc is None:
            self._start()
        pid = None
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            try:
                socket.send_fds(self.sock, [job.encode()], [out.fileno(), err.fileno()])
                pid = self._receive(deadline)["pid"]
                returncode, log = self._receive(deadline)["status"], ""
            except (EOFError, ConnectionError):  # the worker ended, and its fork with it
                returncode, log = self.close(ended=True)
            except TimeoutError:
                self._abandon(pid)
                raise subprocess.TimeoutExpired(self.command, timeout_s) from None
            except BaseException:  # Ctrl-C reaches only the sweep's process group
                self._abandon(pid)
                raise
            return returncode, _text(out), _text(err) + log

    def close(self, ended: bool = False) -> tuple[int | None, str]:
        """Stop the worker (a job it forked dies with it): its exit code and stderr. A worker
        that `ended` the conversation itself is given ENDING_S to exit on its own first, so that
        its own exit code and error are what the job reports, not the kill that would follow."""
        if self.proc is None:
            return None, ""
        self.sock.close()
        if ended:
            with suppress(subprocess.TimeoutExpired):
                self.proc.wait(ENDING_S)
        self.proc.kill()  # nothing when it has already ended
        returncode, log = self.proc.wait(), _text(self.log)
        self.log.close()
        self.proc = self.sock = self.log = None
        return returncode, log

    def _start(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        log = tempfile.TemporaryFile()
        try:
            self.proc = start(self.command + [str(theirs.fileno())], pass_fds=[theirs.fileno()],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
        except BaseException:
            mine.close()
            log.close()
            raise
        finally:
            theirs.close()
        self.sock, self.log = mine, log

    def _receive(self, deadline: float) -> dict:
        self.sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        message = self.sock.recv(1024)
        if not message:
            raise EOFError
        return json.loads(message)

    def _abandon(self, pid: int | None) -> None:
        if pid is not None:
            with suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        self.close()


def _text(file) -> str:
    file.seek(0)
    return file.read().decode(errors="replace")


def main(argv: list[str]) -> None:
    """The worker: `python -m floorline.measure.worker FD`, FD its end of the socket. It
    imports, checks, then serves until the sweep closes its end."""
    sock = socket.socket(fileno=int(argv[0]))
    import torch  # what every job imports first, and the seconds saved

    for module in PRELOADED:
        with suppress(ImportError):  # only a head start: a job imports what it needs itself
            importlib.import_module(module)
    if torch.cuda.is_initialized():
        raise RuntimeError("the warm worker has initialised CUDA, which its forks could not use")
    # What was imported is never garbage: a fork's collections (a job releases its model with
    # two) then skip it, saving about 0.2 s each, and leave its pages shared with the worker.
    gc.freeze()
    worker = os.getpid()
    while True:
        message, fds, _, _ = socket.recv_fds(sock, JOB_BYTES, 2)
        if not message:
            return
        sys.stdout.flush()
        sys.stderr.flush()  # nothing buffered here is written again by the fork
        pid = os.fork()
        if pid == 0:
            job_process(sock, message.decode(), fds, worker)
        for fd in fds:
            os.close(fd)
        with suppress(OSError):  # as the child does: its group exists before its pid is sent
            os.setpgid(pid, pid)
        sock.send(json.dumps({"pid": pid}).encode())
        status = os.waitpid(pid, 0)[1]
        sock.send(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode())


def job_process(sock: socket.socket, job: str, fds: list[int], worker: int) -> NoReturn:
    """In the forked process: a process group of its own, killed with the worker, stdout and
    stderr into the sweep's files; the job, then exit as an interpreter would (1, with the
    traceback, on an exception the job let through)."""
    code = 1
    try:
        sock.close()
        os.setpgid(0, 0)
        die_with(worker)()
        for fd, standard in zip(fds, (1, 2)):
            os.dup2(fd, standard)
            os.close(fd)
        execute(job)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        with suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
