"""`ab`: two paths against each other over fresh sessions, here or on a Dask cluster's workers."""

from __future__ import annotations

import contextlib
import json
import random
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from floorline.cli.app import fail, interruptible
from floorline.cli.options import (
    DB_OPTION,
    DEVICE_OPTION,
    GPU_OPTION,
    LABEL_OPTION,
    SEED_MAX,
    STEPS_MAX,
    TIMEOUT_OPTION,
    TRUST_OPTION,
    WARMUP_OPTION,
    check_device,
    fleet_device,
    named_gpu,
    one_context,
    parse_count,
    parse_timeout,
)
from floorline.cli.render import err, num, out, progress_bar
from floorline.measure.runner import warm_worker
from floorline.models import resolve_model
from floorline.paths import parse_path


@interruptible("every finished session is in the database")
def ab(
    a: Annotated[str, typer.Option("--a", help="Baseline path, e.g. hf-static.")],
    b: Annotated[str, typer.Option("--b", help="Treatment path, e.g. hf-static+graphs.")],
    model: Annotated[str, typer.Option(help="Shipped name or local directory.")] = "qwen2.5-7b",
    ctx: Annotated[str, typer.Option(help="Context length.")] = "2048",
    sessions: Annotated[int, typer.Option(
        min=1, max=STEPS_MAX, help="Fresh sessions (processes).")] = 10,
    steps: Annotated[int, typer.Option(
        min=1, max=STEPS_MAX, help="Timed steps per arm per session.")] = 64,
    block: Annotated[int, typer.Option(
        min=1, max=STEPS_MAX, help="Steps per block when arms alternate.")] = 8,
    warmup: WARMUP_OPTION = "auto",
    seed: Annotated[int | None, typer.Option(min=0, max=SEED_MAX,
                                                help="Seed of the arm order and the bootstrap; "
                                                     "default: drawn and recorded.")] = None,
    db: DB_OPTION = Path("floorline.db"),
    device: DEVICE_OPTION = None,
    gpu: GPU_OPTION = None,
    trust_remote_code: TRUST_OPTION = False,
    timeout: TIMEOUT_OPTION = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    cluster: Annotated[str | None, typer.Option(
        help="Spread the sessions over a Dask cluster's workers, as `sweep --cluster` does "
             "(workers of one kind of GPU).")] = None,
    label: LABEL_OPTION = None,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Carry on the newest A/B of the same paths, model, context, sessions, "
                         "steps and seed (any seed where --seed is not given) in --db that was "
                         "cut off before its summary, in the same environment: only its missing "
                         "sessions run. Without one, a new A/B begins. Not while that A/B still "
                         "runs.")] = False,
) -> None:
    """A/B of two paths over fresh sessions: speedup with a 95% BCa bootstrap interval."""
    from floorline.measure import fleet
    from floorline.measure.ab import Plan, Recording, here

    warmup_count = parse_count(warmup, "--warmup", 0)
    timeout_s = parse_timeout(timeout)
    # names refused before torch loads (check_device)
    arms, context = (parse_path(a).name, parse_path(b).name), one_context(ctx, "ab")
    gpu_spec = None if gpu is None else named_gpu(gpu)
    resolve_model(model, trust_remote_code)
    device = check_device(device) if cluster is None else fleet_device(device, cluster)
    any_seed = seed is None
    seed = random.SystemRandom().randrange(2**31) if seed is None else seed
    # its GPU the one the sessions run on, which the bench finds
    plan = Plan(*arms, model, context, device, "", sessions, steps, block, warmup_count, seed,
                trust_remote_code, timeout_s)

    with contextlib.ExitStack() as stack:
        if cluster is None:
            stack.enter_context(warm_worker(device))
            bench = here(plan, gpu_spec)
        else:  # the GPU, environment and paths are the workers'
            bench = fleet.ab_bench(stack.enter_context(fleet.Fleet(cluster)), plan, gpu_spec)
        recording = Recording(bench, db, {"cluster": cluster}, label, resume, any_seed)
        plan, to_run = recording.plan, recording.to_run()
        design = ("paired (ABBA blocks in each session)" if plan.paired
                  else "unpaired (one process per arm)")
        err.print(f"A/B {plan.a} vs {plan.b}: {plan.sessions} fresh sessions, {design}, seed "
                  f"{plan.seed}", highlight=False, markup=False)
        if recording.experiment is not None:
            err.print(f"resuming the A/B cut off in {db}: {len(recording.resumed)} of its "
                      f"sessions are stored, {len(to_run)} to run", highlight=False,
                      markup=False)
        elif resume:
            err.print(f"no cut-off A/B of this plan in {db} to resume: a new one begins",
                      highlight=False, markup=False)
        with progress_bar() as progress:
            task = progress.add_task("sessions", total=len(to_run))

            def on_session(s):
                progress.console.print(
                    f"session {s.index}: " + (f"a {s.ms_a:.3f} ms, b {s.ms_b:.3f} ms, ratio "
                                              f"{s.ratio:.3f} (first {s.first_arm})"
                                              if s.status == "ok" else f"failed: {s.reason}"),
                    highlight=False, markup=False)
                progress.advance(task)

            summary = recording.run(on_session)
    if not summary.ok:
        fail(f"{summary.sentence()}: "
             + "; ".join(dict.fromkeys(s.reason for s in summary.sessions)))
    if as_json:
        print(json.dumps(summary.as_dict(), indent=2))
        return
    energy = any(s.energy_ratio is not None for s in summary.sessions)
    table = Table("session", "first", f"{plan.a} ms", f"{plan.b} ms", "ratio a/b",
                  *([f"{plan.a} J/token", f"{plan.b} J/token", "energy a/b"] if energy else []),
                  "status")
    for s in summary.sessions:
        table.add_row(str(s.index), s.first_arm or "-", num(s.ms_a, ".3f"), num(s.ms_b, ".3f"),
                      num(s.ratio, ".4f"),
                      *([num(s.j_a, ".4g"), num(s.j_b, ".4g"), num(s.energy_ratio, ".4f")]
                        if energy else []),
                      s.status if s.status == "ok" else escape(f"failed: {s.reason}"))
    out.print(table)
    out.print(summary.sentence(), highlight=False, markup=False)
