"""The bytes each class of kernel moves in one step, and what kind of path runs them."""

from __future__ import annotations

from functools import cache

from floorline.errors import FloorlineError
from floorline.hardware import lookup
from floorline.models import resolve_model
from floorline.paths import REGISTRY, parse_path
from floorline.traffic import WEIGHT_FORMATS, count_parameters, floor, kv_heads_and_dim, kv_layout

GPU_GOVERNED, HOST_BOUND = "GPU-governed", "host-bound"
TRANSFORMERS = "transformers"


def family(path: str) -> str:
    """Paths whose attention runs the same kernels over the same cache layout (torch.compile
    generates its own; the engine reads an fp8 cache with kernels of its own)."""
    path_spec = parse_path(path)
    if path_spec.base.startswith("engine"):
        return "engine" + (" fp8 KV" if REGISTRY[path_spec.base].kv_dtype == "engine-fp8" else "")
    if path_spec.base.startswith("llamacpp"):
        return "llama.cpp"
    return TRANSFORMERS + ("+compile" if path_spec.compile else "")


def kind(path: str) -> str:
    """Graph-replayed paths (+graphs, the engine, llama.cpp's own graphs) leave the host one
    launch a step; the others launch every kernel from Python."""
    path_spec = parse_path(path)
    graph_replayed = path_spec.graphs or not family(path).startswith(TRANSFORMERS)
    return GPU_GOVERNED if graph_replayed else HOST_BOUND


def formats(path: str) -> tuple[str, str]:
    p = REGISTRY[parse_path(path).base]
    return p.weight_format, p.kv_dtype


def sixteen_bit(path: str) -> bool:
    """Weights and LM head multiplied as stored, 16 bits each: nothing to unpack."""
    fmt = WEIGHT_FORMATS.get(formats(path)[0])
    return fmt is not None and fmt.bits == 16 and fmt.head_bits == 16


@cache
def parameters(model: str) -> int:
    return count_parameters(resolve_model(model)).total


@cache
def architecture(model: str) -> str:
    """The model's transformers architecture (its config's model_type): what its layer runs."""
    return resolve_model(model).text.model_type


@cache
def layers(model: str) -> int:
    return resolve_model(model).text.num_hidden_layers


@cache
def weight_bytes(model: str, weight_format: str) -> int:
    return floor(resolve_model(model), lookup("h200"), 1, weight_format).weight_bytes


@cache
def attention_bytes(model: str, ctx: int, path: str, kv_dtype: str) -> float:
    """Bytes attention moves at `ctx`. The engine and llama.cpp read the cache as stored (K and
    V per kv head). transformers' attention first repeats K and V to every query head
    (repeat_kv) and attends over them, so its traffic scales with query heads; its static cache
    is attended over its whole capacity, which a sweep sizes to the context."""
    config = resolve_model(model).text
    if not family(path).startswith(TRANSFORMERS):
        return float(floor(resolve_model(model), lookup("h200"), ctx, "bf16", kv_dtype).kv_bytes)
    _, windows = kv_layout(config)
    _, head_dim = kv_heads_and_dim(config)
    heads = config.num_attention_heads
    return float(sum(2 * heads * head_dim * 2 * (ctx if w is None else min(ctx, w))
                     for w in windows))


def check_runnable(model: str, gpu: str, ctx: int, path: str) -> None:
    """One line where no step of `path` can run at `ctx`: a context above the model's positions,
    or every parameter and the KV cache (the floor's bytes) more than the GPU's memory."""
    model_spec, device = resolve_model(model), lookup(gpu)
    limit = model_spec.max_context
    if limit is not None and ctx > limit:
        raise FloorlineError(f"no forecast: ctx {ctx} is above {model}'s {limit} positions "
                             "(max_position_embeddings)")
    f = floor(model_spec, device, ctx, *formats(path))
    if f.total_bytes_all_params > device.memory_gb * 1e9:
        raise FloorlineError(
            f"no forecast: {model} at ctx {ctx} holds {f.total_bytes_all_params / 1e9:.1f} GB "
            f"(weights {(f.total_bytes_all_params - f.kv_bytes) / 1e9:.1f}, KV cache "
            f"{f.kv_bytes / 1e9:.1f}), more than the {device.name}'s {device.memory_gb:g} GB")
