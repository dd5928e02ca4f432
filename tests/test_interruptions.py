"""What interrupted the measuring thread while steps were timed: the garbage collector's runs
and time, the scheduler's preemptions and moves, in the cell and in an unsteady cell's reason."""

import gc
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from floorline.interruptions import Interruptions, describe, scheduler_counts
from floorline.measure.steadiness import unsteady_reason
from floorline.timing import StepPlan, run_plan

LINUX = scheduler_counts() is not None


def test_a_full_collection_inside_is_counted_and_timed():
    garbage = [[i] for i in range(200_000)]  # objects for a full collection to walk
    with Interruptions() as seen:
        t0 = time.perf_counter()
        gc.collect()
        wall_ms = (time.perf_counter() - t0) * 1e3
    gc.collect()  # outside: not counted
    d = seen.details()
    assert d["gc_collections"][2] == 1 and 0 < d["longest_gc_ms"] == d["gc_ms"] <= wall_ms
    assert gc.callbacks.count(seen._on_gc) == 0  # removed on leaving
    del garbage


@pytest.mark.skipif(not LINUX or len(os.sched_getaffinity(0)) < 2,
                    reason="the scheduler's counts are Linux's; a move needs two CPUs")
def test_a_move_between_cpus_is_counted():
    cpus = sorted(os.sched_getaffinity(0))
    try:
        os.sched_setaffinity(0, {cpus[0]})
        with Interruptions() as seen:
            os.sched_setaffinity(0, {cpus[1]})  # this thread must move
            time.sleep(0.01)
    finally:
        os.sched_setaffinity(0, set(cpus))
    d = seen.details()
    assert d["migrations"] >= 1 and d["preempted"] >= 0


def test_the_timed_steps_record_their_interruptions():
    t = run_plan(lambda: gc.collect(0), "cpu", StepPlan(2, 8))
    d = t.details()["interruptions"]
    assert d["gc_collections"][0] >= 8  # every step collected the youngest generation
    assert set(d) == {"gc_collections", "gc_ms", "longest_gc_ms", "preempted", "migrations",
                      "waiting_ms", "stolen"}


def test_an_unsteady_cell_names_what_interrupted_its_steps():
    seen = {"gc_collections": [5, 1, 2], "gc_ms": 300.0, "longest_gc_ms": 250.0,
            "preempted": 12, "migrations": 3}
    # 64 steps of 100 ms: 6.4 s, of which the collector took 300 ms (5%)
    assert describe(seen, 6400.0) == (
        "Python's garbage collector ran 8 times (2 full) for 300 ms in all, 5% of the timed "
        "steps' time, the longest 250 ms; the scheduler took the measuring thread off its CPU "
        "12 times and moved it between CPUs 3 times")
    unmoved = {**seen, "gc_ms": 30.0, "migrations": 0}  # the collector under 1% of the time
    assert describe(unmoved, 6400.0) == ("the scheduler took the measuring thread off its CPU "
                                         "12 times")
    assert describe({**unmoved, "preempted": 1, "migrations": 1}, 6400.0) == (
        "the scheduler took the measuring thread off its CPU once and moved it between CPUs once")
    quiet = {**seen, "gc_ms": 30.0, "preempted": 0}  # under 1% of the time, no preemption
    assert describe(quiet, 6400.0) is None and describe(None, 6400.0) is None
    details = {"warmup_steps": 64, "timed_steps": 64, "drift": 1.3, "steady": True,
               "interruptions": seen}
    steps = {"n": 64, "median_ms": 100.0, "p10_ms": 95.0, "p90_ms": 120.0, "mean_ms": 100.0}
    reason = unsteady_reason(details, steps)
    assert "(drift 1.300, bound 0.80-1.25). While its steps were timed, Python's garbage " \
           "collector ran 8 times" in reason
    assert unsteady_reason({**details, "drift": 1.0}, steps) is None  # steady: nothing to say


def test_the_wait_for_a_cpu_and_the_hypervisors_steal_are_named_where_notable():
    seen = {"gc_collections": [0, 0, 0], "gc_ms": 0.0, "longest_gc_ms": 0.0,
            "preempted": 40, "migrations": 0, "waiting_ms": 320.0, "stolen": 0.08}
    # 64 steps of 100 ms: the thread waited 5% of the time for a CPU; 8% of the host stolen
    assert describe(seen, 6400.0) == (
        "the scheduler took the measuring thread off its CPU 40 times, where it waited 320 ms "
        "in all for a CPU; the virtual machine's hypervisor gave 8% of this host's CPU time to "
        "other machines (steal)")
    short = {**seen, "waiting_ms": 30.0, "stolen": 0.004}  # both under 1%: not named
    assert describe(short, 6400.0) == ("the scheduler took the measuring thread off its CPU "
                                       "40 times")


def schedstat_counts() -> bool:
    """Whether this kernel accounts this thread's time on a CPU (a sandbox may read zeros)."""
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[0]) > 0
    except (OSError, IndexError, ValueError):
        return False


@pytest.mark.skipif(not schedstat_counts(), reason="the kernel does not account a thread's "
                    "wait for a CPU here")
def test_a_thread_that_shares_its_cpu_waits_for_it():
    every = os.sched_getaffinity(0)
    cpu = min(every)
    # a process spinning on the one CPU this thread may use: the scheduler shares it out
    rival = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                             preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    try:
        os.sched_setaffinity(0, {cpu})
        time.sleep(0.2)  # the rival running
        with Interruptions() as seen:
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 0.4:
                pass
    finally:
        os.sched_setaffinity(0, every)
        rival.kill()
        rival.wait()
    d = seen.details()
    assert d["waiting_ms"] > 40 and d["preempted"] >= 1  # about half the 400 ms
    assert d["stolen"] is None or 0 <= d["stolen"] <= 1
