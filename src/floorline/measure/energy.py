"""The GPU's energy over timed steps, from NVML: its total-energy counter where the GPU has one,
else its power sampled in a background thread. The CPU's is not measured."""

from __future__ import annotations

import threading
import time

from floorline.hardware import nvml_handle

CPU_NOTE = "not measured on the CPU"
NO_READING = "not measured: the reading did not advance over the timed steps"
SAMPLE_S = 0.005  # the power sampler's period, where there is no energy counter


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


class EnergyMeter:
    """Brackets batches of timed steps (begin/end) and sums their energy and time."""

    def __init__(self, nvml, handle):
        self.nvml, self.handle = nvml, handle
        try:
            nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
            self.method = "energy counter"
        except nvml.NVMLError:
            self.method = "power sampled"
        self.joules = self.seconds = 0.0
        self.at_start: dict | None = None
        self.at_end: dict | None = None
        self._t0 = self._mj0 = None
        self._watts: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

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

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._watts.append(self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1e3)
            self._stop.wait(SAMPLE_S)

    def begin(self) -> None:
        if self.at_start is None:
            self.at_start = self._state()
        if self.method == "energy counter":
            self._mj0 = self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
        else:
            self._watts, self._stop = [], threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        self._t0 = time.perf_counter()

    def end(self) -> None:
        seconds = time.perf_counter() - self._t0
        if self.method == "energy counter":
            joules = (self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) - self._mj0) / 1e3
        else:
            self._stop.set()
            self._thread.join()
            joules = sum(self._watts) / len(self._watts) * seconds
        self.joules += joules
        self.seconds += seconds
        self.at_end = self._state()

    def result(self, tokens: int) -> dict | None:
        """Per token (one decode step at batch 1 makes one), or None where the reading is not
        positive (a counter that did not advance over too short a timing)."""
        if self.joules <= 0 or self.seconds <= 0 or tokens < 1:
            return None
        limit_mw = self._query(self.nvml.nvmlDeviceGetEnforcedPowerLimit)
        return {"joules_per_token": self.joules / tokens, "mean_watts": self.joules / self.seconds,
                "joules": self.joules, "seconds": self.seconds, "tokens": tokens,
                "power_limit_w": None if limit_mw is None else limit_mw / 1e3,
                "method": self.method, "at_start": self.at_start, "at_end": self.at_end}
