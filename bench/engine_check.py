"""The engine against transformers on the GPU: bf16 logits on the 7B/8B configs (teacher-forced,
one CUDA graph), and float32 greedy agreement on small configs.

    python bench/engine_check.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from floorline.engine.check import compare_with_transformers
from floorline.models import resolve_model

CASES = [  # model, dtype, prompt, steps
    ("tiny-llama", torch.float32, 16, 64),
    ("tiny-qwen2", torch.float32, 16, 64),
    ("tiny-mistral-swa", torch.float32, 250, 64),
    ("llama-3.2-1b", torch.float32, 32, 64),
    ("qwen2.5-1.5b", torch.bfloat16, 32, 32),
    ("qwen2.5-7b", torch.bfloat16, 64, 32),
    ("llama-3.1-8b", torch.bfloat16, 64, 32),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--models", help="comma-separated subset of the cases")
    args = parser.parse_args()
    wanted = set(args.models.split(",")) if args.models else None
    results = []
    for name, dtype, prompt, steps in CASES:
        if wanted and name not in wanted:
            continue
        t0 = time.time()
        r = compare_with_transformers(resolve_model(name), "cuda", dtype, prompt_len=prompt,
                                      steps=steps).summary()
        r["seconds"] = round(time.time() - t0, 1)
        results.append(r)
        extra = (f" | vs fp32: engine {r['engine_vs_fp32_median']:.2e}, transformers "
                 f"{r['hf_vs_fp32_median']:.2e}" if "engine_vs_fp32_median" in r else "")
        print(f"{name:18} {r['dtype']:9} positions {r['positions']:3} rel err median "
              f"{r['median_rel_err']:.2e} max {r['max_rel_err']:.2e} argmax agree "
              f"{r['argmax_agree']}/{r['positions']}{extra} ({r['seconds']} s)", flush=True)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
