"""The environment a cell was measured in. Cells are comparable when their keys match."""

from __future__ import annotations

import hashlib
import json
import platform

import floorline
from floorline.hardware import nvml_handle

# What must match for a stored cell to count as already measured; clocks are only recorded.
KEY_FIELDS = ("device", "driver", "cuda", "torch", "transformers", "floorline")


def _nvml_handle(device: str):
    import pynvml
    import torch

    pynvml.nvmlInit()
    return pynvml, nvml_handle(pynvml, torch.device(device).index or 0)


def clocks(device: str) -> dict:
    """SM and memory clocks now and at most, MHz; empty where NVML cannot read them."""
    if not device.startswith("cuda"):
        return {}
    try:
        nvml, h = _nvml_handle(device)
        return {
            f"{kind}_{which}_mhz": fn(h, clock)
            for kind, clock in (("sm", nvml.NVML_CLOCK_SM), ("mem", nvml.NVML_CLOCK_MEM))
            for which, fn in (("clock", nvml.nvmlDeviceGetClockInfo),
                              ("max", nvml.nvmlDeviceGetMaxClockInfo))
        }
    except Exception:  # no NVML, or a driver too old for a query
        return {}


def _driver(device: str) -> str | None:
    try:
        nvml, _ = _nvml_handle(device)
        return nvml.nvmlSystemGetDriverVersion()
    except Exception:
        return None


def environment(device: str) -> dict:
    import torch
    import transformers

    env = {
        "floorline": floorline.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
    }
    if device.startswith("cuda"):
        env["device"] = torch.cuda.get_device_name(torch.device(device).index or 0)
        env["driver"] = _driver(device)
    else:
        env.update(device=f"cpu: {platform.processor() or platform.machine()}", driver=None,
                   cuda=None)
    env["clocks_at_start"] = clocks(device)
    return env


def fingerprint_key(env: dict) -> str:
    stable = {k: env.get(k) for k in KEY_FIELDS}
    return hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()[:16]
