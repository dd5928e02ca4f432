import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# Without a GPU the engine's Triton kernels run in Triton's interpreter; it is read when a
# kernel is defined, so it is set before any test module imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A cache of the suite's own, so that what the user has fetched or tuned does not change what a
# test sees (a fetched model changes the CPU demo's grid); tests/test_real_model.py keeps the
# trained model in the user's cache, across runs, and points at it where it needs it.
USER_CACHE = os.environ.get("FLOORLINE_CACHE", "~/.cache/floorline")
os.environ["FLOORLINE_CACHE"] = tempfile.mkdtemp(prefix="floorline-tests-")

CONFIGS = Path(__file__).parents[1] / "src" / "floorline" / "models" / "configs"


def shipped_config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def run_cli(*args, cwd=None, check=False, timeout=600, env=None):
    """`floorline ARGS` in a fresh interpreter, as a user runs it."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    env.pop("FLOORLINE_DEBUG", None)
    proc = subprocess.run([sys.executable, "-m", "floorline", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, env=env, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"floorline {args} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


@pytest.fixture
def cli():
    return run_cli
