"""Path registry: `hf-static+compile+graphs` -> a base path and its options."""

from __future__ import annotations

from floorline.errors import FloorlineError
from floorline.paths.awq_marlin import AwqMarlinPath
from floorline.paths.base import (
    OPTIONS,
    DecodePath,
    GraphedSession,
    PathSpec,
    PathUnavailable,
    Session,
    compile_mode,
)
from floorline.paths.bnb import BnbPath
from floorline.paths.engine import EnginePath
from floorline.paths.exllamav2 import ExllamaV2Path
from floorline.paths.hf import HFPath
from floorline.paths.llamacpp import LlamaCppPath
from floorline.paths.torchao import TorchaoInt4Path

REGISTRY: dict[str, DecodePath] = {p.name: p for p in (
    HFPath("dynamic"), HFPath("static"),
    BnbPath("nf4"), BnbPath("int8"), ExllamaV2Path(), AwqMarlinPath(), TorchaoInt4Path(),
    *(LlamaCppPath(f) for f in ("bf16", "q4_0", "q4_1", "q8_0")), EnginePath(), EnginePath("int4"),
    EnginePath("fp8"), EnginePath(head="fp8"), EnginePath("int4", "fp8"), EnginePath("fp8", "fp8"),
    EnginePath(kv="fp8"), EnginePath("int4", kv="fp8"), EnginePath("fp8", kv="fp8"),
    EnginePath("gguf"), EnginePath("gguf", kv="fp8"),
)}


def parse_path(text: str) -> PathSpec:
    base, *options = text.strip().split("+")
    if base not in REGISTRY:
        raise FloorlineError(f"unknown path '{text}'; base paths: {', '.join(REGISTRY)}")
    verify = [o for o in options if o.startswith("verify")]
    for option in options:
        if option not in OPTIONS and option not in verify:
            raise FloorlineError(f"unknown option '+{option}' in path '{text}'; options: "
                                 + ", ".join("+" + o for o in OPTIONS))
    if len(set(options)) != len(options) or len(verify) > 1:
        raise FloorlineError(f"path '{text}' repeats an option")
    k = _verify_tokens(verify[0], text) if verify else 1
    if k > 1 and not isinstance(REGISTRY[base], EnginePath):
        raise FloorlineError(f"path '{text}': +{verify[0]} times the engine's verify step, on "
                             "the engine's paths only")
    return PathSpec(base, "compile" in options, "graphs" in options, k)


def _verify_tokens(option: str, text: str) -> int:
    from floorline.engine.model import VERIFY_MAX

    k = option.removeprefix("verify")
    if not k.isdigit() or not 2 <= int(k) <= VERIFY_MAX:
        raise FloorlineError(f"path '{text}': +verifyK takes K from 2 to {VERIFY_MAX} tokens, "
                             f"not '+{option}'")
    return int(k)


def verify_tokens(path: str) -> int:
    """Tokens a stored path's step checks (parse_path checked its name when it was measured):
    K for the option +verifyK, else 1."""
    return next((int(o[6:]) for o in path.split("+")[1:]
                 if o.startswith("verify") and o[6:].isdigit()), 1)


def unavailable(path_spec: PathSpec, device: str) -> str | None:
    reason = REGISTRY[path_spec.base].unavailable(device)
    if reason is None and path_spec.graphs and not device.startswith("cuda"):
        reason = "+graphs needs a CUDA device"
    return reason


def require_available(path_spec: PathSpec, device: str) -> None:
    """For commands that run one path directly: a path that cannot run is a user error."""
    reason = unavailable(path_spec, device)
    if reason:
        raise FloorlineError(f"path {path_spec.name} cannot run here: {reason}")


def open_session(path_spec: PathSpec, model_spec, device: str, capacity: int, seed: int) -> Session:
    # a verify step writes its K tokens' keys and values past the position it times
    session = REGISTRY[path_spec.base].open(model_spec, device, capacity + path_spec.verify - 1,
                                            seed)
    try:
        if path_spec.verify > 1:
            session.verify_tokens(path_spec.verify)
        if (path_spec.compile or path_spec.graphs) and session.not_static_reason:
            raise PathUnavailable(f"{path_spec.base} cannot be compiled or captured in a CUDA "
                                  f"graph here: {session.not_static_reason}")
        if path_spec.compile:
            session.compile(compile_mode(device))
        return GraphedSession(session) if path_spec.graphs else session
    except BaseException:
        session.close()
        raise


__all__ = ["REGISTRY", "DecodePath", "PathSpec", "PathUnavailable", "Session", "open_session",
           "parse_path", "require_available", "unavailable", "verify_tokens"]
