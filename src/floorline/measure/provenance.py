"""Where a result came from: the code (commit, whether the tree was dirty, a hash of the
engine's kernel sources and of the GEMV tuning table in force), the software versions, the GPU
(name, UUID, power limit, clock policy), the environment variables floorline reads, and the
host. Every stored row carries this (measure/fingerprint.py adds it to the environment)."""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
from pathlib import Path

import floorline
from floorline.localcache import cache_dir

PACKAGE = Path(floorline.__file__).parent
ENGINE = PACKAGE / "engine"
SHIPPED_TUNING = ENGINE / "tuned"

# The environment variables floorline reads, and whether each can change a result (those that
# can are part of the key that decides whether a cell is already measured).
FLAGS = {
    "FLOORLINE_PDL": True,  # the engine's programmatic dependent launch (0 turns it off)
    "TRITON_INTERPRET": True,  # Triton kernels run in NumPy instead of on the GPU
    "FLOORLINE_MARLIN_LIB": True,  # which build of the awq-marlin kernels is loaded
    "CUDA_VISIBLE_DEVICES": False,
    "FLOORLINE_CACHE": False,
    "FLOORLINE_LLAMA_LOG": False,
    "FLOORLINE_DEBUG": False,
    "FLOORLINE_RUN_LABEL": False,  # a run's --label, where the option is not given
    "FLOORLINE_CONNECT_TIMEOUT": False,  # --cluster: seconds to reach the scheduler
    "FLOORLINE_WORKER_TIMEOUT": False,  # --cluster: seconds to wait for a worker with a GPU
}


def hash_files(files: list[Path], root: Path) -> str:
    """SHA-256 over the files' paths (relative to `root`) and contents, in path order."""
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def kernels_sha256() -> str:
    """The engine's sources: its kernels and everything that decides which run and how."""
    return hash_files(list(ENGINE.rglob("*.py")), ENGINE)


def tuning_tables() -> list[Path]:
    """The GEMV tuning tables in force, in the order they are read (engine/tuning.py)."""
    local = cache_dir() / "engine-gemv.json"
    return sorted(SHIPPED_TUNING.glob("*.json")) + ([local] if local.is_file() else [])


def tuning_sha256() -> str:
    h = hashlib.sha256()
    for table in tuning_tables():
        h.update(table.name.encode() + b"\0" + table.read_bytes() + b"\0")
    return h.hexdigest()


def source_sha256() -> str:
    """Every file of the installed package: names the code even where there is no git."""
    files = [f for f in PACKAGE.rglob("*") if f.is_file() and f.suffix in (".py", ".json")]
    return hash_files(files, PACKAGE)


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(PACKAGE), *args], capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def code() -> dict:
    """The commit and whether the package's tree differs from it (None, None outside a git
    checkout, e.g. an installed wheel or a copied tree), and the version they make."""
    commit = _git("rev-parse", "HEAD")
    dirty = None
    if commit is not None:
        status = _git("status", "--porcelain", "--untracked-files=no", "--", ".")
        dirty = None if status is None else bool(status)
    source = source_sha256()
    local = (f"g{commit[:12]}" + (".dirty" if dirty else "")) if commit else f"src.{source[:12]}"
    return {"commit": commit, "dirty": dirty, "version": f"{floorline.__version__}+{local}",
            "source_sha256": source, "kernels_sha256": kernels_sha256(),
            "tuning_sha256": tuning_sha256(),
            "tuning_tables": [t.name for t in tuning_tables()]}


def flags() -> dict:
    """The variables of FLAGS that are set, with their values."""
    return {name: os.environ[name] for name in FLAGS if name in os.environ}


def keyed_flags(env_flags: dict) -> dict:
    """The flags that can change a result."""
    return {k: v for k, v in env_flags.items() if FLAGS.get(k)}


def host() -> dict:
    return {"name": platform.node(), "cpu": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "os": platform.platform()}


def gpu(nvml, handle) -> dict:
    """The card itself and how it is run: UUID, power limits and clock policy; each fact None
    where this GPU or driver does not report it."""
    def ask(fn, *args, scale=1):
        try:
            value = getattr(nvml, fn)(handle, *args)
        except Exception:  # NVML errors, or a binding without the function
            return None
        if isinstance(value, bytes):
            value = value.decode()
        return value / scale if scale != 1 and value is not None else value

    return {
        "uuid": ask("nvmlDeviceGetUUID"),
        "serial": ask("nvmlDeviceGetSerial"),
        "power_limit_w": ask("nvmlDeviceGetEnforcedPowerLimit", scale=1e3),
        "default_power_limit_w": ask("nvmlDeviceGetPowerManagementDefaultLimit", scale=1e3),
        "persistence_mode": ask("nvmlDeviceGetPersistenceMode"),
        "compute_mode": ask("nvmlDeviceGetComputeMode"),
        "application_clocks_mhz": {
            "sm": ask("nvmlDeviceGetApplicationsClock", nvml.NVML_CLOCK_SM),
            "mem": ask("nvmlDeviceGetApplicationsClock", nvml.NVML_CLOCK_MEM)},
        "default_application_clocks_mhz": {
            "sm": ask("nvmlDeviceGetDefaultApplicationsClock", nvml.NVML_CLOCK_SM),
            "mem": ask("nvmlDeviceGetDefaultApplicationsClock", nvml.NVML_CLOCK_MEM)},
        "vbios": ask("nvmlDeviceGetVbiosVersion"),
    }
