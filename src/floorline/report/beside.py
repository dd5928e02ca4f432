"""The study's published figures beside this database's measurement of the same cell or A/B:
ms per step over the runs of one provenance class (report/quotes.py), the fraction of the floor
under the study's convention (every parameter's bytes), or "not measured"."""

from __future__ import annotations

from floorline.forecast.published import published_cells
from floorline.report.quotes import ms, quote
from floorline.store import CellRow
from floorline.study import study

NOT_MEASURED = "not measured"
# The study's A/B by floorline's paths: its eager and CUDA-graphed steps are transformers' static
# cache without and with graphs, as `floorline ab` runs the experiment.
AB_PATHS = {("eager", "CUDA graphs"): ("hf-static", "hf-static+graphs")}


def every_param_fraction(row: CellRow) -> float | None:
    """The floor of every parameter's bytes over the step, the study's fraction of the floor."""
    if row.floor_ms_all_params is None or not row.median_ms:
        return None
    return row.floor_ms_all_params / row.median_ms


def where_the_step_goes(explanations: list[dict], key: tuple) -> str | None:
    """The newest explain of the cell `key` (GPU, model, ctx, path) in a few words: how long
    the GPU was busy in the step, and the time launching and idle per kernel, which is the
    host's where a path launches each kernel from Python; None without one."""
    mine = [e for e in explanations if (e["gpu"], e["model"], e["ctx"], e["path"]) == key
            and e.get("kernels_per_step") and "busy_union_ms" in e.get("decomposition", {})]
    if not mine:
        return None
    e = max(mine, key=lambda e: e["id"])
    d = e["decomposition"]
    return (f"explain {e['id']}: the GPU busy {d['busy_union_ms']:.2f} ms of "
            f"{d['median_ms']:.2f}; {d['launch_and_idle_ms']:.2f} ms launching and idle over "
            f"{e['kernels_per_step']:.0f} kernels, "
            f"{d['launch_and_idle_ms'] * 1e3 / e['kernels_per_step']:.1f} us each")


def cells(rows: list[CellRow], explanations: list[dict]) -> list[list]:
    """Per published cell: GPU, model, ctx, path, the study's ms and fraction (where it
    published one), this database's ms (median over runs) and fraction, or not measured, and
    where this database's step goes by its explain, where it has one."""
    fractions = {(r["gpu"], r["model"], r["ctx"], r["path"]): r["value"]
                 for r in study()["fraction_of_floor"]}
    out = []
    for ref in published_cells(study()):
        key = (ref["gpu"], ref["model"], ref["ctx"], ref["path"])
        mine = [r for r in rows if r.gpu == ref["gpu"]]
        step = quote(mine, ref["model"], ref["ctx"], ref["path"], ms)
        fraction = step and quote(mine, ref["model"], ref["ctx"], ref["path"],
                                  every_param_fraction, step.klass)
        out.append([*key, ref["published_ms"], fractions.get(key),
                    step.text(".2f") if step else NOT_MEASURED,
                    fraction.value if fraction else None,
                    where_the_step_goes(explanations, key) if step else None])
    return out


def ab(experiments: list[dict]) -> list[list]:
    """Per published A/B: GPU, ctx, the arms as the study names them and as floorline runs
    them, the study's speedup with its interval, and the newest of this database's A/Bs of the
    same arms, GPU and context, or not measured."""
    out = []
    for r in study()["ab"]:
        a, b = AB_PATHS[(r["a"], r["b"])]
        mine = [e for e in experiments if (e["a"], e["b"], e["gpu"], e["ctx"]) == (a, b, r["gpu"],
                                                                                  r["ctx"])
                and e.get("speedup")]
        published = f"{r['speedup']:.3f}x" + (
            f" ({r['ci_low']:.3f}-{r['ci_high']:.3f}, N={r['sessions']})"
            if r["ci_low"] is not None else " (no interval published)")
        here = NOT_MEASURED
        if mine:
            e = max(mine, key=lambda e: e["id"])
            here = (f"{e['speedup']:.3f}x ({e['ci_low']:.3f}-{e['ci_high']:.3f}, "
                    f"N={e['sessions']}; {e['model']})")
        out.append([r["gpu"], r["ctx"], f"{r['a']} vs {r['b']} ({a} vs {b})", published, here])
    return out
