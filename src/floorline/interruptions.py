"""What interrupted the measuring thread while a cell's steps were timed: Python's garbage
collector (collections per generation and the time they took, which falls inside the step that
triggered it), and the kernel's scheduler (the times it took the thread off its CPU against the
thread's will, and the moves between CPUs). A step launched kernel by kernel from Python waits
on its host's thread, so these are the host's share of a noisy step; a cell records them with
its figures (details["interruptions"]) and an unsteady cell's reason names them.

The scheduler's counts are Linux's, of this thread (/proc/thread-self); elsewhere they are
None. A full collection walks every object the process holds, about 0.1 s with torch and
transformers loaded on a 2-core Xeon: long enough to make one step of a 7B model an outlier.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

THREAD = Path("/proc/thread-self")
# The garbage collector's share of the timed steps' time worth naming in an unsteady reason.
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


class Interruptions:
    """A context: what interrupted this thread between entering and leaving it (details())."""

    def __enter__(self) -> Interruptions:
        self.collections, self.gc_ms, self.longest_gc_ms = [0, 0, 0], 0.0, 0.0
        self._gc_start: float | None = None
        gc.callbacks.append(self._on_gc)
        self._start = scheduler_counts()
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
        end = scheduler_counts()
        self.scheduler = (None if self._start is None or end is None
                          else {k: end[k] - self._start[k] for k in end})

    def details(self) -> dict:
        return {"gc_collections": self.collections, "gc_ms": round(self.gc_ms, 3),
                "longest_gc_ms": round(self.longest_gc_ms, 3),
                "preempted": (self.scheduler or {}).get("preempted"),
                "migrations": (self.scheduler or {}).get("migrations")}


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
    if preempted:
        parts.append(f"the scheduler took the measuring thread off its CPU {preempted} times"
                     + (f" and moved it between CPUs {moved} times" if moved else ""))
    return "; ".join(parts) or None
