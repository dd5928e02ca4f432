"""Whether a cell's timed steps are steady enough to report as its figures.

Three bounds, each chosen from the cells committed under bench/results/ (201 distinct valid GPU
cells measured on H200s, 6 on a CPU). Where the GPU runs a step's kernels back to back (the
engine's paths, CUDA graphs, llama.cpp: 158 cells) the worst drift was 0.90 and the worst spread
0.11, both from cells timed after only 8 warm-up steps; the paths that launch each kernel from
Python (hf-eager, hf-static and the quantised paths without +graphs: 43 cells) time the host as
much as the GPU, and on a busy host drifted from 0.63 to 1.81 and spread up to 0.75. The bounds
flag 13 of those 43 and none of the 158 (nor any of the 315 such cells in every version of those
databases in the repository's history, whose worst were a drift of 1.12 and a spread of 0.20);
a CPU demo on a loaded host stored 0.74 ms with p10-p90 0.59-225 ms and a drift of 261, which
both bounds flag.
"""

from __future__ import annotations

from floorline.interruptions import describe
from floorline.timing import MAX_TOLERANCE, TOLERANCE, WINDOW

# Drift: the median of the last quarter of the timed steps over that of the first
# (timing.drift). A step 25% slower by the end of its timing than at its start, or 20% faster,
# has no single time: outside 1/MAX_DRIFT .. MAX_DRIFT (0.8 .. 1.25) the cell is unsteady,
# unless the quarters' own noise could make such a drift (details["drift_noise"],
# timing.drift_noise: a host slow for a while at a time widens it). Of the 477 distinct GPU
# cells of 32 steps or more under bench/results/ this spares one that the bound alone flagged
# (bnb-nf4 on the H200: drift 0.71, noise 0.32); the H100 host's static-cache cell at the
# study's headline (drift 1.30, noise 0.10) stays flagged.
MAX_DRIFT = 1.25
# Spread: (p90 - p10) / median. Above this the middle 80% of the steps spans more than half the
# median: the host interrupted the steps often enough that the median depends on when it did,
# unless the timing went on until the median was settled (`--steps auto` reached its width:
# the median's block-bootstrap interval, which widens with the host's slow swings, is narrow).
MAX_SPREAD = 0.5
# Drift and spread are judged on at least this many timed steps (quarters of 8; `--steps auto`
# times at least 32, a sweep 64 by default): in fewer, one slow step moves a quarter's median or
# the p10-p90, and they say nothing about the host.
MIN_STEPS = 32
# The automatic warm-up's own rule (timing.warm_up): two windows of steps whose medians agree
# within their own noise (TOLERANCE to MAX_TOLERANCE) before its cap; details["steady"] is False
# where they never did (None: a fixed --warmup, which asserts nothing). Except where the model's
# positions cut that cap to two windows (StepPlan.within, near the model's limit): one
# comparison, of a cold window with the next, which three ctx 131072 engine cells in this
# repository's history failed before timing with drift within 1.2% and spread under 3%. There
# the drift and spread bounds decide.

# On the CPU: other processes' share of the host's CPU time while the cell's steps ran (warm-up
# and timing; details["others_cpu"], measure/host.py), beyond the share the cell's threads left
# free (details["spare_cpu"]: none where it runs a thread per core). Above this the steps
# shared their cores with others. On an idle 2-core host others took 0-2% (background daemons);
# a busy-loop on each core, or a test suite beside the sweep, takes 30-50%.
MAX_OTHERS = 0.10

AGAIN = ("Measure it again on an idle host: the next `floorline sweep` measures it again "
         "(`--force` would re-measure the valid cells too)")


def spread(summary: dict) -> float | None:
    """(p90 - p10) / median of a cell's summary; None without one."""
    median, p10, p90 = (summary.get(k) for k in ("median_ms", "p10_ms", "p90_ms"))
    if not median or median <= 0 or p10 is None or p90 is None:
        return None
    return (p90 - p10) / median


def width_reason(details: dict, summary: dict | None) -> str | None:
    """Why a cell timed with `--steps auto` falls short: its median's interval still wider than
    asked at the cap of steps; None where it was reached, or the steps were a fixed count."""
    if details.get("width_reached") is not False:
        return None
    (low, high), median = details["median_ci_ms"], (summary or {}).get("median_ms")
    return (f"--steps auto stopped at its cap of {details['timed_steps']} timed steps with the "
            f"median's 95% interval at {low:.3g}-{high:.3g} ms, {(high - low) / median:.3g} of "
            f"the median {median:.3g} ms, wider than the --rel-width "
            f"{details['steps_rule']['rel_width']:g} asked")


def unsteady_reason(details: dict, summary: dict | None) -> str | None:
    """Why a timed cell is not steady enough to report (its timing's details: Timing.details();
    its summary: stats.summarise), each bound that failed with its figures and what to do, a
    `--steps auto` interval wider than asked first; None where every bound holds."""
    width = width_reason(details, summary)
    failed, longer_warmup = [width] if width else [], False
    cap = (details.get("warmup_rule") or {}).get("cap")
    if details.get("steady") is False and not (cap is not None and cap <= 2 * WINDOW):
        limit = (f" ({cap} steps or {details['warmup_rule'].get('cap_s'):g} s)"
                 if cap is not None and details["warmup_rule"].get("cap_s") else "")
        window_s = details.get("warmup_window_s")
        window = f"{window_s:g} s" if window_s else f"{WINDOW} steps"
        agreeing = (f"no two windows of {window} agreeing within their own noise (at least "
                    f"{TOLERANCE:.0%}, at most {MAX_TOLERANCE:.0%})")
        failed.append(f"the automatic warm-up stopped at its cap{limit} after "
                      f"{details.get('warmup_steps')} steps, {agreeing}")
        longer_warmup = True
    n = (summary or {}).get("n") or details.get("timed_steps") or 0
    d = details.get("drift") if n >= MIN_STEPS else None
    noise = details.get("drift_noise")
    if (d is not None and (d > MAX_DRIFT or d < 1 / MAX_DRIFT)
            and (noise is None or abs(d - 1) > noise)):
        beyond = (f"; its quarters' own noise allows {noise:.2f} either way" if noise is not None
                  else "")
        failed.append(f"its last quarter of timed steps took {d:.3g}x the first quarter's "
                      f"median (drift {d:.3f}, bound {1 / MAX_DRIFT:.2f}-{MAX_DRIFT:.2f}"
                      f"{beyond})")
        longer_warmup = longer_warmup or d < 1  # still getting faster: not yet warm
    s = spread(summary or {}) if n >= MIN_STEPS else None
    settle = ""
    if s is not None and s > MAX_SPREAD and details.get("width_reached") is not True:
        if "steps_rule" not in details:
            settle = (", or time it until its median settles (`--steps auto`, with a "
                      "--rel-width the spread allows)")
        failed.append(f"its p10-p90 {summary['p10_ms']:.3g}-{summary['p90_ms']:.3g} ms spans "
                      f"{s:.0%} of its median {summary['median_ms']:.3g} ms (bound "
                      f"{MAX_SPREAD:.0%})")
    others, spare = details.get("others_cpu"), details.get("spare_cpu") or 0.0
    if others is not None and n >= MIN_STEPS and others > spare + MAX_OTHERS:
        bound = (f"{spare + MAX_OTHERS:.0%}: the {spare:.0%} its threads left free and "
                 f"{MAX_OTHERS:.0%}" if spare else f"{MAX_OTHERS:.0%}")
        failed.append(f"other processes took {others:.0%} of the host's CPU time while its "
                      f"steps ran (bound {bound})")
    if not failed:
        return None
    timed_ms = ((summary or {}).get("mean_ms") or 0) * n
    seen = describe(details.get("interruptions"), timed_ms)
    during = f" While its steps were timed, {seen}." if seen else ""
    warmup = (f", or with a fixed, longer warm-up (`--warmup N`, N above "
              f"{details.get('warmup_steps')})" if longer_warmup else "")
    wider = ", or with a wider --rel-width" if width else ""
    return f"{'; '.join(failed)}.{during} {AGAIN}{warmup}{settle}{wider}."
