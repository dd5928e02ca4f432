"""`sweep` and `quality`: a grid of cells, or of paths' quality, measured into the results
database here or, for cells, over a Dask cluster's workers (`sweep --cluster`)."""

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
    GPU_OPTION,
    LABEL_OPTION,
    REL_WIDTH_OPTION,
    SEED_MAX,
    TIMEOUT_OPTION,
    TRUST_OPTION,
    WARMUP_OPTION,
    check_device,
    fleet_device,
    named_gpu,
    parse_contexts,
    parse_count,
    parse_rel_width,
    parse_timeout,
    resolve_gpu,
    split_list,
)
from floorline.cli.render import (
    cells_table,
    err,
    fleet_progress,
    out,
    print_again,
    print_cell_notes,
    print_table,
    progress_bar,
    quality_table,
)
from floorline.measure.quality import (
    SWEEP_TOKENS,
    TOKENS,
    WINDOW,
    check_windows,
    quality_key,
    quality_path,
)
from floorline.measure.runner import warm_worker
from floorline.measure.runs import open_run
from floorline.measure.sweep import Grid, Sweep, check_grid, default_grid, stored_cells
from floorline.models import model_label, resolve_model
from floorline.records import key_steps, key_warmup
from floorline.store import Store, quality_by_cell


@interruptible("every finished cell is in the database")
def sweep(
    models: Annotated[list[str] | None, typer.Option(
        help="Models (names or directories), comma-separated.")] = None,
    ctx: Annotated[list[str] | None, typer.Option(help="Context lengths, comma-separated.")] = None,
    paths: Annotated[list[str] | None, typer.Option(
        help="Paths, comma-separated (`floorline paths`).")] = None,
    steps: Annotated[str, typer.Option(
        help="Timed decode steps per cell, or 'auto': until the median's 95% interval is within "
             "--rel-width (at most 2048).")] = "64",
    warmup: WARMUP_OPTION = "auto",
    rel_width: REL_WIDTH_OPTION = None,
    db: DB_OPTION = Path("floorline.db"),
    device: DEVICE_OPTION = None,
    gpu: GPU_OPTION = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Re-measure cells already valid in the database.")] = False,
    seed: Annotated[int, typer.Option(min=0, max=SEED_MAX)] = 0,
    trust_remote_code: TRUST_OPTION = False,
    cluster: Annotated[str | None, typer.Option(
        help="Spread the cells over a Dask cluster: 'local-cuda' (one worker per GPU of this node) "
             "or a scheduler's address tcp://HOST:PORT whose workers each hold one GPU (started "
             "with --resources GPU=1). With it, --device is each worker's: cuda (default) or "
             "cpu.")] = None,
    timeout: TIMEOUT_OPTION = None,
    no_quality: Annotated[bool, typer.Option(
        "--no-quality",
        help="Do not measure what each path's formats cost in quality (perplexity, KL and "
             "greedy agreement against the model in float32), which a sweep does once per model "
             "with real weights and path; not with --cluster (run `floorline quality` "
             "there).")] = False,
    quality_tokens: Annotated[int, typer.Option(
        help=f"Tokens of the evaluation text the quality is measured on, in windows of "
             f"--quality-window (`floorline quality` measures {TOKENS} by default).")
    ] = SWEEP_TOKENS,
    quality_window: Annotated[int, typer.Option(
        help="Tokens of each window the text is scored in, each from its second position "
             "(the quality's 95% intervals are over windows).")] = WINDOW,
    label: LABEL_OPTION = None,
) -> None:
    """Measure a grid of cells into the results database (bare: the study's grid, or the CPU demo)."""  # noqa: E501
    step_count = parse_count(steps, "--steps", 1)
    width = parse_rel_width(rel_width, step_count)
    timeout_s = parse_timeout(timeout)
    warmup_count = parse_count(warmup, "--warmup", 0)
    check_windows(quality_tokens, quality_window, "--quality-tokens", "--quality-window")
    device = check_device(device) if cluster is None else fleet_device(device, cluster)
    default = default_grid(device)
    grid = check_grid(Grid(tuple(split_list(models, "--models")) or default.models,
                           tuple(parse_contexts(ctx)) or default.contexts,
                           tuple(split_list(paths, "--paths")) or default.paths), trust_remote_code)
    keys = grid.cells(key_steps(step_count, width), key_warmup(warmup_count))
    quality_keys = ([] if no_quality
                    else grid.quality(quality_tokens, quality_window, trust_remote_code))
    options = {"models": grid.models, "contexts": grid.contexts, "paths": grid.paths,
               "steps": key_steps(step_count, width), "warmup": key_warmup(warmup_count),
               "device": device, "cluster": cluster, "force": force, "seed": seed,
               "trust_remote_code": trust_remote_code, "timeout_s": timeout_s,
               "quality": [asdict(k) for k in quality_keys], "db": str(db)}
    if cluster is not None:
        if quality_keys:
            err.print("quality is not measured with --cluster: `floorline quality` measures it "
                      "on one machine", highlight=False, markup=False)
        return fleet_sweep(keys, db, cluster, device, gpu and named_gpu(gpu), force, seed,
                           trust_remote_code, timeout_s, options, label)
    device_spec = resolve_gpu(gpu, device)
    runner = Sweep(Store(db), device, device_spec, force=force, seed=seed,
                   trust_remote_code=trust_remote_code, timeout_s=timeout_s)
    runner.begin_run("sweep", {**options, "gpu": asdict(device_spec)}, label)
    if device == "cpu":
        err.print(f"No CUDA device: running on the CPU; floor bandwidth "
                  f"{device_spec.peak_gbps:g} GB/s {device_spec.source}", highlight=False,
                  markup=False)
    with warm_worker(device), progress_bar() as progress:
        total = len(keys) + len(quality_keys)
        task = progress.add_task("sweep", total=total)

        def cell_started(key) -> None:
            progress.update(task, description=escape(f"{model_label(key.model)} ctx={key.ctx} "
                                                     f"{key.path}"))

        def cell_done(key, result) -> None:
            if result is not None:
                print_cell_notes(progress.console, result, f"{key.model} ctx={key.ctx} {key.path}")
            progress.advance(task)

        def quality_started(key) -> None:
            progress.update(task, description=escape(f"quality: {model_label(key.model)} "
                                                     f"{key.path}"))

        def quality_done(key, result) -> None:
            if result is not None and result.reason:
                progress.console.print(f"quality of {key.model} {key.path}: {result.reason}",
                                       highlight=False, markup=False)
            progress.advance(task)

        def cells_again(n: int) -> None:
            progress.update(task, total=total + n)
            print_again(progress.console, n)

        measured = runner.run_cells(keys, cell_started, cell_done, cells_again)
        measured_quality = runner.run_qualities(quality_keys, quality_started, quality_done)
    runner.store.end_run()
    rows = runner.cells(keys)
    title = f"{db}: {measured} measured, {len(keys) - measured} already valid (skipped)"
    if quality_keys:
        title += (f"; quality of {len(quality_keys)} model and path pair(s): "
                  f"{measured_quality} measured, {len(quality_keys) - measured_quality} already "
                  "valid")
    print_table(out, cells_table(rows, title, runner.store.probes(),
                                 quality_by_cell(rows, runner.qualities())))


def fleet_sweep(keys, db: Path, cluster: str, device: str, gpu, force: bool, seed: int,
                trust_remote_code: bool, timeout_s: float, options: dict,
                label: str | None) -> None:
    """`sweep --cluster`: the cells as tasks on the cluster's workers, each committed here as
    it ends, with the fleet's progress. The run's provenance is this machine's code; each
    row's environment is its worker's."""
    from floorline.measure import fleet

    with fleet.Fleet(cluster) as f:
        store = open_run(db, "sweep", options, fleet.driver_environment(), label)
        err.print(f"Dask scheduler {f.address}: surveying its workers with a GPU", highlight=False,
                  markup=False)
        todo, env_keys = fleet.to_measure(f, store, keys, device, gpu, force)
        done: dict[str, int] = {}
        current: dict[str, object] = {}  # the cell each worker last started
        bar, lines = fleet_progress()
        with bar:
            task = bar.add_task("fleet", total=len(todo))

            def on_start(key, s):
                current[s.worker] = key
                lines[s.worker] = (f"({s.gpu}) {model_label(key.model)} ctx={key.ctx} "
                                   f"{key.path}, {done.get(s.worker, 0)} done")

            def on_done(key, cell, worker, env_key):
                done[worker] = done.get(worker, 0) + 1
                if current.get(worker) == key:  # else it has started its next cell
                    lines[worker] = f"({cell.gpu}) idle, {done[worker]} done"
                print_cell_notes(bar.console, cell,
                                 f"{key.model} ctx={key.ctx} {key.path} on worker {worker}")
                bar.advance(task)

            def on_again(n: int) -> None:
                bar.update(task, total=len(todo) + n)
                print_again(bar.console, n)

            env_keys |= fleet.sweep(f, store, todo, device, gpu, seed=seed,
                                    trust_remote_code=trust_remote_code, timeout_s=timeout_s,
                                    on_start=on_start, on_done=on_done, on_again=on_again)
        store.end_run()
    print_table(out, cells_table(stored_cells(store, keys, env_keys),
                                 f"{store.path}: {len(todo)} measured, {len(keys) - len(todo)} "
                                 f"already valid (skipped), on {len(done)} worker(s)",
                                 store.probes()))


@interruptible("every finished quality measurement is in the database")
def quality_cmd(
    models: Annotated[list[str], typer.Option(
        help="Models with real weights (names or checkpoint directories), comma-separated.")],
    paths: Annotated[list[str], typer.Option(
        help="Base paths, comma-separated (`floorline paths`).")],
    tokens: Annotated[int, typer.Option(
        help="Tokens of the evaluation text scored (the start of Python's own reference "
             "documentation), a whole number of windows.")] = TOKENS,
    window: Annotated[int, typer.Option(
        help="Tokens per window: the text is scored in non-overlapping windows, each from its "
             "2nd token.")] = WINDOW,
    db: DB_OPTION = Path("floorline.db"),
    device: DEVICE_OPTION = None,
    gpu: GPU_OPTION = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Re-measure paths already valid in the database.")] = False,
    seed: Annotated[int, typer.Option(min=0, max=SEED_MAX)] = 0,
    trust_remote_code: TRUST_OPTION = False,
    timeout: TIMEOUT_OPTION = None,
    label: LABEL_OPTION = None,
) -> None:
    """Measure what each path's formats cost in quality, against transformers' own model of the
    same weights in float32: perplexity, KL divergence and greedy agreement."""
    timeout_s = parse_timeout(timeout)
    check_windows(tokens, window)
    device = check_device(device)
    names = split_list(models, "--models")
    bases = [quality_path(p) for p in split_list(paths, "--paths")]
    for name in names:
        resolve_model(name, trust_remote_code)
    keys = [quality_key(m, p, tokens, window) for m in names for p in dict.fromkeys(bases)]
    gpu_spec = resolve_gpu(gpu, device)  # refused before the database is made
    runner = Sweep(Store(db), device, gpu_spec, force=force, seed=seed,
                   trust_remote_code=trust_remote_code, timeout_s=timeout_s)
    runner.begin_run("quality", {"keys": [asdict(k) for k in keys], "device": device,
                                 "gpu": asdict(runner.gpu), "force": force, "seed": seed,
                                 "trust_remote_code": trust_remote_code, "timeout_s": timeout_s,
                                 "db": str(db)}, label)
    with warm_worker(device), progress_bar() as progress:
        task = progress.add_task("quality", total=len(keys))
        measured = runner.run_qualities(
            keys, lambda key: progress.update(task, description=escape(
                f"{model_label(key.model)} {key.path}")),
            lambda key, result: progress.advance(task))
    runner.store.end_run()
    print_table(out, quality_table(runner.qualities(keys),
                                   f"{db}: {measured} measured, {len(keys) - measured} already "
                                   f"valid (skipped); {tokens} tokens in windows of {window}"))
