"""What interrupted the measuring thread while a cell's steps were timed: Python's garbage
collector (collections per generation and the time they took, which falls inside the step that
triggered it), the kernel's scheduler (the times it took the thread off its CPU against the
thread's will, the moves between CPUs, and the time the thread was ready to run but waited for a
CPU), and a virtual machine's hypervisor (the share of the host's CPU time it gave to other
machines: steal). A step launched kernel by kernel from Python waits on its host's thread, so
these are the host's share of a noisy step; a cell records them with its figures
(details["interruptions"]) and an unsteady cell's reason names them.

The scheduler's counts are Linux's, of this thread (/proc/thread-self), and steal is Linux's
/proc/stat (zero outside a virtual machine); elsewhere they are None. A full collection walks
every object the process holds, about 0.1 s with torch and transformers loaded on a 2-core Xeon:
long enough to make one step of a 7B model an outlier.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

THREAD = Path("/proc/thread-self")
PROC_STAT = "/proc/stat"
# Fewer ticks between two reads than this (half a second of one CPU at Linux's 100 a second)
# say nothing of a share: a tick is counted whole.
MIN_TICKS = 50
# The share of the timed steps' time (the collector's, the wait for a CPU; of the host's CPU
# time for steal) worth naming in an unsteady reason.
NOTABLE = 0.01


def scheduler_counts() -> dict[str, int] | None:
    """This thread's involuntary context switches and CPU migrations so far; None where the
    kernel does not report them."""
    try:
        status = (THREAD / "status").read_text()
        sched = (THREAD / "sched").read_text()
    except OSError:
        return None
    counts = {}
    for text, key, name in ((status, "nonvoluntary_ctxt_switches", "preempted"),
                            (sched, "se.nr_migrations", "migrations")):
        for line in text.splitlines():
            field, _, value = line.partition(":")
            if field.strip() == key and value.strip().isdigit():
                counts[name] = int(value)
    return counts if len(counts) == 2 else None


def waiting_ns() -> int | None:
    """Nanoseconds this thread has spent ready to run but waiting for a CPU; None where the
    kernel does not say (schedstat: time on a CPU, time waiting, time slices)."""
    try:
        fields = (THREAD / "schedstat").read_text().split()
        return int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def cpu_ticks() -> dict | None:
    """/proc/stat's aggregate CPU line as total, idle (idle + iowait) and steal ticks; None
    where there is no such file (not Linux) or it cannot be read."""
    try:
        with open(PROC_STAT) as f:
            fields = f.readline().split()
        if not fields or fields[0] != "cpu":
            return None
        # user nice system idle iowait irq softirq steal [guest guest_nice: within user, nice]
        v = [int(x) for x in fields[1:9]] + [0] * max(0, 9 - len(fields))
    except (OSError, ValueError):
        return None
    return {"total": sum(v), "idle": v[3] + v[4], "steal": v[7]}


class Interruptions:
    """A context: what interrupted this thread between entering and leaving it (details())."""

    def __enter__(self) -> Interruptions:
        self.collections, self.gc_ms, self.longest_gc_ms = [0, 0, 0], 0.0, 0.0
        self._gc_start: float | None = None
        gc.callbacks.append(self._on_gc)
        self._start = scheduler_counts()
        self._waiting, self._ticks = waiting_ns(), cpu_ticks()
        return self

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            ms = (time.perf_counter() - self._gc_start) * 1e3
            self._gc_start = None
            self.collections[info["generation"]] += 1
            self.gc_ms += ms
            self.longest_gc_ms = max(self.longest_gc_ms, ms)

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._on_gc)
        end, waiting, ticks = scheduler_counts(), waiting_ns(), cpu_ticks()
        self.scheduler = (None if self._start is None or end is None
                          else {k: end[k] - self._start[k] for k in end})
        self.waiting_ms = (None if None in (waiting, self._waiting)
                           else (waiting - self._waiting) / 1e6)
        total = None if None in (ticks, self._ticks) else ticks["total"] - self._ticks["total"]
        self.stolen = (None if total is None or total < MIN_TICKS
                       else (ticks["steal"] - self._ticks["steal"]) / total)

    def details(self) -> dict:
        return {"gc_collections": self.collections, "gc_ms": round(self.gc_ms, 3),
                "longest_gc_ms": round(self.longest_gc_ms, 3),
                "preempted": (self.scheduler or {}).get("preempted"),
                "migrations": (self.scheduler or {}).get("migrations"),
                "waiting_ms": None if self.waiting_ms is None else round(self.waiting_ms, 3),
                "stolen": None if self.stolen is None else round(self.stolen, 4)}


def times(n: int) -> str:
    return "once" if n == 1 else f"{n} times"


def describe(interruptions: dict | None, timed_ms: float) -> str | None:
    """The interruptions that took a share of the timed steps worth naming, in a few words, for
    an unsteady cell's reason; None where there were none to speak of (`timed_ms`: the steps'
    total time)."""
    if not interruptions:
        return None
    parts = []
    full, gc_ms = interruptions["gc_collections"][2], interruptions["gc_ms"]
    if gc_ms and timed_ms and gc_ms / timed_ms >= NOTABLE:
        parts.append(f"Python's garbage collector ran {sum(interruptions['gc_collections'])} "
                     f"times ({full} full) for {gc_ms:.0f} ms in all, "
                     f"{gc_ms / timed_ms:.0%} of the timed steps' time, the longest "
                     f"{interruptions['longest_gc_ms']:.0f} ms")
    preempted, moved = interruptions.get("preempted"), interruptions.get("migrations")
    waiting = interruptions.get("waiting_ms")
    if preempted:
        waited = (f", where it waited {waiting:.0f} ms in all for a CPU"
                  if waiting and timed_ms and waiting / timed_ms >= NOTABLE else "")
        parts.append(f"the scheduler took the measuring thread off its CPU {times(preempted)}"
                     + (f" and moved it between CPUs {times(moved)}" if moved else "") + waited)
    stolen = interruptions.get("stolen")
    if stolen and stolen >= NOTABLE:
        parts.append(f"the virtual machine's hypervisor gave {stolen:.0%} of this host's CPU "
                     f"time to other machines (steal)")
    return "; ".join(parts) or None
