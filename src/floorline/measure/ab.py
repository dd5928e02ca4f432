"""A/B over fresh sessions: the study's CUDA Graphs experiment, for any two paths.

Paired (the arms share one model and cache, differing only by +graphs): each fresh session
measures both arms in alternating blocks, ABBA..., the first arm drawn from the session's seed.
Unpaired (different bases: different weights or libraries): sessions of A and B run as
separate fresh processes, interleaved, and session i of A is set against session i of B.
Per session: each arm's median ms/step and the ratio ms_a / ms_b. The headline is the mean
ratio with a 95% BCa bootstrap interval over sessions; where both arms' energy was measured
(NVML), so is the ratio of their joules per token.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from floorline.errors import FloorlineError
from floorline.hardware import DeviceSpec, detect
from floorline.measure.energy import energy_problem
from floorline.measure.fingerprint import environment, fingerprint_key
from floorline.measure.runner import TIMEOUT_S
from floorline.measure.runs import open_run
from floorline.measure.session import Job, job_budget, run_fresh, shared_base
from floorline.models import resolve_model
from floorline.paths import parse_path, require_available
from floorline.stats import Interval, mean_interval, summarise


@dataclass(frozen=True)
class Plan:
    a: str
    b: str
    model: str
    ctx: int
    device: str
    gpu: str
    sessions: int = 10
    steps: int = 64
    block: int = 8
    warmup: int | None = None  # None: until steady
    seed: int = 0
    trust_remote_code: bool = False
    timeout_s: float = TIMEOUT_S  # per session process

    @property
    def paired(self) -> bool:
        return shared_base(self.a, self.b)


def valid_joules(e: dict | None) -> float | None:
    """An arm's J/token where its reading passed the energy checks (measure/energy.py)."""
    return e["joules_per_token"] if e and energy_problem(e) is None else None


@dataclass
class SessionResult:
    index: int
    status: str  # "ok" or "failed"
    reason: str | None = None
    first_arm: str | None = None
    samples_a: list[float] = field(default_factory=list)
    samples_b: list[float] = field(default_factory=list)
    warmup_steps: list[int] | None = None  # per arm, a then b
    energy_a: dict | None = None  # measure.energy's result, where measured
    energy_b: dict | None = None
    energy_note: str | None = None  # why not, where an arm has none

    @property
    def ms_a(self) -> float | None:
        return summarise(self.samples_a).median_ms if self.samples_a else None

    @property
    def ms_b(self) -> float | None:
        return summarise(self.samples_b).median_ms if self.samples_b else None

    @property
    def ratio(self) -> float | None:
        return self.ms_a / self.ms_b if self.status == "ok" else None

    @property
    def j_a(self) -> float | None:
        return valid_joules(self.energy_a)

    @property
    def j_b(self) -> float | None:
        return valid_joules(self.energy_b)

    @property
    def energy_ratio(self) -> float | None:
        """Joules per token of a over b, where both were measured."""
        return self.j_a / self.j_b if self.j_a and self.j_b else None

    def as_dict(self) -> dict:
        return {"index": self.index, "status": self.status, "reason": self.reason,
                "first_arm": self.first_arm, "ms_a": self.ms_a, "ms_b": self.ms_b,
                "ratio": self.ratio, "warmup_steps": self.warmup_steps,
                "energy_a": self.energy_a, "energy_b": self.energy_b,
                "energy_ratio": self.energy_ratio, "energy_note": self.energy_note}


@dataclass
class ABSummary:
    plan: Plan
    sessions: list[SessionResult]
    speedup: Interval | None
    ms_a: Interval | None
    ms_b: Interval | None
    energy: Interval | None = None  # joules per token, a over b

    @property
    def ok(self) -> list[SessionResult]:
        return [s for s in self.sessions if s.status == "ok"]

    def sentence(self) -> str:
        p, n = self.plan, len(self.ok)
        if self.speedup is None:
            return f"no session of {p.a} vs {p.b} succeeded ({len(self.sessions)} tried)"
        s = self.speedup
        how = "faster than" if s.estimate >= 1 else "as fast as"
        ci = (f"95% CI {s.low:.3f}-{s.high:.3f}" if s.low is not None
              else "no interval from fewer than 2 distinct sessions")
        failed = len(self.sessions) - n
        return (f"{p.b} is {s.estimate:.3f}x {how} {p.a} ({ci}, N={n} fresh sessions"
                + ("" if p.paired else ", unpaired") + (f", {failed} failed" if failed else "")
                + f"; {p.model}, ctx {p.ctx}, {p.gpu}); " + self.energy_sentence())

    def energy_sentence(self) -> str:
        e = self.energy
        if e is None:
            notes = sorted({s.energy_note for s in self.ok if s.energy_note})
            return "energy per token " + ("; ".join(notes) if notes else "not measured")
        ci = (f"95% CI {e.low:.3f}-{e.high:.3f}" if e.low is not None
              else "no interval from fewer than 2 distinct sessions")
        return (f"energy per token {self.plan.a}/{self.plan.b} {e.estimate:.3f} ({ci}, "
                f"N={e.n} sessions with both arms' energy)")

    def as_dict(self) -> dict:
        p = self.plan
        iv = lambda i: (None, None, None) if i is None else (i.estimate, i.low, i.high)  # noqa: E731
        speedup, ci_low, ci_high = iv(self.speedup)
        (ms_a, ms_a_low, ms_a_high), (ms_b, ms_b_low, ms_b_high) = iv(self.ms_a), iv(self.ms_b)
        energy, energy_low, energy_high = iv(self.energy)
        return {
            "a": p.a, "b": p.b, "model": p.model, "ctx": p.ctx, "gpu": p.gpu, "device": p.device,
            "paired": p.paired, "sessions": len(self.ok), "sessions_requested": p.sessions,
            "failed": len(self.sessions) - len(self.ok), "seed": p.seed,
            "steps": p.steps, "block": p.block, "warmup": p.warmup,
            "speedup": speedup, "ci_low": ci_low, "ci_high": ci_high,
            "ms_a": ms_a, "ms_a_ci": [ms_a_low, ms_a_high],
            "ms_b": ms_b, "ms_b_ci": [ms_b_low, ms_b_high],
            "energy_ratio": energy, "energy_ratio_ci": [energy_low, energy_high],
            "sentence": self.sentence(),
            "per_session": [s.as_dict() for s in self.sessions],
        }


def _job(plan: Plan, arms: tuple[str, ...], seed: int) -> Job:
    return Job(arms, plan.model, plan.ctx, plan.device, plan.steps, plan.block, plan.warmup,
               seed, trust_remote_code=plan.trust_remote_code)


def run_session(plan: Plan, index: int) -> SessionResult:
    """Session `index`: one fresh process (paired) or two, in a seeded random order (unpaired)."""
    seed = plan.seed * 1_000_003 + index
    if plan.paired:
        out = run_fresh(_job(plan, (plan.a, plan.b), seed), plan.timeout_s)
        if "error" in out:
            return SessionResult(index, "failed", out["error"])
        return SessionResult(index, "ok", None, out["first_arm"], *out["samples_ms"],
                             out["warmup_steps"], *out["energy"], out["energy_note"])
    order = [plan.a, plan.b] if random.Random(seed).randrange(2) == 0 else [plan.b, plan.a]
    arms = {}
    for arm in order:
        out = run_fresh(_job(plan, (arm,), seed), plan.timeout_s)
        if "error" in out:
            return SessionResult(index, "failed", f"{arm}: {out['error']}", order[0])
        arms[arm] = out
    a, b = arms[plan.a], arms[plan.b]
    return SessionResult(index, "ok", None, order[0], a["samples_ms"][0], b["samples_ms"][0],
                         a["warmup_steps"] + b["warmup_steps"], a["energy"][0], b["energy"][0],
                         a["energy_note"] or b["energy_note"])


def summarise_sessions(plan: Plan, sessions: list[SessionResult]) -> ABSummary:
    ok = [s for s in sessions if s.status == "ok"]
    if not ok:
        return ABSummary(plan, sessions, None, None, None)
    energy = [s.energy_ratio for s in ok if s.energy_ratio is not None]
    return ABSummary(plan, sessions,
                   mean_interval([s.ratio for s in ok], plan.seed),
                   mean_interval([s.ms_a for s in ok], plan.seed),
                   mean_interval([s.ms_b for s in ok], plan.seed),
                   mean_interval(energy, plan.seed) if energy else None)


def check_plan(plan: Plan) -> None:
    model_spec = resolve_model(plan.model, plan.trust_remote_code)
    specs = {arm: parse_path(arm) for arm in (plan.a, plan.b)}
    for spec in specs.values():
        require_available(spec, plan.device)
    if plan.sessions < 1 or plan.steps < 1 or plan.block < 1:
        raise FloorlineError("sessions, steps and block must be at least 1")
    if plan.warmup is not None and plan.warmup < 0:
        raise FloorlineError("warm-up must be 'auto' or at least 0")
    # A context that leaves no room for a session's steps is refused here.
    for arms in [(plan.a, plan.b)] if plan.paired else [(plan.a,), (plan.b,)]:
        job_budget(_job(plan, arms, 0), model_spec.max_context,
                   any(specs[arm].graphs for arm in arms))


OnSession = Callable[[SessionResult], None]
# Runs the plan's sessions of the given indices, handing each to on_session as it ends; returns
# them in index order (run_sessions here, or a fleet's).
Sessions = Callable[[Plan, list[int], OnSession], list[SessionResult]]


def run_sessions(plan: Plan, indices: list[int], on_session: OnSession) -> list[SessionResult]:
    check_plan(plan)
    sessions = []
    for index in indices:
        result = run_session(plan, index)
        on_session(result)
        sessions.append(result)
    return sessions


def stored_session(row: dict) -> SessionResult:
    """A session as the results database holds it (Store.unfinished_ab); its warm-up and energy
    None where a database from before they were stored lacks them."""
    return SessionResult(row["idx"], row["status"], row["reason"], row["first_arm"],
                         row["samples_a"], row["samples_b"], **(row["details"] or {}))


@dataclass
class Bench:
    """Where an A/B's sessions run: its plan (with the GPU they run on), the environment they
    are stored with, and `run`, which runs sessions of a plan (Sessions)."""

    plan: Plan
    env: dict
    run: Sessions


def here(plan: Plan, gpu: DeviceSpec | None) -> Bench:
    """An A/B's sessions on this machine: the plan checked before its GPU is detected (a CPU's
    by measuring), its GPU `gpu` where one is named."""
    check_plan(plan)
    plan = replace(plan, gpu=(gpu or detect(plan.device)).name)
    return Bench(plan, environment(plan.device), run_sessions)


class Recording:
    """A bench's A/B experiment as a run of the results database `db`, begun when made (its plan
    and `options` recorded with it). With `resume`, an experiment of the same plan in the same
    environment that was cut off (no summary: killed, or its machine lost) is carried on
    instead of a new one begun, its seed adopted where `any_seed` (none was asked for):
    `resumed` is then the sessions it holds, and `plan` the plan with its seed. Sessions are
    seeded by their index, so the sessions run are those an uninterrupted run would have run.
    run() runs the sessions still to run, stores each as it ends and the summary over all of
    them last, and ends the run."""

    def __init__(self, bench: Bench, db: Path, options: dict, label: str | None,
                 resume: bool = False, any_seed: bool = False):
        self.bench, self.key = bench, fingerprint_key(bench.env)
        self.store = open_run(db, "ab", {**bench.plan.__dict__, **options, "resume": resume},
                              bench.env, label)
        self.experiment, self.resumed = None, []
        found = (self.store.unfinished_ab(self._plan_dict(bench.plan), self.key, any_seed)
                 if resume else None)
        if found is not None:
            self.bench = replace(bench, plan=replace(bench.plan, seed=found["plan"]["seed"]))
            self.experiment = found["id"]
            self.resumed = [stored_session(row) for row in found["sessions"]]

    @property
    def plan(self) -> Plan:
        return self.bench.plan

    @staticmethod
    def _plan_dict(plan: Plan) -> dict:
        return {**plan.__dict__, "paired": plan.paired}

    def to_run(self) -> list[int]:
        done = {s.index for s in self.resumed}
        return [i for i in range(self.plan.sessions) if i not in done]

    def run(self, on_session: OnSession | None = None) -> ABSummary:
        plan, store = self.plan, self.store
        if self.experiment is None:
            self.experiment = store.start_ab(self._plan_dict(plan), self.bench.env, self.key)

        def stored(session: SessionResult) -> None:
            store.add_ab_session(self.experiment, session)
            if on_session is not None:
                on_session(session)

        new = self.bench.run(plan, self.to_run(), stored)
        summary = summarise_sessions(plan, sorted(self.resumed + new, key=lambda s: s.index))
        store.finish_ab(self.experiment, summary.as_dict())
        store.end_run()
        return summary
