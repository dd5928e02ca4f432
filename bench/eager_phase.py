"""transformers' eager step, step by step after the prompt: whether it changes after its first
steps, and what changes with it.

On a lent H100 every `hf-eager` cell of the study's models ran 54-59 ms a step up to its 64th
step, where a cell first rewinds its cache, and 18-22 ms after it (bench/results/h100-hostcheck/).
Here each schedule runs in a session of its own, built and prefilled afresh, its steps timed one
by one between CUDA events:

  none      no rewind: STEPS steps in a row
  every64   rewound 64 positions after every 64 steps, as a sweep's cells are
  at16      one rewind of 16 positions after step 16, then the rest in a row

and `hf-static` under `none` as the control. Beside each block of 16 steps: its median step, the
CUDA caching allocator's calls to the driver over the block (cudaMalloc and cudaFree, and its
retries after a failed allocation), and the synchronising operations the step issued (PyTorch's
sync debug mode, counted over the block's first step). Then the time of one cudaMalloc of the
allocator's 20 MiB segment on this machine.

The candidate it tests: a DynamicCache grows its tensors by a token a step, so each step asks
the allocator for blocks larger than any it holds free, and it takes new segments from the
driver; after a rewind the requests are smaller than the blocks freed before, and fit. Run it
again under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, which grows segments in place.

    PYTHONPATH=src python bench/eager_phase.py [--model qwen2.5-7b] [--ctx 2048] [--steps 192]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings

import torch

from floorline.errors import FloorlineError
from floorline.models import resolve_model
from floorline.paths import REGISTRY

BLOCK = 16
# (after how many steps, how often) a schedule rewinds that many positions
SCHEDULES = {"none": None, "every64": (64, True), "at16": (16, False)}


def allocator() -> dict:
    s = torch.cuda.memory_stats()
    return {k: s.get(k, 0) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}


def syncs_in(step) -> int:
    """The synchronising operations one call of `step` issued."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def run(path: str, model, ctx: int, steps: int, rewind: tuple[int, bool] | None) -> list[dict]:
    session = REGISTRY[path].open(model, "cuda", ctx + steps + BLOCK, 0)
    try:
        session.prefill(ctx)
        torch.cuda.synchronize()
        blocks, done = [], 0
        while done < steps:
            before = allocator()
            syncs = syncs_in(session.step)
            marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                     for _ in range(BLOCK - 1)]
            for start, end in marks:
                start.record()
                session.step()
                end.record()
            torch.cuda.synchronize()
            after = allocator()
            blocks.append({"first_step": done + 1,
                           "median_ms": statistics.median(s.elapsed_time(e) for s, e in marks),
                           "syncs_first_step": syncs,
                           **{k: after[k] - before[k] for k in after}})
            done += BLOCK
            if rewind is not None and (done == rewind[0] or rewind[1] and done % rewind[0] == 0):
                session.rewind(rewind[0])
        return blocks
    finally:
        session.close()


def segment_us(n: int = 16) -> float:
    """The median time of one new 20 MiB segment from the driver (sizes no free block fits)."""
    held, times = [], []
    for i in range(n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        held.append(torch.empty((20 << 20) + (i + 1) * (1 << 20), dtype=torch.uint8,
                                device="cuda"))
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-7b")
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=192)
    parser.add_argument("--json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("eager_phase: no CUDA GPU here; it times transformers' step on one")
    try:
        model = resolve_model(args.model)
    except FloorlineError as e:
        sys.exit(f"eager_phase: {e}")
    runs = {f"hf-eager {name}": run("hf-eager", model, args.ctx, args.steps, rewind)
            for name, rewind in SCHEDULES.items()}
    runs["hf-static none"] = run("hf-static", model, args.ctx, args.steps, None)
    print(f"{args.model} at ctx {args.ctx}, {torch.cuda.get_device_name()}: median ms of each "
          f"block of {BLOCK} steps [cudaMalloc, cudaFree, retries; syncs in its first step]")
    for name, blocks in runs.items():
        print(f"{name:16}", " ".join(
            f"{b['median_ms']:.1f}[{b['num_device_alloc']},{b['num_device_free']},"
            f"{b['num_alloc_retries']};{b['syncs_first_step']}]" for b in blocks))
    segment = segment_us()
    print(f"a new segment from the driver (20-36 MiB): {segment:.0f} us, the median of 16")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "ctx": args.ctx, "runs": runs,
                       "segment_us": segment}, f, indent=1)


if __name__ == "__main__":
    main()
