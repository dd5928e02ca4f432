"""`speculate`: what speculative decoding gains on real prompts, measured into the results
database: per model, engine path, drafter and workload, each in a fresh process."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from floorline.cli.app import interruptible
from floorline.cli.options import (
    DB_OPTION,
    DEVICE_OPTION,
    DRAFT_TOKENS_OPTION,
    GPU_OPTION,
    LABEL_OPTION,
    TIMEOUT_OPTION,
    TRUST_OPTION,
    check_device,
    draft_tokens_value,
    parse_timeout,
    resolve_gpu,
    split_list,
)
from floorline.cli.render import out, print_table, progress_bar, speculation_table
from floorline.errors import FloorlineError
from floorline.measure.runner import warm_worker
from floorline.measure.speculation import LOOKUP, drafter_source, speculation_key
from floorline.measure.sweep import Sweep, run_each
from floorline.measure.texts import WORKLOADS
from floorline.models import model_label, resolve_model
from floorline.store import Store


@interruptible("every finished measurement is in the database")
def speculate_cmd(
    model: Annotated[str, typer.Option(
        help="A model with trained weights: a fetched name or a checkpoint directory.")],
    draft: Annotated[list[str] | None, typer.Option(
        help="Drafters, comma-separated: 'lookup' (prompt lookup) or draft models (names or "
             "directories) that share the model's tokenizer.")] = None,
    workloads: Annotated[list[str] | None, typer.Option(
        help=f"Workloads, comma-separated: {', '.join(WORKLOADS)} (default: all).")] = None,
    paths: Annotated[list[str] | None, typer.Option(
        help="The engine's paths (formats), comma-separated.")] = None,
    draft_tokens: DRAFT_TOKENS_OPTION = "auto",
    max_new_tokens: Annotated[int, typer.Option(
        min=2, max=4096, help="Each reply's cap, if no EOS came first.")] = 96,
    dtype: Annotated[str | None, typer.Option(
        help="The engine's 16-bit dtype, bfloat16 or float32 (default: float32 on the CPU, "
             "bfloat16 on a GPU).")] = None,
    db: DB_OPTION = Path("floorline.db"),
    device: DEVICE_OPTION = None,
    gpu: GPU_OPTION = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Re-measure what the database already holds valid.")] = False,
    trust_remote_code: TRUST_OPTION = False,
    timeout: TIMEOUT_OPTION = None,
    label: LABEL_OPTION = None,
) -> None:
    """Measure speculative decoding on workloads of real prompts: acceptance, tokens a step,
    effective ms/token against the same replies without it, and the floor per token."""
    timeout_s = parse_timeout(timeout)
    device = check_device(device)
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    if dtype not in ("bfloat16", "float32"):
        raise FloorlineError(f"--dtype must be bfloat16 or float32, not '{dtype}'")
    k = draft_tokens_value(draft_tokens)
    drafters = split_list(draft or [LOOKUP], "--draft")
    resolve_model(model, trust_remote_code)
    for d in drafters:
        drafter_source(d, trust_remote_code)
    keys = list(dict.fromkeys(  # each key once, however often an item was given
        speculation_key(model, p, d, w, k, max_new_tokens, dtype)
        for p in split_list(paths or ["engine"], "--paths") for d in drafters
        for w in split_list(workloads or [",".join(WORKLOADS)], "--workloads")))
    gpu_spec = resolve_gpu(gpu, device)  # refused before the database is made
    runner = Sweep(Store(db), device, gpu_spec, force=force,
                   trust_remote_code=trust_remote_code, timeout_s=timeout_s)
    runner.begin_run("speculate", {"keys": [asdict(key) for key in keys], "device": device,
                                   "gpu": asdict(runner.gpu), "force": force,
                                   "trust_remote_code": trust_remote_code,
                                   "timeout_s": timeout_s, "db": str(db)}, label)
    with warm_worker(device), progress_bar() as progress:
        task = progress.add_task("speculate", total=len(keys))
        measured = run_each(keys, runner.run_speculation, lambda key: progress.update(
            task, description=escape(f"{model_label(key.model)} {key.path} {key.drafter}: "
                                     f"{key.workload}")),
            lambda key, result: progress.advance(task))
    runner.store.end_run()
    print_table(out, speculation_table(runner.speculations(keys),
                                       f"{db}: {measured} measured, {len(keys) - measured} "
                                       f"already valid (skipped)"))
