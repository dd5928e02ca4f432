"""The GPU's energy per token, from NVML, with the reading's error bounded and checked.

A background reader watches the GPU's total-energy counter (every POLL_S) and its power reading
(every SAMPLE_S) while the meter is on, keeping each change of the counter with its time. The
counter advances in steps, every few tens of milliseconds, so a reading taken at an arbitrary
moment is stale by up to that period. A cell's energy is therefore read over windows that
start and end on the counter's own updates (metered_windows): the window opens at an update,
runs its steps, then runs one step at a time until the next update closes it; the tokens are
the steps finished by then. What remains of the error is the reader's polling and the step
in flight at each end, and each window is made long enough that this is under ERROR_TARGET.

A reading is not valid (kept, with the reason) where its bound is not under ERROR_TARGET, where
its mean power is above the GPU's enforced power limit by more than LIMIT_TOLERANCE, or where the
power readings taken inside the window disagree with the counter by more than SAMPLES_TOLERANCE.
Energy per token is the mean over WINDOWS windows, with a 95% interval over them.

Where the GPU has no counter, power is sampled instead; the CPU's energy is not measured.
"""

from __future__ import annotations

import math
import statistics
import threading
import time

from floorline.hardware import nvml_handle

CPU_NOTE = "not measured on the CPU"
NO_READING = "not measured: the reading did not advance over the timed steps"
POLL_S = 0.001  # the reader's period for the counter
SAMPLE_S = 0.02  # ... and for the power reading
CHARACTERISE_S = 1.0  # at most this long to see the counter's updates when the meter opens
WAIT_S = 2.0  # the longest wait for an update before a window's edge
WINDOWS = 3
WINDOW_MIN_S = 2.0  # also lets a one-second power average fall inside a window
WINDOW_MAX_S = 20.0
ERROR_TARGET = 0.01
LIMIT_TOLERANCE = 0.05
SAMPLES_TOLERANCE = 0.10
POWER_AVERAGE_S = 1.0  # recent GPUs report power averaged over the second before the reading
POSITIONS_CAP = 16384  # cache positions a cell reserves for its energy windows, at most


def positions_wanted(floor_ms: float) -> int:
    """The most steps a cell's energy windows may take: no step is faster than its floor."""
    return min(POSITIONS_CAP, math.ceil(WINDOWS * 1.2 * WINDOW_MIN_S / (floor_ms / 1e3)))


def open_meter(device: str):
    """(a meter for `device`, None) or (None, why energy is not measured)."""
    if not device.startswith("cuda"):
        return None, CPU_NOTE
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()
        index = torch.device(device).index
        index = torch.cuda.current_device() if index is None else index
        return EnergyMeter(pynvml, nvml_handle(pynvml, index)), None
    except Exception as e:  # no NVML library, or a driver that cannot answer
        return None, f"not measured: NVML unavailable ({type(e).__name__}: {e})"


class Reader:
    """Reads the counter and the power in a thread: `changes` [(time, mJ)] holds the first
    reading and every change after it, `watts` [(time, W)] every power reading."""

    def __init__(self, meter: EnergyMeter):
        self.meter = meter
        self.changes: list[tuple[float, int]] = []
        self.watts: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        m, next_sample = self.meter, 0.0
        while not self._stop.is_set():
            now = time.perf_counter()
            if m.counter:
                mj = m.nvml.nvmlDeviceGetTotalEnergyConsumption(m.handle)
                if not self.changes or mj != self.changes[-1][1]:
                    self.changes.append((now, mj))
            if now >= next_sample:
                self.watts.append((now, m.nvml.nvmlDeviceGetPowerUsage(m.handle) / 1e3))
                next_sample = now + SAMPLE_S
            self._stop.wait(POLL_S if m.counter else SAMPLE_S)

    def update_after(self, t: float, timeout_s: float = WAIT_S) -> tuple[float, int] | None:
        """The first update of the counter after time `t`, waiting for it; None where none
        comes within `timeout_s`."""
        give_up = time.perf_counter() + timeout_s
        while True:
            later = [c for c in self.changes[-8:] if c[0] > t]
            if later:
                return later[0]
            if time.perf_counter() > give_up:
                return None
            time.sleep(POLL_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def energy_between(changes: list[tuple[float, int]], a: float, b: float) -> float | None:
    """Joules spent from time `a` to `b`, the counter taken as linear between its updates;
    None where the updates do not span [a, b]."""
    if len(changes) < 2 or changes[0][0] > a or changes[-1][0] < b:
        return None

    def at(t):
        for (t0, e0), (t1, e1) in zip(changes, changes[1:]):
            if t0 <= t <= t1:
                return e0 + (e1 - e0) * (t - t0) / (t1 - t0)
        return changes[-1][1]

    return (at(b) - at(a)) / 1e3


def counter_period(changes: list[tuple[float, int]]) -> dict:
    """The counter's update period (median time between changes) and resolution (the smallest
    step it took), from a reader's changes."""
    gaps = [t1 - t0 for (t0, _), (t1, _) in zip(changes[1:], changes[2:])]  # the first is partial
    steps = [e1 - e0 for (_, e0), (_, e1) in zip(changes, changes[1:]) if e1 > e0]
    return {"update_period_ms": statistics.median(gaps) * 1e3 if gaps else None,
            "resolution_mj": min(steps) if steps else None, "updates_seen": len(changes) - 1}


class EnergyMeter:
    """Either brackets batches of steps (begin/end, summed; an A/B experiment's arms), or reads
    whole windows aligned on the counter's updates (metered_windows; a cell)."""

    def __init__(self, nvml, handle):
        self.nvml, self.handle = nvml, handle
        try:
            nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
            self.counter = True
        except nvml.NVMLError:
            self.counter = False
        self.method = "energy counter" if self.counter else "power sampled"
        self.at_start: dict | None = None
        self.at_end: dict | None = None
        self.reader: Reader | None = None
        self.brackets: list[tuple[float, float]] = []

    def _query(self, fn, *args):
        """One reading, or None where this GPU or driver does not report it."""
        try:
            return fn(self.handle, *args)
        except self.nvml.NVMLError:
            return None

    def _state(self) -> dict:
        n = self.nvml
        return {"sm_clock_mhz": self._query(n.nvmlDeviceGetClockInfo, n.NVML_CLOCK_SM),
                "temperature_c": self._query(n.nvmlDeviceGetTemperature, n.NVML_TEMPERATURE_GPU)}

    def _start(self) -> Reader:
        if self.reader is None:
            self.at_start = self._state()
            self.reader = Reader(self)
        return self.reader

    def _limit_w(self) -> float | None:
        limit_mw = self._query(self.nvml.nvmlDeviceGetEnforcedPowerLimit)
        return None if limit_mw is None else limit_mw / 1e3

    def characterise(self) -> dict:
        """The counter's update period and resolution, watched for up to CHARACTERISE_S (until
        six updates); empty without a counter."""
        if not self.counter:
            return {}
        reader = self._start()
        give_up = time.perf_counter() + CHARACTERISE_S
        while len(reader.changes) < 7 and time.perf_counter() < give_up:
            time.sleep(POLL_S)
        return counter_period(reader.changes)

    # Brackets: an A/B experiment's arms, each the sum of its blocks of steps.

    def begin(self) -> None:
        if self.reader is None:
            self.characterise()  # the period the result's bound needs
        self.brackets.append((time.perf_counter(), math.nan))

    def end(self) -> None:
        t0, _ = self.brackets[-1]
        self.brackets[-1] = (t0, time.perf_counter())
        self.at_end = self._state()

    def result(self, tokens: int) -> dict | None:
        """The brackets' energy per token with its checks, or None where the reading did not
        advance. Each bracket's edges fall between the counter's updates and are interpolated:
        the bound takes each edge as off by up to half an update period of the mean power."""
        reader = self.reader
        if reader is None or tokens < 1 or not self.brackets:
            return None
        seconds = sum(t1 - t0 for t0, t1 in self.brackets)
        if self.counter:
            reader.update_after(self.brackets[-1][1])
            reader.stop()
            parts = [energy_between(reader.changes, t0, t1) for t0, t1 in self.brackets]
            if None in parts:
                return None
            joules = sum(parts)
            period = counter_period(reader.changes)
            p = period["update_period_ms"]
            bound = (math.inf if p is None or seconds <= 0
                     else len(self.brackets) * p / 1e3 / 2 / seconds)
        else:
            reader.stop()
            inside = [w for t, w in reader.watts
                      if any(t0 <= t <= t1 for t0, t1 in self.brackets)]
            if not inside:
                return None
            joules, period = statistics.fmean(inside) * seconds, {}
            bound = None
        if joules <= 0 or seconds <= 0:
            return None
        reading = {"joules": joules, "seconds": seconds, "tokens": tokens,
                   "joules_per_token": joules / tokens, "mean_watts": joules / seconds,
                   "error_bound": bound}
        return self._checked(reading, [], period)

    # Windows: a cell's energy, after its timing.

    def metered_windows(self, step, sync, step_s: float, room: int) -> dict | None:
        """Energy per token over WINDOWS windows of `step` (one decode step; `sync` waits for
        the device; `step_s` the step's median time), each opened and closed on an update of
        the counter, using at most `room` steps in all. None where nothing could be read."""
        period = self.characterise()
        if not self.counter:
            return self._sampled_windows(step, sync, step_s, room)
        if not period.get("update_period_ms"):
            return None
        reader = self.reader
        # The bound of one window: the reader's lag at each edge and the step in flight at the
        # close, against the window's length. Windows are WINDOW_MIN_S long where the room
        # allows, shorter (down to what the bound needs) where it does not.
        edge_s = 2 * POLL_S + step_s
        tail = math.ceil(2 * period["update_period_ms"] / 1e3 / step_s) + 1
        window_s = min(max(WINDOW_MIN_S, edge_s / ERROR_TARGET), WINDOW_MAX_S)
        least = math.ceil(edge_s / ERROR_TARGET / step_s)
        steps = max(1, min(math.ceil(window_s / step_s), room // WINDOWS - tail), least)
        windows = []
        while len(windows) < WINDOWS and room >= steps + tail:
            sync()
            opened = reader.update_after(time.perf_counter())
            if opened is None:
                break
            for _ in range(steps):
                step()
            sync()
            done, closed = steps, None
            last = time.perf_counter()
            while done < steps + tail and (closed := reader.update_after(last, 0)) is None:
                step()
                sync()
                done += 1
            room -= done
            if closed is None:
                break
            joules = (closed[1] - opened[1]) / 1e3
            seconds = closed[0] - opened[0]
            windows.append({"joules": joules, "seconds": seconds, "tokens": done,
                            "joules_per_token": joules / done, "mean_watts": joules / seconds,
                            "error_bound": edge_s / seconds,
                            "sampled_watts": _sampled(reader.watts, opened[0], closed[0])})
        reader.stop()
        self.at_end = self._state()
        if not windows:
            return None
        return self._checked(_pooled(windows), windows, period)

    def _sampled_windows(self, step, sync, step_s: float, room: int) -> dict | None:
        """Without a counter: power sampled over windows long enough to hold a whole average."""
        reader = self._start()
        steps = max(1, math.ceil(WINDOW_MIN_S / step_s))
        windows = []
        while len(windows) < WINDOWS and room >= steps:
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            sync()
            t1 = time.perf_counter()
            room -= steps
            watts = _sampled(reader.watts, t0, t1)
            if watts is None:
                continue
            joules = watts * (t1 - t0)
            windows.append({"joules": joules, "seconds": t1 - t0, "tokens": steps,
                            "joules_per_token": joules / steps, "mean_watts": watts,
                            "error_bound": None, "sampled_watts": watts})
        reader.stop()
        self.at_end = self._state()
        if not windows:
            return None
        return self._checked(_pooled(windows), windows, {})

    def _checked(self, reading: dict, windows: list[dict], period: dict) -> dict:
        """The reading with its method, limit, counter facts, interval over windows, and its
        validity (not valid: the reason)."""
        limit = self._limit_w()
        out = {**reading, "method": self.method, "power_limit_w": limit, "counter": period,
               "windows": windows, "at_start": self.at_start, "at_end": self.at_end,
               **per_token_interval(windows)}
        out["reason"] = energy_problem(out)
        out["valid"] = out["reason"] is None
        return out


def _sampled(watts: list[tuple[float, float]], t0: float, t1: float) -> float | None:
    """The mean power reading taken wholly inside [t0, t1] (a reading averages the second
    before it); None where there is none."""
    inside = [w for t, w in watts if t0 + POWER_AVERAGE_S <= t <= t1]
    return statistics.fmean(inside) if inside else None


def _pooled(windows: list[dict]) -> dict:
    joules = sum(w["joules"] for w in windows)
    seconds = sum(w["seconds"] for w in windows)
    tokens = sum(w["tokens"] for w in windows)
    bounds = [w["error_bound"] for w in windows]
    sampled = [w["sampled_watts"] for w in windows if w["sampled_watts"] is not None]
    return {"joules": joules, "seconds": seconds, "tokens": tokens,
            "joules_per_token": joules / tokens, "mean_watts": joules / seconds,
            "error_bound": None if None in bounds else max(bounds),
            "sampled_watts": statistics.fmean(sampled) if sampled else None}


def per_token_interval(windows: list[dict]) -> dict:
    """The mean of the windows' J/token with a Student-t 95% interval; none under two windows."""
    if len(windows) < 2:
        return {}
    from scipy.stats import t

    values = [w["joules_per_token"] for w in windows]
    mean, sd = statistics.fmean(values), statistics.stdev(values)
    half = t.ppf(0.975, len(values) - 1) * sd / math.sqrt(len(values))
    return {"joules_per_token_low": mean - half, "joules_per_token_high": mean + half}


def energy_problem(e: dict) -> str | None:
    """Why an energy reading is not valid, or None. A reading stored before floorline bounded
    the reading's error (it has no bound) is not valid either: its error is not known."""
    limit, watts = e.get("power_limit_w"), e.get("mean_watts")
    if limit and watts and watts > limit * (1 + LIMIT_TOLERANCE):
        return (f"mean power {watts:.0f} W is above the GPU's {limit:.0f} W limit (more than "
                f"{LIMIT_TOLERANCE:.0%} over): the reading is wrong")
    if "error_bound" not in e:
        return ("read before floorline bounded the reading's error (a counter that updates "
                "every 100 ms, read over a second, can be 10% off): its error is not known")
    bound = e.get("error_bound")
    if bound is not None and bound >= ERROR_TARGET:
        return (f"the reading's error could be {bound:.1%} (the counter updates every "
                f"{(e.get('counter') or {}).get('update_period_ms') or 0:.0f} ms over "
                f"{e.get('seconds', 0):.2f} s metered): meter longer")
    sampled = e.get("sampled_watts")
    if e.get("method") == "energy counter" and sampled and watts:
        if abs(watts / sampled - 1) > SAMPLES_TOLERANCE:
            return (f"the counter's mean power {watts:.0f} W disagrees with the power readings' "
                    f"{sampled:.0f} W by more than {SAMPLES_TOLERANCE:.0%}")
    return None
