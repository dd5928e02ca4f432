"""Where each millisecond of a cell goes, from the PyTorch profiler.

A step's median time (timed without the profiler) splits into:
  floor                       bytes the step must move / datasheet bandwidth
  bandwidth lost in kernels   time of the kernels that move those bytes (matrix-vector products,
                              attention) beyond the floor
  the rest of the kernels     norms, rotary, elementwise, sampling: work the floor does not count
  launch and idle             the median less all kernel time: the device waiting on the host
and, per layer, the fixed cost: the median less the floor, over the model's layers (what a step
costs beyond its bytes, the part that does not shrink with faster memory).

On a GPU, kernels may overlap: programmatic dependent launch starts a kernel while the one
before it finishes, and the waiting kernel's span covers time the earlier one spends. Each
instant of the timeline is given to the kernel that started first among those running
(exclusive()), so the kernels' shares sum to the time the device was busy. The profiler adds a
cost of its own to every kernel, mostly as gaps between them (which the median, timed without
it, does not have; launch and idle is the median less the busy time); where it stretched the
kernels themselves past the unprofiled median, the busy timeline is scaled to the median
(`profiler_scale`), as on the CPU. On the CPU, "kernels" are aten operators (own time) on the
host's timeline, and the profiler stretches them as much as the gaps (both are host work):
there the profiled timeline is always scaled to the unprofiled median.
The cell runs in a fresh process through the runner (measure/runner.py), as a sweep's cells do.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import asdict

from floorline.errors import FloorlineError
from floorline.hardware import DeviceSpec
from floorline.measure.cell import Budget, check_floor, step_budget
from floorline.measure.fingerprint import fingerprint_key
from floorline.measure.runner import TIMEOUT_S, run_in_child
from floorline.models import resolve_model
from floorline.paths import REGISTRY, PathSpec, open_session, parse_path
from floorline.stats import summarise
from floorline.store import Store
from floorline.timing import StepPlan, run_plan
from floorline.traffic import WEIGHT_FORMATS, count_parameters, floor

# First match wins, on the lower-cased kernel (or operator) name.
CLASSES = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "softmax")),
    ("matrix-vector", ("gemv", "gemm", "nvjet", "xmma", "cutlass", "splitk", "_mm", "addmm",
                       "aten::mm", "linear", "matmul", "bmm")),
    ("sampling", ("argmax",)),
    ("norms and rotary", ("rms", "norm", "rsqrt", "rotary", "rope", "cos", "sin", "neg", "pow",
                          "mean")),
    ("elementwise", ()),
)


def classify(name: str) -> str:
    lowered = name.lower()
    for cls, needles in CLASSES:
        if any(n in lowered for n in needles):
            return cls
    return "elementwise"


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping [start, end) intervals."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    return total + (cur_end - cur_start if cur_end is not None else 0.0)


def _events(prof, device: str) -> list[tuple[str, float, float, float]]:
    """(name, start us, end us, own time us) of each device kernel (own: its exclusive() share),
    or each aten operator (own: its time less its children's)."""
    from torch.autograd import DeviceType

    if device.startswith("cuda"):
        return exclusive([(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                          if e.device_type == DeviceType.CUDA])
    return [(e.name, e.time_range.start, e.time_range.end, e.self_cpu_time_total)
            for e in prof.events() if e.name.startswith("aten::")]


def exclusive(spans: list[tuple[str, float, float]]) -> list[tuple[str, float, float, float]]:
    """(name, start, end, share) of kernels that may overlap: each instant belongs to the kernel
    that started first among those running then, so that the shares sum to the union."""
    out, covered = [], float("-inf")
    for name, start, end in sorted(spans, key=lambda e: (e[1], e[2])):
        out.append((name, start, end, max(0.0, end - max(start, covered))))
        covered = max(covered, end)
    return out


FLOOR_CLASSES = ("matrix-vector", "attention")  # the classes that move the floor's bytes


def busy_ms(events, steps: int) -> float:
    """The time the profiled steps kept the device (or host) busy, per step."""
    return union_us([(s, e) for _, s, e, _ in events]) / steps / 1e3


def timeline_ms(events, steps: int) -> float:
    """First start to last end of the profiled steps, per step."""
    return (max(e for _, _, e, _ in events) - min(s for _, s, _, _ in events)) / steps / 1e3


def by_class(events, steps: int, bytes_by_class: dict[str, int],
             scale: float = 1.0) -> dict[str, dict]:
    """Kernels, ms and GB/s of each class per step; `scale` multiplies the profiled times."""
    time_us, count = defaultdict(float), defaultdict(int)
    for name, _, _, own in events:
        cls = classify(name)
        time_us[cls] += own
        count[cls] += 1
    rows = {}
    for cls, _ in CLASSES:
        ms = time_us[cls] / steps / 1e3 * scale
        moved = bytes_by_class.get(cls)
        rows[cls] = {"kernels_per_step": count[cls] / steps, "ms": ms, "bytes": moved,
                     "gbps": moved / (ms * 1e6) if moved and ms > 0 else None}
    return rows


def decompose(classes: dict[str, dict], events, steps: int, median_ms: float,
              floor_ms: float, scale: float = 1.0) -> dict:
    """The median's parts from `classes` (by_class() with the same `scale`)."""
    needed = sum(classes[c]["ms"] for c in FLOOR_CLASSES)
    busy = sum(row["ms"] for row in classes.values())
    timeline = timeline_ms(events, steps)
    return {
        "floor_ms": floor_ms, "lost_in_kernels_ms": needed - floor_ms,
        "other_kernels_ms": busy - needed, "launch_and_idle_ms": median_ms - busy,
        "median_ms": median_ms, "kernel_ms": busy,
        "busy_union_ms": busy_ms(events, steps), "profiled_timeline_ms": timeline,
        "profiler_scale": scale,
        # the profiler's own cost: how much longer the profiled timeline ran, per kernel
        "profiler_us_per_kernel": (timeline - median_ms) * 1e3 / (len(events) / steps),
    }


def profiler_scale(events, steps: int, median_ms: float, device: str) -> float:
    """What the profiled times are multiplied by: 1 on a GPU whose kernels were busy for no
    longer than the unprofiled median (the profiler's cost lay in the gaps); else the median
    over the profiled timeline. A CPU's operators are host work, stretched by the profiler as
    much as the gaps between them, so there it always applies."""
    if device.startswith("cuda") and busy_ms(events, steps) <= median_ms:
        return 1.0
    return median_ms / timeline_ms(events, steps)


def per_layer(d: dict, kernels_per_step: float, layers: int) -> dict:
    """The step's cost beyond its floor per layer, in microseconds, and its parts (the head and
    embedding are shared out over the layers with the rest)."""
    def us(ms):
        return ms * 1e3 / layers
    return {"layers": layers, "kernels": kernels_per_step / layers,
            "fixed_us": us(d["median_ms"] - d["floor_ms"]),
            "lost_in_kernels_us": us(d["lost_in_kernels_ms"]),
            "other_kernels_us": us(d["other_kernels_ms"]),
            "launch_and_idle_us": us(d["launch_and_idle_ms"])}


def split_problem(d: dict) -> str | None:
    """Why a decomposition (decompose()) cannot be shown against the floor: matrix-vector and
    attention kernels faster than the floor, so that their bytes did not all come from memory.
    (Launch and idle cannot come out negative: the busy time is scaled to the median where it
    is longer, profiler_scale().)"""
    if d["lost_in_kernels_ms"] < 0:
        return (f"the matrix-vector and attention kernels took "
                f"{d['floor_ms'] + d['lost_in_kernels_ms']:.3f} ms a step, less than the floor "
                f"of {d['floor_ms']:.3f} ms: their bytes did not all come from memory (a model "
                f"small enough to stay in the cache), so the step cannot be split against the "
                f"floor")
    return None


def budget(path_spec: PathSpec, steps: int, warmup: int | None, ctx: int,
           limit: int | None) -> Budget:
    """Warm-up, the timed steps and as many profiled ones after them, within the model's
    `limit` of positions."""
    return step_budget(StepPlan(warmup, steps), ctx, limit, graphs=path_spec.graphs,
                       extra=steps)


def check_context(model_name: str, ctx: int, path: str, gpu: DeviceSpec, steps: int,
                  warmup: int | None) -> None:
    """One line where the sweep would call this cell invalid: a context (with the steps run
    after it) above the model's positions, or a floor of impossible bytes."""
    model_spec, path_spec = resolve_model(model_name), parse_path(path)
    budget(path_spec, steps, warmup, ctx, model_spec.max_context)
    runtime = REGISTRY[path_spec.base]
    check_floor(floor(model_spec, gpu, ctx, runtime.weight_format, runtime.kv_dtype))


def explain(model_name: str, ctx: int, path: str, device: str, gpu: DeviceSpec,
            steps: int = 16, warmup: int | None = None, seed: int = 0) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    path_spec, model_spec = parse_path(path), resolve_model(model_name)
    runtime = REGISTRY[path_spec.base]
    f = floor(model_spec, gpu, ctx, runtime.weight_format, runtime.kv_dtype)
    fmt = WEIGHT_FORMATS[f.weight_format]  # engine-int4 resolved to the model's group
    *linears, head = count_parameters(model_spec).matrix_shapes
    matrix_bytes = sum(fmt.linear_bytes(o, i) for o, i in linears) + fmt.head_bytes(*head)
    activities = [ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    fit = budget(path_spec, steps, warmup, ctx, model_spec.max_context)
    # Kineto writes its own start and stop lines to stderr unless told otherwise.
    os.environ.setdefault("KINETO_LOG_LEVEL", "99")
    with torch.no_grad():
        session = open_session(path_spec, model_spec, device, fit.prompt + fit.decode, seed)
        try:
            session.prefill(fit.prompt)
            timing = run_plan(session.step, device, fit.plan)
            median = summarise(timing.samples_ms).median_ms
            with profile(activities=activities) as prof:
                for _ in range(steps):
                    session.step()
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
        finally:
            session.close()
    events = _events(prof, device)
    if not events:
        raise RuntimeError("the profiler recorded no kernels")
    scale = profiler_scale(events, steps, median, device)
    classes = by_class(events, steps, {"matrix-vector": matrix_bytes, "attention": f.kv_bytes},
                       scale)
    d = decompose(classes, events, steps, median, f.floor_ms, scale)
    problem = split_problem(d)
    if problem:  # an error, not an explanation: nothing is stored
        raise FloorlineError(problem)
    return {
        "model": model_spec.name, "ctx": ctx, "path": path_spec.name, "gpu": gpu.name,
        "device": device,
        "steps": steps, "warmup_steps": timing.warmup_steps, "steady": timing.steady,
        "kernels_per_step": len(events) / steps,
        "decomposition": d,
        "per_layer": per_layer(d, len(events) / steps,
                               model_spec.config.get_text_config().num_hidden_layers),
        "classes": classes,
    }


def explain_job(gpu: dict, **args) -> dict:
    """explain inside the runner's child."""
    return explain(gpu=DeviceSpec(**gpu), **args)


def explain_in_child(model_name: str, ctx: int, path: str, device: str, gpu: DeviceSpec,
                     steps: int = 16, warmup: int | None = None, seed: int = 0,
                     timeout_s: float = TIMEOUT_S) -> dict:
    """explain in a fresh process; runner.ChildFailed where that process fails."""
    return run_in_child("floorline.measure.explain:explain_job",
                        {"model_name": model_name, "ctx": ctx, "path": path, "device": device,
                         "gpu": asdict(gpu), "steps": steps, "warmup": warmup, "seed": seed},
                        timeout_s)


def explain_into(store: Store, env: dict, model_name: str, ctx: int, path: str, device: str,
                 gpu: DeviceSpec, steps: int = 16, warmup: int | None = None,
                 timeout_s: float = TIMEOUT_S) -> dict:
    """explain_in_child, its result stored beside the cells of environment `env`
    (fingerprint.environment)."""
    result = explain_in_child(model_name, ctx, path, device, gpu, steps, warmup,
                              timeout_s=timeout_s)
    store.add_explanation(result, env, fingerprint_key(env))
    return result
