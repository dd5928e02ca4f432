"""The options several commands share, and the parsers that check what an option was given:
each bad value refused in one line naming the option."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Annotated

import typer

from floorline import hardware
from floorline.cli.render import err
from floorline.errors import FloorlineError
from floorline.measure.runner import TIMEOUT_S
from floorline.models import resolve_model
from floorline.models.zoo import stand_in
from floorline.records import AUTO, key_steps
from floorline.timing import REL_WIDTH

DB_OPTION = Annotated[Path, typer.Option("--db", help="Results database (SQLite).")]
LABEL_OPTION = Annotated[str | None, typer.Option(
    envvar="FLOORLINE_RUN_LABEL",
    help="A name for this run, kept with it (`floorline show --provenance` lists the runs).")]
DEVICE_OPTION = Annotated[str | None, typer.Option(
    help="cuda, cuda:N or cpu; default: cuda if present.")]
GPU_OPTION = Annotated[str | None, typer.Option(
    help="GPU for the floor (`floorline gpus`); default: detected.")]
TRUST_OPTION = Annotated[bool, typer.Option(
    "--trust-remote-code", help="Run a config's own model code (auto_map).")]
WARMUP_OPTION = Annotated[str, typer.Option(
    help="Untimed decode steps before timing, or 'auto': until the median of 32 steps agrees "
         "with the 32 before within their own noise (at least 1%, at most 5%; at most 512 steps "
         "or about 5 s, after at least 4 windows).")]
REL_WIDTH_OPTION = Annotated[float | None, typer.Option(
    help="With --steps auto: the width of the median's 95% interval to reach, as a fraction of "
         "the median (default 0.01).")]
TIMEOUT_OPTION = Annotated[float | None, typer.Option(
    "--timeout", help="Seconds each measuring process (one per cell or session) may run before it "
                      "is stopped and its result marked as timed out (default 1800).")]
DRAFT_OPTION = Annotated[str | None, typer.Option(
    help="Speculative decoding: 'lookup' drafts from n-grams of the prompt and reply so far; a "
         "checkpoint directory drafts with that smaller model (its tokenizer must be the "
         "model's). Greedy replies stay token for token the same.")]
DRAFT_TOKENS_OPTION = Annotated[str, typer.Option(
    help="Tokens drafted per verify step, 1-15, or 'auto' (from the acceptance so far).")]
SEED_MAX = 2**32 - 1
STEPS_MAX = 1_000_000
MAX_CONTEXT = 2**31 - 1  # tokens; far above any model, and within what the database stores


def split_list(values: list[str] | None, option: str) -> list[str]:
    """`--x a,b --x c` -> [a, b, c]; an option given with nothing in it (or an empty item) is
    refused rather than read as "use the default" (an option not given at all is [] or None)."""
    items = [v.strip() for value in values or [] for v in value.split(",")]
    if "" in items:
        raise FloorlineError(f"{option} has an empty value: give one or more, comma-separated")
    return items


def parse_contexts(values: list[str] | None) -> list[int]:
    contexts = []
    for v in split_list(values, "--ctx"):
        try:
            ctx = int(v)
        except ValueError:
            raise FloorlineError(f"context must be a whole number of tokens, got '{v}'") from None
        if not 0 < ctx <= MAX_CONTEXT:
            raise FloorlineError(f"context must be a positive number of tokens up to "
                                 f"{MAX_CONTEXT}, got {ctx}")
        contexts.append(ctx)
    return contexts


def one_context(text: str, command: str) -> int:
    contexts = parse_contexts([text])
    if len(contexts) != 1:
        raise FloorlineError(f"{command} takes one context length")
    return contexts[0]


def parse_count(text: str, option: str, least: int) -> int | None:
    """A number of steps, or None for 'auto'."""
    if text == "auto":
        return None
    try:
        n = int(text)
    except ValueError:
        raise FloorlineError(f"{option} must be 'auto' or a whole number of steps, got "
                             f"'{text}'") from None
    if not least <= n <= STEPS_MAX:
        raise FloorlineError(f"{option} must be 'auto' or from {least} to {STEPS_MAX}, got {n}")
    return n


def parse_rel_width(rel_width: float | None, steps: int | None) -> float:
    """--rel-width, which only `--steps auto` reads; default 0.01."""
    if rel_width is None:
        return REL_WIDTH
    if steps is not None:
        raise FloorlineError("--rel-width applies only with --steps auto")
    if not 0 < rel_width < 1:
        raise FloorlineError(f"--rel-width must be above 0 and below 1 (a fraction of the "
                             f"median), got {rel_width:g}")
    # The cell's key keeps the width to 6 significant digits (key_steps): a finer one would be
    # measured, and found already measured, as its rounding.
    if float(key_steps(None, rel_width).removeprefix(f"{AUTO}:")) != rel_width:
        raise FloorlineError(f"--rel-width takes at most 6 significant digits, got {rel_width!r}")
    return rel_width


def parse_timeout(timeout: float | None) -> float:
    """--timeout in seconds; default the runner's."""
    if timeout is None:
        return TIMEOUT_S
    if not 1 <= timeout <= 1e6:
        raise FloorlineError(f"--timeout must be from 1 to 1000000 seconds, got {timeout:g}")
    return timeout


def draft_tokens_value(text: str) -> int | str:
    """--draft-tokens: 'auto' or a whole number (its range checked where it is used)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise FloorlineError(f"--draft-tokens takes a whole number from 1 to 15 or 'auto', not "
                             f"'{text}'") from None


# What a GPU driver puts on Linux (NVIDIA, ROCm, WSL): where none is there, torch sees no CUDA
# device, and is not loaded (seconds on a fresh machine) to say so.
GPU_DRIVER_FILES = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def default_device() -> str:
    if sys.platform == "linux" and not any(map(os.path.exists, GPU_DRIVER_FILES)):
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str | None) -> str:
    """The --device asked for (None: the default); an empty or unknown one is refused."""
    if device is None:
        return default_device()
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise FloorlineError(f"--device must be 'cpu' or 'cuda[:N]', got '{device}'")
    if device == "cpu":
        return device
    import torch

    if not torch.cuda.is_available():
        raise FloorlineError(f"device '{device}' asked for, but torch sees no CUDA device here")
    index = torch.device(device).index
    if index is not None and index >= torch.cuda.device_count():
        raise FloorlineError(f"device '{device}' asked for, but torch sees "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    return device


def fleet_device(device: str | None, cluster: str) -> str:
    """The device each worker of a --cluster measures on: its GPU, or with --device cpu its CPU."""
    from floorline.measure.fleet import LOCAL_CUDA, check_cluster

    check_cluster(cluster)
    if device not in (None, "cuda", "cpu"):
        raise FloorlineError(f"with --cluster, --device is 'cuda' (each worker's own GPU) or "
                             f"'cpu', got '{device}'")
    if device == "cpu" and cluster == LOCAL_CUDA:
        raise FloorlineError(f"--cluster {LOCAL_CUDA} runs a worker per GPU: --device cpu does "
                             "not apply")
    return device or "cuda"


def named_gpu(name: str):
    """The catalogue's GPU of that name, saying on stderr which part a study name stands for."""
    device_spec = hardware.lookup(name)
    note = hardware.alias_note(name)
    if note:
        err.print(note, highlight=False, markup=False)
    return device_spec


def resolve_gpu(name: str | None, device: str):
    return hardware.detect(device) if name is None else named_gpu(name)


def resolve_noted(model: str, trust_remote_code: bool = False):
    """resolve_model, saying on stderr which shipped config stands in for an instruct or chat
    model's name or id."""
    model_spec = resolve_model(model, trust_remote_code)
    if stand_in(model) == model_spec.name:
        err.print(f"note: the shipped config {model_spec.name} stands in for {model} (the same "
                  "architecture and shapes)", highlight=False, markup=False)
    return model_spec
