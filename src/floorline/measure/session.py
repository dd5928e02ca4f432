"""Fresh sessions: one process, one CUDA context, one model built anew, per session.

The parent runs `python -m floorline.measure.session JOB_JSON` and reads one JSON line back; a
session that crashes, hangs or prints no result becomes a failed session with its reason.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import asdict, dataclass

from floorline.errors import one_line
from floorline.measure.timer import StepPlan
from floorline.paths.base import GRAPH_WARMUP_STEPS

RESULT_TAG = "floorline-session-result "


@dataclass(frozen=True)
class Job:
    arms: tuple[str, ...]  # one path (unpaired), or two sharing one model and cache (paired)
    model: str
    ctx: int
    device: str
    steps: int  # timed steps per arm
    block: int  # steps per block when two arms alternate
    warmup: int | None  # per arm; None: until steady (measure.timer)
    seed: int  # this session's: picks the first arm; weights and tokens use `weights_seed`
    weights_seed: int = 0
    trust_remote_code: bool = False


def shared_base(a: str, b: str) -> bool:
    """Two arms can share one session when they differ only by +graphs: the graph replays the
    same step on the same buffers."""
    from floorline.paths import parse_path

    pa, pb = parse_path(a), parse_path(b)
    return (pa.base, pa.compile) == (pb.base, pb.compile)


def block_order(first: int, rounds: int) -> list[int]:
    """ABBA ABBA ... as arm indices, starting with `first`."""
    second = 1 - first
    return [first, second, second, first] * rounds


def arm_plan(job: Job, limit: int | None) -> StepPlan:
    """Each arm's warm-up; an automatic one's cap cut so that both arms' fit in the model's
    `limit` of positions after ctx and the timed blocks."""
    plan = StepPlan(job.warmup, 0)
    if limit is None:
        return plan
    return plan.within((limit - job.ctx - GRAPH_WARMUP_STEPS - timed_steps(job)) // 2)


def timed_steps(job: Job) -> int:
    """Every block of the timed rounds, both arms'."""
    return 4 * -(-job.steps // (2 * job.block)) * job.block


def decode_steps(job: Job, limit: int | None) -> int:
    """Steps the session runs after its prompt: graph warm-up, each arm's warm-up and every
    block of the timed rounds."""
    return GRAPH_WARMUP_STEPS + 2 * arm_plan(job, limit).most_warmup + timed_steps(job)


def run_job(job: Job) -> dict:
    """Runs inside the fresh process: samples per arm, warm-up steps and energy per arm (None
    where not measured, with the reason), and which arm went first."""
    import torch

    from floorline.measure.cell import fit_prompt
    from floorline.measure.energy import NO_READING, open_meter
    from floorline.measure.timer import run_plan, time_steps, timed_batch, warm_up
    from floorline.models import resolve_model
    from floorline.paths import GraphedSession, open_session, parse_path
    from floorline.paths.base import PathSpec

    model = resolve_model(job.model, job.trust_remote_code)
    specs = [parse_path(a) for a in job.arms]
    rounds = -(-job.steps // (2 * job.block))
    decode = decode_steps(job, model.max_context)
    prompt = fit_prompt(job.ctx, decode, model.max_context)
    plan = StepPlan(job.warmup, job.steps, warmup_cap=arm_plan(job, model.max_context).warmup_cap)
    with torch.no_grad():
        base = PathSpec(specs[0].base, specs[0].compile)
        inner = open_session(base, model, job.device, prompt + decode, job.weights_seed)
        graphed = GraphedSession(inner) if any(s.graphs for s in specs) else None
        (graphed or inner).prefill(prompt)
        steps = [graphed.step if s.graphs else inner.step for s in specs]
        meters, note = zip(*[open_meter(job.device) for _ in steps])
        if len(steps) == 1:
            timing = run_plan(steps[0], job.device, plan, meters[0])
            samples, warmups, energy = [timing.samples_ms], [timing.warmup_steps], [timing.energy]
            first = 0
        else:
            first = random.Random(job.seed).randrange(2)
            samples, warmups = [[], []], [0, 0]
            for arm in (first, 1 - first):
                if job.warmup is None:
                    warmups[arm] = warm_up(steps[arm], job.device, plan.warmup_cap)[0]
                else:
                    time_steps(steps[arm], job.device, 0, job.warmup)
                    warmups[arm] = job.warmup
            for arm in block_order(first, rounds):
                samples[arm] += timed_batch(steps[arm], job.device, job.block, meters[arm])
            energy = [m.result(len(s)) if m else None for m, s in zip(meters, samples)]
            samples = [s[: job.steps] for s in samples]
        (graphed or inner).close()
    return {"first_arm": job.arms[first], "samples_ms": samples, "warmup_steps": warmups,
            "energy": energy, "energy_note": (note[0] or NO_READING) if None in energy else None}


def run_fresh(job: Job, worker: list[str] | None = None, timeout_s: float = 1800) -> dict:
    """The job in a new process: its result, or {"error": reason}."""
    cmd = (worker or [sys.executable, "-m", "floorline.measure.session"]) + [json.dumps(asdict(job))]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:g} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    return {"error": f"exit code {proc.returncode}" + (f": {lines[-1].strip()}" if lines else "")}


def main(argv: list[str]) -> None:
    data = json.loads(argv[0])
    data["arms"] = tuple(data["arms"])
    try:
        result = run_job(Job(**data))
    except Exception as e:  # reported to the parent as this session's failure
        result = {"error": f"{type(e).__name__}: {one_line(e)}"}
    print(RESULT_TAG + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
