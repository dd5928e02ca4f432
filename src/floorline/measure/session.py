"""Fresh sessions for `ab`: one process, one CUDA context, one model built anew, per session,
through the runner (measure/runner.py): a session that crashes, hangs or prints no result is a
failed session with its reason.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from floorline.measure.cell import Budget, step_budget
from floorline.measure.energy import NO_READING, open_meter
from floorline.measure.runner import TIMEOUT_S, ChildFailed, run_in_child
from floorline.models import resolve_model
from floorline.paths import GraphedSession, open_session, parse_path
from floorline.paths.base import PathSpec
from floorline.timing import StepPlan, run_plan, time_steps, timed_batch, warm_up


@dataclass(frozen=True)
class Job:
    arms: tuple[str, ...]  # one path (unpaired), or two sharing one model and cache (paired)
    model: str
    ctx: int
    device: str
    steps: int  # timed steps per arm
    block: int  # steps per block when two arms alternate
    warmup: int | None  # per arm; None: until steady (floorline.timing)
    seed: int  # this session's: picks the first arm; weights and tokens use `weights_seed`
    weights_seed: int = 0
    trust_remote_code: bool = False


def shared_base(a: str, b: str) -> bool:
    """Two arms can share one session when they differ only by +graphs: the graph replays the
    same step on the same buffers."""
    pa, pb = parse_path(a), parse_path(b)
    return (pa.base, pa.compile) == (pb.base, pb.compile)


def block_order(first: int, rounds: int) -> list[int]:
    """ABBA ABBA ... as arm indices, starting with `first`."""
    second = 1 - first
    return [first, second, second, first] * rounds


def job_budget(job: Job, limit: int | None, graphs: bool) -> Budget:
    """Each arm's warm-up and timed steps (two arms: every block of the timed rounds, which
    may pass `steps`) and the prompt, within the model's `limit` of positions; `graphs`: whether
    an arm captures its step."""
    arms = len(job.arms)
    timed = job.steps if arms == 1 else 2 * -(-job.steps // (2 * job.block)) * job.block
    return step_budget(StepPlan(job.warmup, timed), job.ctx, limit, graphs=graphs, arms=arms)


def run_job(job: Job) -> dict:
    """Runs inside the fresh process: samples per arm, warm-up steps and energy per arm (None
    where not measured, with the reason), and which arm went first."""
    import torch

    model_spec = resolve_model(job.model, job.trust_remote_code)
    specs = [parse_path(a) for a in job.arms]
    rounds = -(-job.steps // (2 * job.block))
    budget = job_budget(job, model_spec.max_context, any(s.graphs for s in specs))
    prompt, plan = budget.prompt, budget.plan
    with torch.no_grad():
        base = PathSpec(specs[0].base, specs[0].compile)
        inner = open_session(base, model_spec, job.device, prompt + budget.decode, job.weights_seed)
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


def job_in_child(**fields) -> dict:
    """run_job inside the runner's child."""
    return run_job(Job(**{**fields, "arms": tuple(fields["arms"])}))


def run_fresh(job: Job, timeout_s: float = TIMEOUT_S) -> dict:
    """The job in a new process: its result, or {"error": reason}."""
    try:
        return run_in_child("floorline.measure.session:job_in_child", asdict(job), timeout_s)
    except ChildFailed as e:
        return {"error": e.reason}
