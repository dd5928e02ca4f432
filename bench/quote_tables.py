"""The README's and the docs' quoted figures, generated from the committed databases: each
figure the median over every run of its cell in one provenance class, with its range and N, or
marked as one run (floorline.report.quotes).

    python bench/quote_tables.py           # say which blocks differ from the data (exit 1)
    python bench/quote_tables.py --write   # rewrite them
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from floorline.report.quotes import joules_per_token, mismatches, ms, of_floor, quote, render
from floorline.stats import percent
from floorline.store import Store

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "bench" / "results"
# The headline: Qwen2.5-7B at ctx 2048, every path in one table. Each path is quoted from the
# first database of its GPU that holds a valid run of it (paths under bench/results/); a path no
# database of a GPU holds is not measured there.
HEADLINE = ("qwen2.5-7b", 2048)
HEADLINE_PATHS = ("hf-eager", "hf-static+graphs", "hf-static+compile+graphs", "llamacpp-bf16",
                  "engine", "engine-fp8", "engine-int4", "engine-int4-fp8head", "llamacpp-q4_0")
HEADLINE_SOURCES = {
    "h200": ("h200-engine-runs/h200_engine_runs.db", "h200-engine-quant/h200_engine_quant.db",
             "h200-engine-energy/h200_engine_energy.db", "h200-study/h200.db"),
    # the study's database of this GPU (bench/study.sh) first
    "h100-sxm5": ("h100-study/h100.db", "h100-fp8-dots/h100_engine_fp8dots.db",
                  "h100-rows/h100_engine_verify.db", "h100-verify/h100_engine_verify.db"),
}
GPU_NAMES = {"h200": "H200", "h100-sxm5": "H100 SXM"}


def rows_of(name: str, results: Path):
    store = Store(results / name, read_only=True)
    try:
        return store.rows(latest=False), store.runs()
    finally:
        store.close()


def describe_class(runs: list[dict], quoted: list) -> str:
    """The code a class of runs timed: the commit (or the source hash) and the kernels' hash;
    for rows from before runs were recorded, when they were measured."""
    ids_runs = {r.run_id for r in quoted}
    facts = {f"a run of {r.finished_at[:10]}, before provenance was recorded" for r in quoted
             if r.run_id is None}
    for run in runs:
        if run["id"] not in ids_runs:
            continue
        code = run["provenance"].get("code")
        if code is None:
            facts.add(f"an older run ({run['options'].get('merged_from', 'no provenance')})")
        else:
            code_id = (f"commit {code['commit'][:12]}" if code["commit"]
                       else f"source {code['source_sha256'][:12]}")
            facts.add(f"{code_id}{' (modified)' if code['dirty'] else ''}, kernels "
                      f"{code['kernels_sha256'][:12]}")
    return "; ".join(sorted(facts))


def headline(gpus: tuple[str, ...], results: Path = RESULTS) -> str:
    """The headline's table for `gpus`: a row per path and GPU, with its provenance."""
    sources = {gpu: [rows_of(source, results) for source in HEADLINE_SOURCES[gpu]]
               for gpu in gpus}
    lines = ["| path | GPU | ms/step | of the floor | J/token | from |",
             "|---|---|---|---|---|---|"]
    for path in HEADLINE_PATHS:
        for gpu in gpus:
            lines.append(headline_row(path, gpu, sources[gpu]))
    return "\n".join(lines) + "\n"


def headline_row(path: str, gpu: str, sources: list) -> str:
    model, ctx = HEADLINE
    name = GPU_NAMES[gpu]
    for rows, runs in sources:
        mine = [r for r in rows if r.gpu == gpu]
        step = quote(mine, model, ctx, path, ms)
        if step is None:
            continue
        fraction = quote(mine, model, ctx, path, of_floor, step.klass)
        energy = quote(mine, model, ctx, path, joules_per_token, step.klass)
        quoted = [r for r in mine if r.id in step.ids]
        return (f"| {path} | {name} | {step.text('.2f')} | {percent(fraction.value)} | "
                f"{energy.text('.2f') if energy else '-'} | {describe_class(runs, quoted)} |")
    measured = any((r.gpu, r.model, r.ctx, r.path) == (gpu, model, ctx, path)
                   for rows, _ in sources for r in rows)
    return f"| {path} | {name} | {'no steady run' if measured else 'not measured'} | | | |"


def energy_check(results: Path = RESULTS) -> str:
    """The energy counter's cross-check (bench/energy_check.py): per window length, J/token
    read on the counter's updates against the power readings and the naive edges."""
    d = json.loads((results / "h200-energy-check" / "h200_energy_check.json").read_text())
    lines = [f"The counter of the {d['gpu']} updated every {d['busy']['update_period_ms']:.0f} ms "
             f"under decode and {d['idle']['update_period_ms']:.0f} ms idle ({d['model']}, ctx "
             f"{d['ctx']}, the engine's step {d['step_ms']:.2f} ms; one run, each length three "
             "windows in turn, later windows at later positions):", "",
             "| window read at its edges | J/token there (3 windows) | highest W there "
             "| window aligned on updates | J/token there (3 windows) | counter W "
             "| power readings W | bound |",
             "|---|---|---|---|---|---|---|---|"]
    for row in d["by_window"]:
        a, naive = row["aligned"], row["naive"]
        j = [w["joules_per_token"] for w in a["windows"]]
        nj = [n["joules_per_token"] for n in naive]
        sampled = f"{a['sampled_watts']:.0f}" if a["sampled_watts"] else "none inside"
        seconds = a["seconds"] / len(a["windows"])
        lines.append(f"| {row['window_s']:g} s | {min(nj):.3f}-{max(nj):.3f} | "
                     f"{max(n['mean_watts'] for n in naive):.0f} | {seconds:.2f} s | "
                     f"{min(j):.3f}-{max(j):.3f} | {a['mean_watts']:.0f} | {sampled} | "
                     f"{a['error_bound']:.2%} |")
    return "\n".join(lines) + "\n"


def explain_h100(results: Path = RESULTS) -> str:
    """`floorline explain` of the engine's step on the H100 (bench/gpu_check.sh's run): each
    cell's split, its attention kernels, and its fixed cost per layer."""
    store = Store(results / "h100-check" / "h100_explain.db", read_only=True)
    try:
        explained = store.explanations()
    finally:
        store.close()
    lines = ["| model, ctx (one run each) | ms/step | floor | lost in matrix-vector and "
             "attention kernels | other kernels | launch and idle | attention kernels' time | "
             "beyond the floor, per layer | kernels a layer |",
             "|---|---|---|---|---|---|---|---|---|"]
    for e in explained:
        d, layer = e["decomposition"], e["per_layer"]
        lines.append(f"| {e['model']}, {e['ctx']} | {d['median_ms']:.3f} | {d['floor_ms']:.3f} | "
                     f"{d['lost_in_kernels_ms']:.3f} | {d['other_kernels_ms']:.3f} | "
                     f"{d['launch_and_idle_ms']:.3f} | {e['classes']['attention']['ms']:.3f} | "
                     f"{layer['fixed_us']:.1f} us | {layer['kernels']:.1f} |")
    return "\n".join(lines) + "\n"


def blocks(results: Path = RESULTS) -> dict[Path, dict[str, str]]:
    """Each document's quoted blocks, by name."""
    energy, explained = energy_check(results), explain_h100(results)
    return {ROOT / "README.md": {"headline-gpus": headline(tuple(HEADLINE_SOURCES), results),
                                 "energy-check": energy, "explain-h100": explained},
            ROOT / "docs" / "results-h200.md": {"headline": headline(("h200",), results),
                                                "energy-check": energy},
            ROOT / "docs" / "results-h100.md": {"explain-h100": explained}}


def main(argv: list[str]) -> int:
    wrong = []
    for doc, made in blocks().items():
        text = doc.read_text()
        if "--write" in argv:
            doc.write_text(render(text, made))
        else:
            wrong += [f"{doc.relative_to(ROOT)}: {m}" for m in mismatches(text, made)]
    for line in wrong:
        print(line)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
