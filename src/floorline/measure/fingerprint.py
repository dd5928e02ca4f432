"""The environment a cell was measured in, with its provenance (measure/provenance.py). Cells
are comparable when their keys match: the same GPU model, driver, software versions, engine
kernels, tuning table and result-changing flags."""

from __future__ import annotations

import hashlib
import json
import platform

import floorline
from floorline.hardware import nvml_handle
from floorline.measure import provenance

# What must match for a stored cell to count as already measured (with the kernel and tuning
# hashes and the flags that change results: fingerprint_key); the rest is only recorded.
KEY_FIELDS = ("device", "driver", "cuda", "torch", "transformers", "triton", "floorline")


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


def _triton() -> str | None:
    try:
        import triton
    except ImportError:  # no Triton for this platform
        return None
    return triton.__version__


def _gpu(device: str) -> dict:
    try:
        nvml, handle = _nvml_handle(device)
    except Exception:
        return {}
    return provenance.gpu(nvml, handle)


def environment(device: str) -> dict:
    import torch
    import transformers

    env = {
        "floorline": floorline.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "triton": _triton(),
        "cuda": torch.version.cuda,
        "code": provenance.code(),
        "flags": provenance.flags(),
        "host": provenance.host(),
    }
    if device.startswith("cuda"):
        env["device"] = torch.cuda.get_device_name(torch.device(device).index or 0)
        env["driver"] = _driver(device)
        env["gpu"] = _gpu(device)
    else:
        env.update(device=f"cpu: {platform.processor() or platform.machine()}", driver=None,
                   cuda=None)
    env["clocks_at_start"] = clocks(device)
    return env


def fingerprint_key(env: dict, engine: bool = True) -> str:
    """The key of `env`'s provenance class. An environment recorded before provenance was (no
    "code") keys on its versions alone, as it did then. `engine`: whether the cells keyed run
    the engine's kernels; where they do not, the kernels' hashes and the tuning table are left
    out (a transformers step is the same whichever GEMV launches the engine has tuned)."""
    stable = {k: env.get(k) for k in KEY_FIELDS}
    if "code" in env:
        stable.update(flags=provenance.keyed_flags(env.get("flags", {})))
        if engine:
            stable.update(kernels=env["code"]["kernels_sha256"],
                          tuning=env["code"]["tuning_sha256"])
    else:
        stable = {k: v for k, v in stable.items() if k != "triton"}
    return hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()[:16]
