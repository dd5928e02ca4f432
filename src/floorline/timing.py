"""Times decode steps: warm-up (a fixed count, or until the step time is steady), then timed
steps (a fixed count, or until the median's 95% interval is narrow), each step bracketed on its
own. The measurements (measure/) and the engine's launch tuning time with these."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

from floorline.stats import median_interval

# Auto warm-up: the median of each window of steps against the window before.
WINDOW = 32
TOLERANCE = 0.01  # relative
WARMUP_CAP = 512
WARMUP_MAX_S = 5.0  # also a cap: on a busy CPU the medians may never agree
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
            rule["warmup_rule"] = {"window": WINDOW, "tolerance": TOLERANCE, "cap": self.warmup_cap,
                              "cap_s": WARMUP_MAX_S}
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

    @property
    def drift(self) -> float | None:
        return drift(self.samples_ms)

    def details(self) -> dict:
        out = {"warmup_steps": self.warmup_steps, "timed_steps": len(self.samples_ms),
               "drift": self.drift}
        if self.steady is not None:
            out["steady"] = self.steady
        if self.median_ci_ms is not None:
            out["median_ci_ms"] = list(self.median_ci_ms)
            out["width_reached"] = self.width_reached
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


def warm_up(step, device: str, cap: int) -> tuple[int, bool]:
    """Steps until the median of a window of WINDOW steps is within TOLERANCE of the window
    before, or `cap` steps, or the window that passes WARMUP_MAX_S of step time: (steps run,
    whether steady)."""
    medians, done, spent_ms = [], 0, 0.0
    while done < cap and spent_ms < WARMUP_MAX_S * 1e3:
        n = min(WINDOW, cap - done)
        window = timed_batch(step, device, n)
        medians.append(statistics.median(window))
        done, spent_ms = done + n, spent_ms + sum(window)
        if len(medians) >= 2 and abs(medians[-1] / medians[-2] - 1) <= TOLERANCE:
            return done, True
    return done, False


def sync(device: str) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_plan(step, device: str, plan: StepPlan, meter=None, energy_room: int = 0) -> Timing:
    """Warm up and time `step` as `plan` says; then, with a `meter`, read its energy over
    windows of more steps (measure/energy.py), within the positions the plan reserved and
    warm-up and timing left unused, and `energy_room` more."""
    if plan.warmup is None:
        warmup, steady = warm_up(step, device, plan.warmup_cap)
    else:
        for _ in range(plan.warmup):
            step()
        warmup, steady = plan.warmup, None
    if plan.steps is not None:
        timing = Timing(timed_batch(step, device, plan.steps), warmup, steady)
    else:
        samples = timed_batch(step, device, min(FIRST_STEPS, plan.steps_cap))
        while True:
            iv = median_interval(samples)
            reached = iv.high - iv.low <= plan.rel_width * iv.estimate
            if reached or len(samples) >= plan.steps_cap:
                break
            more = min(max(FIRST_STEPS // 2, len(samples) // 4), plan.steps_cap - len(samples))
            samples += timed_batch(step, device, more)
        timing = Timing(samples, warmup, steady, (iv.low, iv.high), reached)
    if meter:
        room = plan.most_warmup - warmup + plan.most_steps - len(timing.samples_ms) + energy_room
        timing.energy = meter.metered_windows(step, lambda: sync(device),
                                              statistics.median(timing.samples_ms) / 1e3, room)
    return timing
