"""The environment a cell was measured in. Cells are comparable when their keys match."""

from __future__ import annotations

import hashlib
import json
import platform

import floorline

# What must match for a stored cell to count as already measured; clocks are recorded only.
KEY_FIELDS = ("device", "driver", "cuda", "torch", "transformers", "floorline")


def _nvml(index: int) -> dict:
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        clocks = {
            f"{kind}_{which}_mhz": fn(h, clock)
            for kind, clock in (("sm", pynvml.NVML_CLOCK_SM), ("mem", pynvml.NVML_CLOCK_MEM))
            for which, fn in (("clock", pynvml.nvmlDeviceGetClockInfo),
                              ("max", pynvml.nvmlDeviceGetMaxClockInfo))
        }
        return {"driver": pynvml.nvmlSystemGetDriverVersion(), "clocks": clocks}
    except Exception:  # no NVML (CPU host, old driver): these fields stay empty
        return {"driver": None, "clocks": {}}


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
        index = torch.device(device).index or 0
        env["device"] = torch.cuda.get_device_name(index)
        env.update(_nvml(index))
    else:
        env.update(device=f"cpu: {platform.processor() or platform.machine()}", driver=None,
                   clocks={}, cuda=None)
    return env


def fingerprint_key(env: dict) -> str:
    stable = {k: env.get(k) for k in KEY_FIELDS}
    return hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()[:16]
