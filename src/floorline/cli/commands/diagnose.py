"""Where the time goes: `probe` measures the card's ceilings (bandwidth, launch cost) and
`explain` decomposes one cell's step with the profiler."""

from __future__ import annotations

import json
from dataclasses import asdict
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
    STEPS_MAX,
    TIMEOUT_OPTION,
    TRUST_OPTION,
    WARMUP_OPTION,
    check_device,
    one_context,
    parse_count,
    parse_timeout,
    resolve_gpu,
)
from floorline.cli.render import num, out
from floorline.measure.explain import check_context, explain_into
from floorline.measure.fingerprint import environment
from floorline.measure.probe import check_buffer, probe_into
from floorline.measure.runner import ChildFailed
from floorline.measure.runs import open_run
from floorline.models import model_label, resolve_model
from floorline.paths import parse_path, require_available
from floorline.records import key_warmup


@interruptible("nothing was stored")
def probe(
    model: Annotated[str | None, typer.Option(
        help="Also GEMV bandwidth at this model's layer shapes, and the host's time for one of "
             "its layers in transformers' eager and static paths.")] = None,
    db: DB_OPTION = Path("floorline.db"),
    device: DEVICE_OPTION = None,
    buffer_mib: Annotated[int, typer.Option(
        min=1, help="Size of each streamed buffer, MiB.")] = 1024,
    trust_remote_code: TRUST_OPTION = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the figures as JSON.")] = False,
    label: LABEL_OPTION = None,
) -> None:
    """Measured bandwidth and launch cost of this card, stored beside the cells."""
    device = check_device(device)
    check_buffer(device, buffer_mib)
    model_spec = resolve_model(model, trust_remote_code) if model is not None else None
    env = environment(device)
    store = open_run(db, "probe", {"model": model, "device": device, "buffer_mib": buffer_mib,
                                   "trust_remote_code": trust_remote_code}, env, label)
    results = probe_into(store, device, env, model_spec, buffer_mib)
    store.end_run()
    if as_json:
        print(json.dumps(results, indent=2))
        return
    table = Table("figure", "value", title=escape(f"probe of {env['device']}: {results['method']}"))
    table.add_row("streaming read", f"{results['stream_read_gbps']:.0f} GB/s")
    table.add_row("device copy (read + write)", f"{results['copy_gbps']:.0f} GB/s")
    table.add_row("launch, eager PyTorch", f"{results['eager_us']:.2f} us/kernel")
    for label, key, unit in (("launch, inside a CUDA graph", "graph_us", "us/kernel"),
                             ("host synchronisation", "sync_us", "us")):
        value = results[key]
        table.add_row(label, "n/a without CUDA" if value is None else f"{value:.2f} {unit}")
    for shape, gbps in results.get("gemv_gbps", {}).items():
        table.add_row(f"GEMV {shape} bf16", f"{gbps:.0f} GB/s")
    for path, host in results.get("host_layer", {}).items():
        table.add_row(f"{path}, the host's time for a layer of {results['model']}",
                      escape(host["reason"]) if "reason" in host else
                      f"{host['layer_us']:.0f} us (the rest of a step {host['step_us']:.0f} us)")
    out.print(table)


@interruptible("nothing was stored")
def explain_cmd(
    model: Annotated[str, typer.Option(help="Shipped name or local directory.")] = "qwen2.5-7b",
    ctx: Annotated[str, typer.Option(help="Context length.")] = "2048",
    path: Annotated[str, typer.Option(help="Path, e.g. hf-static+graphs.")] = "hf-eager",
    steps: Annotated[int, typer.Option(
        min=1, max=STEPS_MAX, help="Steps timed, then profiled.")] = 16,
    warmup: WARMUP_OPTION = "auto",
    db: DB_OPTION = Path("floorline.db"),
    device: DEVICE_OPTION = None,
    gpu: GPU_OPTION = None,
    timeout: TIMEOUT_OPTION = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the figures as JSON.")] = False,
    label: LABEL_OPTION = None,
) -> None:
    """Where each millisecond of one cell goes: kernels, busy time, gaps, time per class."""
    warmup_count = parse_count(warmup, "--warmup", 0)
    timeout_s = parse_timeout(timeout)
    device = check_device(device)
    context = one_context(ctx, "explain")
    require_available(parse_path(path), device)
    gpu_spec = resolve_gpu(gpu, device)
    check_context(model, context, path, gpu_spec, steps, warmup_count)
    env = environment(device)
    store = open_run(db, "explain", {"model": model, "ctx": context, "path": path,
                                     "steps": steps, "warmup": key_warmup(warmup_count),
                                     "device": device, "gpu": asdict(gpu_spec),
                                     "timeout_s": timeout_s}, env, label)
    try:
        result = explain_into(store, env, model, context, path, device, gpu_spec, steps,
                              warmup_count, timeout_s=timeout_s)
        store.end_run()
    except ChildFailed as e:
        fail(f"explaining {path} at ctx {context} failed: {e.reason}")
    if as_json:
        print(json.dumps(result, indent=2))
        return
    d = result["decomposition"]
    unit = "kernels" if device.startswith("cuda") else "aten operators"
    parts = Table("part of a step", "ms", "share",
                  title=escape(f"{model_label(result['model'])} ctx {result['ctx']} "
                               f"{result['path']} on {result['gpu']}: "
                               f"{d['median_ms']:.3f} ms/step, "
                               f"{result['kernels_per_step']:.0f} {unit}/step"))
    for label, key in (("floor (bytes / datasheet bandwidth)", "floor_ms"),
                       ("bandwidth lost in matrix-vector and attention kernels",
                        "lost_in_kernels_ms"),
                       ("the rest of the kernels (norms, rotary, elementwise, sampling)",
                        "other_kernels_ms"),
                       ("launch and idle (median less kernel time)", "launch_and_idle_ms")):
        parts.add_row(label, f"{d[key]:.3f}", f"{d[key] / d['median_ms']:.1%}")
    out.print(parts)
    layer = result["per_layer"]
    out.print(f"per layer ({layer['layers']} layers, {layer['kernels']:.1f} {unit} each): "
              f"{layer['fixed_us']:.1f} us beyond the floor = "
              f"{layer['lost_in_kernels_us']:.1f} bandwidth lost in kernels + "
              f"{layer['other_kernels_us']:.1f} other kernels + "
              f"{layer['launch_and_idle_us']:.1f} launch and idle", highlight=False)
    out.print(f"under the profiler the step's timeline stretched to "
              f"{d['profiled_timeline_ms']:.3f} ms ({d['profiler_us_per_kernel']:.2f} us more "
              f"per {unit[:-1]}; {unit} busy {d['busy_union_ms']:.3f} ms of it)",
              highlight=False)
    if d["profiler_scale"] != 1.0:
        why = ("the profiler stretches host operators as much as the gaps between them"
               if unit != "kernels" else
               "under the profiler the kernels alone were busy for longer than the "
               "unprofiled step")
        out.print(f"the {unit}' times above are the profiled ones x {d['profiler_scale']:.3f} "
                  f"(the unprofiled median over the profiled timeline): {why}",
                  highlight=False)
    classes = Table("class", f"{unit}/step", "ms/step", "MB/step", "GB/s")
    for cls, row in result["classes"].items():
        classes.add_row(cls, f"{row['kernels_per_step']:.1f}", f"{row['ms']:.3f}",
                        num(row["bytes"] and row["bytes"] / 1e6, ".1f"), num(row["gbps"], ".0f"))
    out.print(classes)
