"""One cell: model x GPU x context x path, measured against its memory floor."""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass, replace

from floorline.errors import FloorlineError, exception_line, out_of_memory
from floorline.hardware import DeviceSpec
from floorline.measure.energy import NO_READING, open_meter, positions_wanted
from floorline.measure.fingerprint import clocks
from floorline.measure.host import cpu_use, host_load, host_warning, others_share, spare_share
from floorline.measure.reduction import reference_path
from floorline.measure.steadiness import unsteady_reason
from floorline.models import resolve_model
from floorline.paths import REGISTRY, PathUnavailable, open_session, parse_path, unavailable
from floorline.paths.base import GRAPH_WARMUP_STEPS, PathSpec, compile_mode, rewinding
from floorline.records import INVALID, UNSTEADY, VALID, CellKey, CellResult
from floorline.stats import summarise
from floorline.timing import StepPlan, run_plan
from floorline.traffic import floor


def fit_prompt(ctx: int, decode: int, limit: int | None) -> int:
    """Prompt tokens for a cell at `ctx` whose session then runs `decode` steps: ctx, or, where
    that passes the model's limit but ctx does not, fewer, so that the last step takes the
    last position."""
    if limit is None or ctx + decode <= limit:
        return ctx
    if ctx > limit or limit - decode < 1:
        raise FloorlineError(f"context above the model's limit: ctx {ctx} with {decode} decode "
                             f"steps does not fit in {limit} positions")
    return limit - decode


# The positions a rewinding session holds past the prompt (and a graph's warm-up): a timed
# step reads at most this many more than the cell's context, however long the timing.
REWIND_WINDOW = 64


@dataclass(frozen=True)
class Budget:
    plan: StepPlan  # each arm's warm-up and timing, automatic caps cut to fit the model
    prompt: int  # prompt tokens
    decode: int  # the most steps run after the prompt
    graph: int  # of which the graph's warm-up before capture
    energy: int = 0  # more steps for the energy windows (measure/energy.py), on a GPU
    # A session that rewinds (paths/base.py rewinding) every `window` steps after the graph's
    # warm-up holds only those positions, however many steps it runs; None: it holds them all.
    window: int | None = None

    @property
    def positions(self) -> int:
        """The session's capacity: the positions its prompt and steps take."""
        if self.window is not None:
            return self.prompt + self.graph + self.window
        return self.prompt + self.decode + self.energy


@dataclass(frozen=True)
class CellRun:
    """What prepare_cell decided for a cell that can run, passed whole to its process: the path,
    parsed once, and the budget."""
    path: PathSpec
    budget: Budget

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> CellRun:
        budget = data["budget"]
        return cls(PathSpec(**data["path"]),
                   Budget(**{**budget, "plan": StepPlan(**budget["plan"])}))


def step_budget(plan: StepPlan, ctx: int, limit: int | None, *, graphs: bool, arms: int = 1,
                extra: int = 0, rewind: int | None = None) -> Budget:
    """The positions a session needs after its prompt: the graph's warm-up before capture, each
    arm's warm-up (an automatic one at most its cap) and timed steps, and `extra` steps (those a
    profiler runs); with `rewind`, where they are more, the session rewinds and holds that many
    after the graph's warm-up. Where the model's `limit` is short, automatic caps are cut to fit
    first, then the prompt is shortened (fit_prompt)."""
    graph = GRAPH_WARMUP_STEPS if graphs else 0
    steps = arms * (plan.most_warmup + plan.most_steps) + extra
    if rewind is not None and steps > rewind:
        return Budget(plan, fit_prompt(ctx, graph + rewind, limit), graph + steps, graph,
                      window=rewind)
    if limit is not None:
        plan = plan.within((limit - ctx - graph - extra) // arms)
    decode = graph + arms * (plan.most_warmup + plan.most_steps) + extra
    return Budget(plan, fit_prompt(ctx, decode, limit), decode, graph)


def floor_problem(f) -> str | None:
    """Why a floor (traffic.Floor) cannot be measured against: bytes that are not positive come
    only from impossible sizes in a config."""
    if f.weight_bytes <= 0 or f.kv_bytes <= 0:
        return (f"the floor's bytes are not positive (weights {f.weight_bytes}, KV {f.kv_bytes}): "
                f"{f.model}'s config describes an impossible model")
    return None


def check_floor(f):
    """The floor, or one line where its bytes are not positive."""
    problem = floor_problem(f)
    if problem:
        raise FloorlineError(problem)
    return f


def prepare_cell(key: CellKey, model_spec, device: str, gpu: DeviceSpec,
                 seed: int) -> tuple[CellResult, CellRun | None]:
    """The cell of `model_spec` (resolved) before it runs: invalid, with its floor and what it will
    run, and its path and budget; none, and the reason, where it cannot run here (a floor of
    impossible bytes, no room for its steps, a path unavailable). Cheap: no model is built. The
    one place a cell's path is parsed."""
    path_spec = parse_path(key.path)
    path = REGISTRY[path_spec.base]
    cell = CellResult(key, gpu.name, INVALID)
    cell.details = {"seed": seed, "device": device, "peak_source": gpu.source,
                    "real_weights": path.real_weights(model_spec)}
    try:  # a format read from the model's own file (engine-gguf) may have none to read
        cell_floor = floor(model_spec, gpu, key.ctx, path.weight_format, path.kv_dtype)
    except FloorlineError as e:
        cell.reason = str(e)
        return cell, None
    cell.floor = cell_floor.as_dict()
    libraries = path.versions()
    if libraries:
        cell.details["libraries"] = libraries
    if path.reference is not None:
        ref = REGISTRY[path.reference]
        ref_floor = floor(model_spec, gpu, key.ctx, ref.weight_format, ref.kv_dtype)
        cell.details["reference"] = {"path": reference_path(path_spec),
                                     "total_bytes": ref_floor.total_bytes}
    if path_spec.compile:
        cell.details["compile_mode"] = compile_mode(device)
    cell.reason = floor_problem(cell_floor)
    if cell.reason:
        return cell, None
    # Room for the most steps the plan may run; the details say how many cached tokens the
    # first and the last timed step read (the floor counts ctx). Where the path can rewind, its
    # session rewinds every REWIND_WINDOW steps, so that every cell's steps read about ctx
    # tokens however many it times (and a static cache, read whole, is no larger).
    rewind = REWIND_WINDOW if path.rewinds(model_spec) else None
    try:
        budget = step_budget(key.plan, key.ctx, model_spec.max_context, graphs=path_spec.graphs,
                             rewind=rewind)
    except FloorlineError as e:
        cell.reason = str(e)
        return cell, None
    if budget.window is not None:
        cell.details["rewound_every"] = budget.window
    if device.startswith("cuda") and (budget.window is not None or not path.sized_by_capacity):
        # room for the energy windows: what the model's positions leave, the prompt uncut (a
        # rewinding session takes no more positions for them)
        wanted = positions_wanted(cell_floor.floor_ms)
        if budget.window is None and model_spec.max_context is not None:
            wanted = min(wanted, model_spec.max_context - budget.prompt - budget.decode)
        budget = replace(budget, energy=max(0, wanted))
        cell.details["positions_for_energy"] = budget.energy
    cell.details.update(prompt_tokens=budget.prompt, **budget.plan.describe())
    reason = unavailable(path_spec, device)
    if reason is not None:
        cell.reason = f"path unavailable: {reason}"
        return cell, None
    return cell, CellRun(path_spec, budget)


def measure_cell(key: CellKey, device: str, gpu: DeviceSpec, seed: int = 0,
                 trust_remote_code: bool = False) -> CellResult:
    """Prepare and measure one cell in this process (measure_prepared)."""
    model_spec = resolve_model(key.model, trust_remote_code)
    cell, run = prepare_cell(key, model_spec, device, gpu, seed)
    return cell if run is None else measure_prepared(cell, run, model_spec, device, seed)


def measure_prepared(cell: CellResult, run: CellRun, model_spec, device: str,
                     seed: int) -> CellResult:
    """Measure a prepared cell (in the runner's child process): open the path, prefill, warm
    up, time and close; every failure a user can meet comes back as an invalid cell, and a cell
    whose steps were not steady, or whose `--steps auto` interval stayed wider than asked
    (measure/steadiness.py), as an unsteady one, its figures kept. The host's load at its start
    and end is in details["host_load"], and where the host was busy, a sentence in
    details["host_warning"] (measure/host.py)."""
    import torch

    budget, prompt, session = run.budget, run.budget.prompt, None
    load_start = host_load(device)
    try:
        with torch.no_grad():
            session = open_session(run.path, model_spec, device, budget.positions, seed)
            session.prefill(prompt)
            cell.details.update(session.prefill_details())
            meter, note = open_meter(device)
            use = None if device.startswith("cuda") else cpu_use()
            step = session.step if budget.window is None else rewinding(session, budget.window)
            timing = run_plan(step, device, budget.plan, meter, budget.energy)
            if use is not None:
                cell.details.update(others_cpu=others_share(use, cpu_use()),
                                    spare_cpu=spare_share(torch.get_num_threads()))
            cell.details["clocks_after_timing"] = clocks(device)
            record_load(cell, device, load_start)
        cell.samples_ms = timing.samples_ms
        cell.details.update(timing.details(),
                            timed_steps_read=positions_read(budget, timing.warmup_steps,
                                                            len(timing.samples_ms)))
        if timing.energy is not None:
            cell.details["energy"] = timing.energy
        else:
            cell.details["energy_note"] = note or NO_READING
        cell.summary = asdict(summarise(cell.samples_ms))
        cell.reason = unsteady_reason(cell.details, cell.summary)
        cell.status = VALID if cell.reason is None else UNSTEADY
    except Exception as e:  # the cell is lost, not the sweep: record why
        cell.reason = failure_reason(e, "path unavailable")
        if "host_load" not in cell.details:
            record_load(cell, device, load_start)
    finally:
        release(session)
    return cell


def positions_read(budget: Budget, warmup: int, timed: int) -> list[int]:
    """The cached tokens the first and the last of `timed` steps after `warmup` read (the
    fewest and the most, where the session rewound in between)."""
    start = budget.prompt + budget.graph
    offset = warmup if budget.window is None else warmup % budget.window
    if budget.window is not None and offset + timed > budget.window:
        return [start, start + budget.window - 1]
    return [start + offset, start + offset + timed - 1]


def record_load(cell: CellResult, device: str, start: dict) -> None:
    """The host's load at the cell's start and now, and a warning where it was busy."""
    end = host_load(device, since=start)
    cell.details["host_load"] = {"start": start, "end": end}
    warning = host_warning(start, end)
    if warning:
        cell.details["host_warning"] = warning


def failure_reason(e: Exception, unavailable: str) -> str:
    """Why a measurement failed, as its invalid result records it: a path's refusal after
    `unavailable`, a problem the user can fix as its line, anything else by its kind (out of
    memory or error) and line."""
    if isinstance(e, PathUnavailable):
        return f"{unavailable}: {e}"
    if isinstance(e, FloorlineError):
        return str(e)
    kind = "out of memory" if out_of_memory(e) else "error"
    return f"{kind}: {exception_line(e)}"


def release(session) -> None:
    """Close a session (None: none was opened) and give back its memory, the GPU's too."""
    import torch

    if session is not None:
        session.close()
    gc.collect()
    if torch.cuda.is_initialized():  # a CPU cell never starts the GPU's driver just for this
        torch.cuda.empty_cache()
