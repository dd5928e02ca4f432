"""The CPU's steadiness: other processes' share of the host's CPU time while a cell's steps
ran, beyond what its threads left free, makes it unsteady (measure/host.py,
measure/steadiness.py); the GPU's bounds are tests/test_steadiness.py's."""

import os

from floorline.measure import host
from floorline.measure.steadiness import MAX_OTHERS, unsteady_reason

STEADY = {"warmup_steps": 64, "timed_steps": 64, "drift": 1.0, "steady": True}
SUMMARY = {"n": 64, "median_ms": 20.0, "p10_ms": 19.5, "p90_ms": 21.0}


def test_others_share_is_the_busy_time_less_this_process():
    hz = os.sysconf("SC_CLK_TCK")
    start = {"total": 1000, "idle": 400, "steal": 0, "own_s": 1.0}
    # 400 ticks over both CPUs: 300 busy, of which this process 1 s (hz ticks: 100 at 100 Hz)
    end = {"total": 1400, "idle": 500, "steal": 0, "own_s": 1.0 + 100 / hz}
    assert host.others_share(start, end) == 0.5
    assert host.others_share(start, {**end, "own_s": 1.0 + 300 / hz}) == 0.0
    assert host.others_share(None, end) is None and host.others_share(start, start) is None
    now = host.cpu_use()
    assert now is None or now["own_s"] > 0


def test_a_cell_whose_cores_others_took_is_unsteady():
    assert unsteady_reason({**STEADY, "others_cpu": 0.02, "spare_cpu": 0.0}, SUMMARY) is None
    busy = {**STEADY, "others_cpu": 0.48, "spare_cpu": 0.0}
    reason = unsteady_reason(busy, SUMMARY)
    assert "other processes took 48% of the host's CPU time while its steps ran " \
           f"(bound {MAX_OTHERS:.0%})" in reason
    # one thread of two: the other core is free for others
    assert unsteady_reason({**busy, "spare_cpu": 0.5}, SUMMARY) is None
    assert "the 50% its threads left free" in unsteady_reason(
        {**busy, "others_cpu": 0.75, "spare_cpu": 0.5}, SUMMARY)


def test_the_spare_share_is_the_cores_the_threads_leave():
    cpus = os.cpu_count()
    assert host.spare_share(cpus) == 0.0 and host.spare_share(cpus + 4) == 0.0
    assert host.spare_share(0) == 1.0
