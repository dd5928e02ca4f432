"""Times decode steps: warm-up (a fixed count, or until the step time is steady), then timed
steps (a fixed count, or until the median's 95% interval is narrow), each step bracketed on its
own. The measurements (measure/) and the engine's launch tuning time with these."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

from floorline.interruptions import Interruptions
from floorline.stats import block_median_interval

# Auto warm-up: the median of each window of steps against the window before. Two windows agree
# where their medians differ by no more than their own noise: twice the standard error of the
# difference of the two medians, each estimated from its window's interquartile range, at least
# TOLERANCE and at most MAX_TOLERANCE. A step whose kernels the GPU runs back to back varies by
# well under 1% from one window to the next, so for it the rule is 1%. A step launched kernel by
# kernel from Python times the host as much as the GPU: on a shared host its p10-p90 spans 5-66%
# of its median (the H200 study's hf-eager and hf-static cells), on the CPU 5-25% (the demo's
# cells), and its windows' medians differ by more than 1% with no trend at all; held to 1%, such
# a path was never steady (the H200's and the H100's hf-eager at the study's headline cell).
WINDOW = 32
TOLERANCE = 0.01  # relative
MAX_TOLERANCE = 0.05  # a change beyond this is a trend, however noisy the steps
WARMUP_CAP = 512
# Also a cap: on a busy host the medians may never agree. It ends the warm-up only once
# MIN_WINDOWS windows have run, so that a slow step (a 7B model's eager step takes 50-70 ms, 32
# of them 2 s) gets more than one comparison.
WARMUP_MAX_S = 5.0
MIN_WINDOWS = 4
# On the CPU the windows are sized in time, the steps that fill CPU_WINDOW_S (at least
# CPU_MIN_WINDOW, at most WINDOW), so that a slow step does not spend the warm-up on few windows.
CPU_WINDOW_S = 0.5
CPU_MIN_WINDOW = 8
# Auto steps: at least this many, then about a quarter more at a time, up to the cap.
FIRST_STEPS = 32
STEPS_CAP = 2048
REL_WIDTH = 0.01  # the default relative width of the median's 95% interval


@dataclass(frozen=True)
class StepPlan:
    """How many steps to warm up and to time: a count, or None for automatic."""
    warmup: int | None = None
    steps: int | None = 64
    rel_width: float = REL_WIDTH
    warmup_cap: int = WARMUP_CAP
    steps_cap: int = STEPS_CAP

    @property
    def most_warmup(self) -> int:
        return self.warmup_cap if self.warmup is None else self.warmup

    @property
    def most_steps(self) -> int:
        return self.steps_cap if self.steps is None else self.steps

    def within(self, room: int) -> StepPlan:
        """The plan with its automatic parts' caps cut, in proportion, so that warm-up and
        timing take at most `room` steps (not below two windows of warm-up and the first batch
        of timing; a fixed count is never cut)."""
        auto = ((self.warmup_cap if self.warmup is None else 0)
                + (self.steps_cap if self.steps is None else 0))
        fixed = self.most_warmup + self.most_steps - auto
        if auto == 0 or room >= fixed + auto:
            return self
        scale = max(room - fixed, 0) / auto
        return replace(self, warmup_cap=max(2 * WINDOW, int(self.warmup_cap * scale)),
                       steps_cap=max(FIRST_STEPS, int(self.steps_cap * scale)))

    def describe(self) -> dict:
        """The rule, for a cell's details."""
        rule = {}
        if self.warmup is None:
            rule["warmup_rule"] = {"window": WINDOW, "tolerance": TOLERANCE,
                                   "max_tolerance": MAX_TOLERANCE, "cap": self.warmup_cap,
                                   "cap_s": WARMUP_MAX_S, "min_windows": MIN_WINDOWS}
        if self.steps is None:
            rule["steps_rule"] = {"rel_width": self.rel_width, "confidence": 0.95,
                             "cap": self.steps_cap}
        return rule


@dataclass
class Timing:
    samples_ms: list[float]
    warmup_steps: int
    steady: bool | None = None  # auto warm-up: whether it settled before its cap
    median_ci_ms: tuple[float, float] | None = None  # auto steps: the interval reached
    width_reached: bool | None = None  # auto steps: whether before the cap
    energy: dict | None = None
    tolerance: float | None = None  # auto warm-up: its last comparison's, from the noise
    window_s: float | None = None  # auto warm-up on the CPU: its windows' length in time
    interruptions: dict | None = None  # of the measuring thread while timing (interruptions.py)

    @property
    def drift(self) -> float | None:
        return drift(self.samples_ms)

    def details(self) -> dict:
        out = {"warmup_steps": self.warmup_steps, "timed_steps": len(self.samples_ms),
               "drift": self.drift, "drift_noise": drift_noise(self.samples_ms)}
        if self.steady is not None:
            out["steady"] = self.steady
        if self.tolerance is not None:
            out["warmup_tolerance"] = round(self.tolerance, 5)
        if self.window_s is not None:
            out["warmup_window_s"] = self.window_s
        if self.median_ci_ms is not None:
            out["median_ci_ms"] = list(self.median_ci_ms)
            out["width_reached"] = self.width_reached
        if self.interruptions is not None:
            out["interruptions"] = self.interruptions
        return out


def l2_bytes(device: str) -> int:
    """The device's L2 cache: what a timing loop must overflow to read from memory."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).L2_cache_size
    return 64 * 2**20  # generous for a CPU's last-level cache


def rotation_copies(nbytes: int, device: str, budget: int | None = None,
                    least: int = 1) -> int:
    """Copies of an `nbytes` buffer that together hold more than four times the L2 cache, so
    that a loop cycling through them reads memory the passes before left out of L2: at least
    `least`, within `budget` bytes where one is given."""
    copies = 4 * l2_bytes(str(device)) // nbytes + 1
    if budget is not None:
        copies = min(copies, budget // nbytes)
    return max(least, copies)


def drift(samples_ms) -> float | None:
    """Median of the last quarter of the timed steps over that of the first; None under 4."""
    q = len(samples_ms) // 4
    if q == 0:
        return None
    return statistics.median(samples_ms[-q:]) / statistics.median(samples_ms[:q])


def drift_noise(samples_ms) -> float | None:
    """How far from 1 the drift may stray by the steps' own noise alone: twice the standard
    error of the ratio of the two quarters' medians, each error read from its quarter's block
    bootstrap interval (stats.block_median_interval: a host slow for a while at a time makes
    it wider); None under 16 steps."""
    q = len(samples_ms) // 4
    if q < 4:
        return None
    errors = []
    for quarter in (samples_ms[:q], samples_ms[-q:]):
        iv = block_median_interval(quarter)
        errors.append((iv.high - iv.low) / (2 * 1.96) / iv.estimate)
    return 2 * (errors[0] ** 2 + errors[1] ** 2) ** 0.5


def timed_batch(step, device: str, steps: int, meter=None) -> list[float]:
    """Milliseconds of each of `steps` calls of `step`. On CUDA each step sits between two
    events on the current stream, so a step's time is what the GPU saw, idle gaps from a slow
    host included; the host synchronises once at the end. On the CPU the work is synchronous
    and a host clock brackets each step. `meter` (energy) brackets the batch."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
        marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                 for _ in range(steps)]
        if meter:
            meter.begin()
        for start, end in marks:
            start.record()
            step()
            end.record()
        torch.cuda.synchronize()
        if meter:
            meter.end()
        return [start.elapsed_time(end) for start, end in marks]
    samples = []
    if meter:
        meter.begin()
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        samples.append((time.perf_counter() - t0) * 1e3)
    if meter:
        meter.end()
    return samples


def time_steps(step, device: str, steps: int, warmup: int) -> list[float]:
    """Milliseconds of each of `steps` calls of `step` after `warmup` untimed ones."""
    for _ in range(warmup):
        step()
    return timed_batch(step, device, steps)


def median_error(window: list[float]) -> float:
    """The standard error of a window's median relative to it, from its interquartile range
    (a normal's sigma is IQR / 1.349, a median's error 1.2533 sigma / sqrt(n))."""
    q1, _, q3 = statistics.quantiles(window, n=4)
    return 1.2533 * (q3 - q1) / 1.349 / len(window) ** 0.5 / statistics.median(window)


def agreement_tolerance(window: list[float], before: list[float]) -> float:
    """How close two windows' medians must be to call the step steady: within their own noise,
    at least TOLERANCE and at most MAX_TOLERANCE (the rule at WINDOW)."""
    noise = 2 * (median_error(window) ** 2 + median_error(before) ** 2) ** 0.5
    return min(MAX_TOLERANCE, max(TOLERANCE, noise))


def warm_up(step, device: str, cap: int) -> tuple[int, bool, float | None]:
    """Steps until the median of a window is within its tolerance of the window before
    (agreement_tolerance: windows of WINDOW steps on a GPU, of CPU_WINDOW_S on the CPU), or
    `cap` steps, or the window that passes WARMUP_MAX_S of step time once MIN_WINDOWS have run:
    (steps run, whether steady, the last comparison's tolerance)."""
    cpu = not device.startswith("cuda")
    windows, done, spent_ms, tolerance = [], 0, 0.0, None
    while done < cap and (spent_ms < WARMUP_MAX_S * 1e3 or len(windows) < MIN_WINDOWS):
        if cpu:
            window = []
            while done + len(window) < cap and len(window) < WINDOW and (
                    len(window) < CPU_MIN_WINDOW or sum(window) < CPU_WINDOW_S * 1e3):
                window += timed_batch(step, device, 1)
        else:
            window = timed_batch(step, device, min(WINDOW, cap - done))
        windows.append(window)
        done, spent_ms = done + len(window), spent_ms + sum(window)
        # (a window cut short by the cap, under 4 steps, has no quartiles to compare)
        if len(windows) >= 2 and min(len(window), len(windows[-2])) >= 4:
            tolerance = agreement_tolerance(window, windows[-2])
            change = statistics.median(window) / statistics.median(windows[-2]) - 1
            if abs(change) <= tolerance:
                return done, True, tolerance
    return done, False, tolerance


def sync(device: str) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_plan(step, device: str, plan: StepPlan, meter=None, energy_room: int = 0) -> Timing:
    """Warm up and time `step` as `plan` says; then, with a `meter`, read its energy over
    windows of more steps (measure/energy.py), within the positions the plan reserved and
    warm-up and timing left unused, and `energy_room` more."""
    tolerance, window_s = None, None
    if plan.warmup is None:
        warmup, steady, tolerance = warm_up(step, device, plan.warmup_cap)
        window_s = None if device.startswith("cuda") else CPU_WINDOW_S
    else:
        for _ in range(plan.warmup):
            step()
        warmup, steady = plan.warmup, None
    with Interruptions() as interrupted:
        if plan.steps is not None:
            timing = Timing(timed_batch(step, device, plan.steps), warmup, steady,
                            tolerance=tolerance, window_s=window_s)
        else:
            samples = timed_batch(step, device, min(FIRST_STEPS, plan.steps_cap))
            while True:
                iv = block_median_interval(samples)
                reached = iv.high - iv.low <= plan.rel_width * iv.estimate
                if reached or len(samples) >= plan.steps_cap:
                    break
                more = min(max(FIRST_STEPS // 2, len(samples) // 4),
                           plan.steps_cap - len(samples))
                samples += timed_batch(step, device, more)
            timing = Timing(samples, warmup, steady, (iv.low, iv.high), reached,
                            tolerance=tolerance, window_s=window_s)
    timing.interruptions = interrupted.details()
    if meter:
        room = plan.most_warmup - warmup + plan.most_steps - len(timing.samples_ms) + energy_room
        timing.energy = meter.metered_windows(step, lambda: sync(device),
                                              statistics.median(timing.samples_ms) / 1e3, room)
    return timing
