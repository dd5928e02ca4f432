"""Speculative decoding on the trained model: acceptance, tokens a step and ms per token per
workload and drafter, greedy, each reply checked token for token against plain decoding.

    python bench/speculation.py --model DIR --out bench/results/cpu_speculation.json \
        [--device cpu] [--dtype float32] [--draft lookup --draft DIR2 ...]

Prints a table and writes every figure (with the host's provenance) as JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from floorline.measure.fingerprint import environment
from floorline.measure.host import host_load, host_warning
from floorline.measure.speculation import measure_workload
from floorline.measure.texts import WORKLOADS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--draft", action="append", default=None,
                        help="'lookup' or a draft model's directory (repeatable)")
    parser.add_argument("--draft-tokens", default="auto")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    args = parser.parse_args()
    k = args.draft_tokens if args.draft_tokens == "auto" else int(args.draft_tokens)
    rows = []
    start = host_load(args.device)
    for draft in args.draft or ["lookup"]:
        for workload in args.workloads.split(","):
            r = measure_workload(args.model, workload, draft, draft_tokens=k,
                                 max_new_tokens=args.max_new_tokens, device=args.device,
                                 dtype=args.dtype)
            rows.append(r.as_dict())
            s = r.speculation
            rate = "-" if s.acceptance is None else f"{s.acceptance:.0%}"
            print(f"{s.drafter:>12} {workload:>10}: {s.tokens} tokens, {rate} of drafts kept, "
                  f"{s.tokens_per_step:.2f} tokens a step, {r.ms_per_token:.2f} ms/token against "
                  f"{r.plain_ms_per_token:.2f} plain ({r.speedup:.2f}x), identical "
                  f"{r.identical}/{r.prompts}", flush=True)
    end = host_load(args.device, since=start)
    warning = host_warning(start, end)  # timings on a busy host are slower and noisier
    if warning:
        print(f"busy host: {warning}")
    args.out.write_text(json.dumps({"model": args.model, "device": args.device,
                                    "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
                                    "environment": environment(args.device),
                                    "host_load": {"start": start, "end": end},
                                    "host_warning": warning, "results": rows},
                                   indent=1) + "\n")


if __name__ == "__main__":
    main()
