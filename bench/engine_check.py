"""The engine against transformers on the GPU: bf16 logits on the 7B/8B configs (teacher-forced,
one CUDA graph), and float32 greedy agreement on small configs. --quantised runs the int4 and
fp8 cases instead: transformers on the dequantised weights, the quantisation error beside it.
--families runs Qwen3, Gemma 3 and Phi-4-mini at their real shapes, with prompts that cross
Gemma's sliding windows and Phi-4-mini's original length (where its LongRoPE factors switch),
and an int4 and an fp8 case.

    python bench/engine_check.py [--quantised | --families] [--models a,b] [--prompt N] \
        [--json out.json]

--prompt sets every chosen case's prompt length (a long context: --models llama-3.1-8b
--prompt 32704 checks the 64 positions after a 32k prompt).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from floorline.engine.check import compare_with_transformers
from floorline.models import resolve_model

CASES = [  # model, dtype, prompt, steps, weights, head
    ("tiny-llama", torch.float32, 16, 64, "bf16", "bf16"),
    ("tiny-qwen2", torch.float32, 16, 64, "bf16", "bf16"),
    ("tiny-mistral-swa", torch.float32, 250, 64, "bf16", "bf16"),
    ("llama-3.2-1b", torch.float32, 32, 64, "bf16", "bf16"),
    ("qwen2.5-1.5b", torch.bfloat16, 32, 32, "bf16", "bf16"),
    ("qwen2.5-7b", torch.bfloat16, 64, 32, "bf16", "bf16"),
    ("llama-3.1-8b", torch.bfloat16, 64, 32, "bf16", "bf16"),
]
FAMILIES = [
    ("qwen3-0.6b", torch.float32, 32, 64, "bf16", "bf16"),
    ("gemma-3-1b", torch.float32, 480, 64, "bf16", "bf16"),  # window 512
    ("qwen3-8b", torch.bfloat16, 64, 32, "bf16", "bf16"),
    ("gemma-3-4b", torch.bfloat16, 1000, 32, "bf16", "bf16"),  # window 1024
    ("gemma-3-12b", torch.bfloat16, 1000, 32, "bf16", "bf16"),
    ("phi-4-mini", torch.bfloat16, 4080, 32, "bf16", "bf16"),  # original length 4096
    ("qwen3-8b", torch.bfloat16, 64, 32, "int4", "fp8"),
    ("gemma-3-12b", torch.bfloat16, 64, 32, "fp8", "bf16"),
]
QUANTISED = [
    ("llama-3.2-1b", torch.float32, 32, 64, "int4", "bf16"),
    ("qwen2.5-1.5b", torch.float32, 32, 64, "fp8", "bf16"),
    ("qwen2.5-7b", torch.bfloat16, 64, 64, "int4", "bf16"),
    ("qwen2.5-7b", torch.bfloat16, 64, 64, "fp8", "bf16"),
    ("qwen2.5-7b", torch.bfloat16, 64, 64, "int4", "fp8"),
    ("llama-3.1-8b", torch.bfloat16, 64, 64, "int4", "bf16"),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--models", help="comma-separated subset of the cases")
    parser.add_argument("--quantised", action="store_true", help="the int4 and fp8 cases")
    parser.add_argument("--families", action="store_true",
                        help="Qwen3, Gemma 3 and Phi-4-mini at their real shapes")
    parser.add_argument("--prompt", type=int, help="prompt length of every chosen case")
    args = parser.parse_args()
    wanted = set(args.models.split(",")) if args.models else None
    results = []
    cases = QUANTISED if args.quantised else FAMILIES if args.families else CASES
    for name, dtype, prompt, steps, weights, head in cases:
        if wanted and name not in wanted:
            continue
        t0 = time.time()
        prompt = args.prompt or prompt
        r = compare_with_transformers(resolve_model(name), "cuda", dtype, prompt_len=prompt,
                                      steps=steps, weights=weights, head=head).summary()
        r["seconds"] = round(time.time() - t0, 1)
        results.append(r)
        extra = (f" | vs fp32: engine {r['engine_vs_fp32_median']:.2e}, transformers "
                 f"{r['hf_vs_fp32_median']:.2e}" if "engine_vs_fp32_median" in r else "")
        if "quant_vs_16bit_median" in r:
            extra += (f" | vs 16-bit weights: {r['quant_vs_16bit_median']:.2e}, argmax agree "
                      f"{r['quant_argmax_agree']}/{r['positions']}")
        print(f"{name:18} {r['dtype']:9} {weights}/{head} prompt {prompt} "
              f"positions {r['positions']:3} rel err median {r['median_rel_err']:.2e} "
              f"max {r['max_rel_err']:.2e} argmax agree "
              f"{r['argmax_agree']}/{r['positions']}{extra} ({r['seconds']} s)", flush=True)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
