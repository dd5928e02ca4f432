"""Speculative decoding measured on a workload: each prompt's reply generated without
speculation and with it, greedily, in the same process, the two compared token for token; the
drafter's acceptance, the tokens a step gives, the ms a step and a token of each, and the floor
per token: the floor of one step (a verify step reads the weights and cache a one-token step
reads) over the tokens a step gave."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from floorline.errors import FloorlineError
from floorline.hardware import DeviceSpec
from floorline.measure.cell import failure_reason
from floorline.measure.runner import TIMEOUT_S, ChildFailed, run_in_child
from floorline.measure.texts import WORKLOADS, text_digest
from floorline.models import resolve_model
from floorline.paths import REGISTRY, PathSpec, parse_path, unavailable
from floorline.paths.engine import EnginePath
from floorline.records import (
    AUTO,
    INVALID,
    SPECULATION_FIGURES,
    VALID,
    SpeculationKey,
    SpeculationResult,
)
from floorline.traffic import floor

if TYPE_CHECKING:
    from floorline.engine.speculate import Stats

LOOKUP = "lookup"


def workload_digest(workload: str) -> str:
    return text_digest("\n\x00\n".join(WORKLOADS[workload]))


def speculation_key(model: str, path: str, drafter: str, workload: str,
                    draft_tokens: int | str = AUTO, max_new_tokens: int = 96,
                    dtype: str = "float32") -> SpeculationKey:
    """The key, every part checked: one line for an unknown workload, a path that is not one of
    the engine's (or carries options), a bad draft length or reply cap."""
    from floorline.engine.speculate import check_draft_tokens  # loads torch

    if workload not in WORKLOADS:
        raise FloorlineError(f"unknown workload '{workload}'; workloads: {', '.join(WORKLOADS)}")
    spec = parse_path(path)
    if not isinstance(REGISTRY[spec.base], EnginePath) or spec.name != spec.base:
        engines = [p for p, v in REGISTRY.items() if isinstance(v, EnginePath)]
        raise FloorlineError(f"speculation runs on the engine's own paths ({', '.join(engines)}), "
                             f"not '{path}'")
    check_draft_tokens(draft_tokens)
    if max_new_tokens < 2:
        raise FloorlineError(f"--max-new-tokens must be at least 2 (a reply to speculate on), "
                             f"got {max_new_tokens}")
    return SpeculationKey(model, spec.base, drafter, workload, workload_digest(workload),
                          draft_tokens, max_new_tokens, dtype)


def drafter_source(drafter: str, trust_remote_code: bool = False) -> str:
    """What generate takes as its draft: 'lookup', or the directory of a draft model with
    trained weights (one line for a model without: a drafter needs a checkpoint)."""
    if drafter == LOOKUP:
        return drafter
    spec = resolve_model(drafter, trust_remote_code)
    if not spec.has_real_weights:
        raise FloorlineError(f"draft model {drafter} has no trained weights (a shipped config, "
                             "or a directory without .safetensors): a drafter needs a checkpoint")
    return str(spec.weights_dir)


@dataclass
class WorkloadResult:
    workload: str
    draft_tokens: int | str
    speculation: Stats  # the replies' together; its tokens leave out each prefill's first
    plain_ms_per_token: float  # the decode without speculation, all prompts' tokens together
    ms_per_token: float  # with speculation
    step_ms: float  # with speculation: the decode's time over its steps
    mean_ctx: float  # the positions the speculative steps read, about their mean
    replies: list[dict]  # per prompt: tokens, steps, identical, both decodes' ms
    weight_format: str  # the floor's names for the formats that ran
    kv_format: str

    @property
    def prompts(self) -> int:
        return len(self.replies)

    @property
    def identical(self) -> int:
        return sum(r["identical"] for r in self.replies)

    @property
    def speedup(self) -> float:
        return self.plain_ms_per_token / self.ms_per_token

    def as_dict(self) -> dict:
        return {"workload": self.workload, "draft_tokens": self.draft_tokens,
                "prompts": self.prompts, "identical": self.identical,
                **self.speculation.as_dict(), "plain_ms_per_token": self.plain_ms_per_token,
                "ms_per_token": self.ms_per_token, "step_ms": self.step_ms,
                "speedup": self.speedup, "mean_ctx": self.mean_ctx}


def measure_workload(model: str, workload: str, draft: str, *, draft_tokens: int | str = AUTO,
                     max_new_tokens: int = 96, **options) -> WorkloadResult:
    """`draft` ('lookup' or a draft model's directory) on every prompt of `workload` (a name
    speculation_key checked), greedy; `options` go to generate (device, dtype, weights, ...)."""
    from floorline.engine.generate import generate  # loads torch and Triton
    from floorline.engine.speculate import Stats

    total, replies = None, []
    plain_ms = spec_ms = position_sum = 0.0
    plain_tokens = 0
    for prompt in WORKLOADS[workload]:
        plain = generate(model, prompt, max_new_tokens=max_new_tokens, **options)
        spec = generate(model, prompt, max_new_tokens=max_new_tokens, draft=draft,
                        draft_tokens=draft_tokens, **options)
        if total is None:
            total = Stats(spec.speculation.drafter)
        total.add(spec.speculation)
        steps = spec.decode_steps
        # the steps read from the prompt's end to the reply's: about their mean (it takes
        # them evenly spaced), weighted by steps
        position_sum += steps * (len(spec.prompt_ids) + spec.final_context) / 2
        replies.append({"prompt_tokens": len(spec.prompt_ids), "tokens": spec.steps,
                        "steps": steps, "identical": spec.ids == plain.ids,
                        "plain_decode_ms": plain.decode_ms, "decode_ms": spec.decode_ms})
        plain_ms += plain.decode_ms
        plain_tokens += plain.steps
        spec_ms += spec.decode_ms
    if not total.tokens or not plain_tokens:
        raise FloorlineError(f"workload '{workload}': every reply ended at its first token, so "
                             "there is no decode to measure")
    steps = total.verify_steps + total.plain_steps
    return WorkloadResult(workload, draft_tokens, total, plain_ms / plain_tokens,
                          spec_ms / total.tokens, spec_ms / steps, position_sum / steps, replies,
                          spec.weight_format, spec.kv_format)


def prepare_speculation(key: SpeculationKey, model_spec, device: str, gpu: DeviceSpec,
                        trust_remote_code: bool = False) -> tuple[SpeculationResult, bool]:
    """The measurement before it runs, invalid, and whether it can run: not for random
    weights (what a drafter gets right depends on a trained model's replies), a path that
    cannot run here, or a draft model without trained weights. Cheap: no model is built, and
    the key's path, a base path (speculation_key), is not parsed again."""
    result = SpeculationResult(key, gpu.name, INVALID, details={"device": device,
                                                                 "peak_source": gpu.source})
    if not model_spec.has_real_weights:
        result.reason = ("not measured: random weights (acceptance depends on a trained "
                         "model's replies)")
    elif (reason := unavailable(PathSpec(key.path), device)) is not None:
        result.reason = f"not measured: path unavailable: {reason}"
    else:
        try:
            drafter_source(key.drafter, trust_remote_code)
        except FloorlineError as e:
            result.reason = f"not measured: {e}"
    return result, result.reason is None


def measure_speculation(key: SpeculationKey, device: str, gpu: DeviceSpec,
                        trust_remote_code: bool = False) -> SpeculationResult:
    """Measure one key (in the runner's child process); every failure a user can meet comes
    back as an invalid row with its reason."""
    model_spec = resolve_model(key.model, trust_remote_code)
    result, runnable = prepare_speculation(key, model_spec, device, gpu, trust_remote_code)
    if not runnable:
        return result
    engine = REGISTRY[key.path]
    try:
        if workload_digest(key.workload) != key.texts:
            raise FloorlineError(f"this floorline's '{key.workload}' prompts differ from the ones "
                                 "asked for (their SHA-256): measure it with the floorline "
                                 "that asked")
        drafter = drafter_source(key.drafter, trust_remote_code)
        w = measure_workload(str(model_spec.weights_dir), key.workload, drafter,
                             draft_tokens=key.draft_tokens, max_new_tokens=key.max_new_tokens,
                             device=device, dtype=key.dtype, weights=engine.weights,
                             head=engine.head, kv=engine.kv)
        step_floor = floor(model_spec, gpu, round(w.mean_ctx), w.weight_format,
                           w.kv_format).floor_ms
        figures = {**w.as_dict(), "floor_ms": step_floor,
                   "floor_ms_per_token": step_floor / w.speculation.tokens_per_step}
        result.summary = {k: figures[k] for k in SPECULATION_FIGURES}
        result.details.update(replies=w.replies, weight_format=w.weight_format,
                              kv_format=w.kv_format, drafter_dir=drafter)
        result.status = VALID
    except Exception as e:  # the row is lost, not the command: record why
        result.reason = failure_reason(e, "not measured")
    return result


def speculation_job(key: dict, device: str, gpu: dict, trust_remote_code: bool) -> dict:
    """measure_speculation inside the runner's child."""
    return measure_speculation(SpeculationKey(**key), device, DeviceSpec(**gpu),
                               trust_remote_code).as_dict()


def run_speculation_in_child(key: SpeculationKey, device: str, gpu: DeviceSpec,
                             trust_remote_code: bool = False,
                             timeout_s: float = TIMEOUT_S) -> SpeculationResult:
    """One key measured in a fresh process; one that cannot be measured here is invalid without
    one, and a child that fails makes an invalid row naming the cause."""
    result, runnable = prepare_speculation(key, resolve_model(key.model, trust_remote_code),
                                           device, gpu, trust_remote_code)
    if not runnable:
        return result
    args = {"key": asdict(key), "device": device, "gpu": asdict(gpu),
            "trust_remote_code": trust_remote_code}
    try:
        return SpeculationResult.from_dict(run_in_child(
            "floorline.measure.speculation:speculation_job", args, timeout_s))
    except ChildFailed as e:
        result.reason = f"the measurement's process failed: {e.reason}"
        return result
