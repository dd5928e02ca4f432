"""The commands a report suggests, fitted to the machine that builds it: a path is named only
where it can run there (`floorline paths` says why one cannot)."""

from __future__ import annotations

from functools import cache

from floorline.paths import parse_path, unavailable

# A/B pairs worth running, first choice first: CUDA graphs where there is CUDA (the study's
# experiment), else the engine against transformers, which runs on a CPU.
AB_PAIRS = (("hf-static", "hf-static+graphs"), ("hf-eager", "engine"))


@cache
def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def runnable(*paths: str) -> list[str]:
    """Those of `paths` that can run here, in order."""
    return [p for p in paths if unavailable(parse_path(p), device()) is None]


def ab_command() -> str:
    a, b = next(pair for pair in AB_PAIRS if len(runnable(*pair)) == 2)
    return f"`floorline ab --a {a} --b {b}`"


def paths_option(*paths: str) -> str:
    """`--paths` with those of `paths` that run here; empty where none does."""
    here = runnable(*paths)
    return f" --paths {','.join(here)}" if here else ""
