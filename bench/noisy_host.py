"""Why a step launched kernel by kernel from Python is noisy on this host, and what a quieter
measuring process does about it.

One process; each path's session is built once and prefilled, then timed in rounds of blocks,
one block per condition in turn, so that the host's slow changes fall on every condition alike:

  default        as a sweep times a step
  gc-frozen      a full collection, then gc.freeze(): the objects of the loaded model out of the
                 collector's reach (collections still run, on what the steps allocate)
  gc-off         the collector disabled while the block runs
  pinned         the measuring thread held on the CPU it was on
  pinned+frozen  both

Beside each block: the same thread's CPU time over the block's wall time (below 1 where the
thread was not running), what interrupted it (floorline.interruptions: collections, preemptions,
moves between CPUs, time waiting for a CPU, the hypervisor's steal), and a fixed piece of
pure-Python work timed a few times just before the block (the host's own speed, no GPU in it).

    python bench/noisy_host.py [--model qwen2.5-7b] [--ctx 2048] [--paths hf-static,hf-eager]
        [--rounds 8] [--block 32] [--json out.json]

Prints, per path and condition: the median step, the p10-p90 spread of all its steps, the
spread of its blocks' medians, the thread's CPU share and the interruptions summed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch

from floorline.interruptions import Interruptions
from floorline.models import resolve_model
from floorline.paths import open_session, parse_path
from floorline.timing import timed_batch

CONDITIONS = ["default", "gc-frozen", "gc-off", "pinned", "pinned+frozen"]


def host_work_ms(repeats: int = 5) -> list[float]:
    """A fixed piece of pure-Python work, timed: the host's speed with no GPU in it."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sum(i * i for i in range(100_000))
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def current_cpu() -> int:
    """The CPU this thread is on (field 39 of /proc/thread-self/stat)."""
    stat = Path("/proc/thread-self/stat").read_text()
    return int(stat.rpartition(")")[2].split()[36])


def block(step, device: str, steps: int, condition: str) -> dict:
    cpus = os.sched_getaffinity(0)
    host = host_work_ms()
    if "frozen" in condition:
        gc.collect()
        gc.freeze()
    if condition == "gc-off":
        gc.disable()
    if "pinned" in condition:
        os.sched_setaffinity(0, {current_cpu()})
    try:
        with Interruptions() as seen:
            wall0, cpu0 = time.perf_counter(), time.thread_time()
            samples = timed_batch(step, device, steps)
            wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
    finally:
        gc.enable()
        gc.unfreeze()
        os.sched_setaffinity(0, cpus)
    return {"condition": condition, "samples_ms": samples, "cpu_share": cpu / wall,
            "host_work_ms": host, "interruptions": seen.details()}


def spread(samples: list[float]) -> float:
    deciles = statistics.quantiles(samples, n=10)
    return (deciles[8] - deciles[0]) / statistics.median(samples)


def summarise(blocks: list[dict]) -> dict:
    steps = [s for b in blocks for s in b["samples_ms"]]
    medians = [statistics.median(b["samples_ms"]) for b in blocks]
    host = [statistics.median(b["host_work_ms"]) for b in blocks]
    total = {k: sum(b["interruptions"][k] or 0 for b in blocks)
             for k in ("gc_ms", "preempted", "migrations", "waiting_ms")}
    stolen = [b["interruptions"]["stolen"] for b in blocks if b["interruptions"]["stolen"]
              is not None]
    return {"median_ms": statistics.median(steps), "spread": spread(steps),
            "block_medians_ms": [min(medians), max(medians)],
            "cpu_share": statistics.median(b["cpu_share"] for b in blocks),
            "host_work_ms": [min(host), statistics.median(host), max(host)],
            "stolen": max(stolen) if stolen else None,
            # the blocks' medians against their thread's CPU share and the host's speed
            "r_cpu_share": correlation(medians, [b["cpu_share"] for b in blocks]),
            "r_host_work": correlation(medians, host), **total}


def correlation(x: list[float], y: list[float]) -> float | None:
    try:
        return statistics.correlation(x, y)
    except statistics.StatisticsError:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--paths", default="hf-static,hf-eager")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = resolve_model(args.model)
    result = {"model": args.model, "ctx": args.ctx, "device": device,
              "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
              "cpus": len(os.sched_getaffinity(0)), "paths": {}}
    steps = args.rounds * len(CONDITIONS) * args.block
    for path in args.paths.split(","):
        with torch.no_grad():
            session = open_session(parse_path(path), spec, device,
                                   args.ctx + args.warmup + steps, 0)
            session.prefill(args.ctx)
            for _ in range(args.warmup):
                session.step()
            blocks = []
            for r in range(args.rounds):
                # each round starts its conditions at another place: no condition always first
                for c in CONDITIONS[r % 5:] + CONDITIONS[:r % 5]:
                    blocks.append(block(session.step, device, args.block, c))
            session.close()
        result["paths"][path] = {"blocks": blocks, "conditions": {
            c: summarise([b for b in blocks if b["condition"] == c]) for c in CONDITIONS}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    print(f"{args.model} ctx {args.ctx} on {result['gpu'] or device}, {result['cpus']} CPUs, "
          f"{args.rounds} rounds of {args.block} steps a condition")
    print(f"{'path':<17}{'condition':<15}{'median':>8}{'spread':>8}{'blocks':>14}{'cpu':>6}"
          f"{'r(cpu)':>7}{'host':>15}{'r(host)':>8}{'gc ms':>7}{'pre':>6}{'mig':>5}"
          f"{'wait':>7}{'steal':>7}")
    for path, p in result["paths"].items():
        for c, s in p["conditions"].items():
            lo, hi = s["block_medians_ms"]
            h = s["host_work_ms"]
            r = [f"{v:.2f}" if v is not None else "-" for v in (s["r_cpu_share"], s["r_host_work"])]
            print(f"{path:<17}{c:<15}{s['median_ms']:8.2f}{s['spread']:8.2f}"
                  f"{lo:7.1f}-{hi:<6.1f}{s['cpu_share']:6.2f}{r[0]:>7}"
                  f"{h[0]:5.1f}/{h[1]:4.1f}/{h[2]:4.1f}{r[1]:>8}{s['gc_ms']:7.1f}"
                  f"{s['preempted']:6d}{s['migrations']:5d}{s['waiting_ms']:7.1f}"
                  f"{'-' if s['stolen'] is None else format(s['stolen'], '.3f'):>7}")


if __name__ == "__main__":
    main()
