"""What the engine's fp8 KV cache changes: the logits of an fp8-cache engine against a 16-bit-cache
engine on the same weights and tokens, at each context, and the cache's own quantisation error
at each scale granularity. Reported, not asserted.

At each context the two engines prefill the same ctx - steps random tokens, then decode `steps`
positions teacher-forced (both take the 16-bit-cache engine's greedy token), the last at position
ctx - 1; the logits are compared at the prompt's last position and at each step. Then the
16-bit engine's cache (K and V of every layer, positions 0 .. ctx - 1) is quantised to e4m3:
  token-head  one scale per token and kv head, as the engine stores it
  head        one scale per kv head, from the largest value that head holds over the whole
              context (the best any scale fixed per head can do, known only afterwards)
  head-early  one scale per kv head, from the first eighth of the context, applied to the rest
              (a scale fixed before the later tokens come: those beyond it saturate)
and compared with the 16-bit values (relative L2 error, and the mean over tokens of each head
vector's relative error).

    python bench/engine_kv_error.py [--model llama-3.1-8b] [--ctx 2048,32768,131072] [--steps 4]
                                    [--device cuda] [--json out.json]

Writes the JSON after each context, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from floorline.engine import Engine
from floorline.engine.check import relative_error
from floorline.engine.kvcache import FP8, FP8_MAX, dequantise, quantise
from floorline.engine.model import DecoderConfig
from floorline.engine.weights import random_weights
from floorline.models import resolve_model

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def per_head(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """x [heads, tokens, d] in e4m3 with one scale per head from `amax` [heads], saturating."""
    scale = (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)[:, None, None]
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale


def granularity_errors(cache, end: int) -> dict:
    """Each granularity's error over every layer's K and V of positions 0 .. end - 1."""
    sums = {}
    for layer in range(cache.k.shape[0]):
        for name, tensor in (("k", cache.k), ("v", cache.v)):
            x = tensor[layer, :, :end].float()
            early = x[:, :max(1, end // 8)].abs().amax(dim=(1, 2))
            made = {"token-head": dequantise(*quantise(x), torch.float32),
                    "head": per_head(x, x.abs().amax(dim=(1, 2))),
                    "head-early": per_head(x, early)}
            norms = x.norm(dim=-1)
            for granularity, y in made.items():
                err = (y - x).norm(dim=-1)
                s = sums.setdefault(f"{name} {granularity}", [0.0, 0.0, 0.0, 0])
                s[0] += err.pow(2).sum().item()
                s[1] += norms.pow(2).sum().item()
                s[2] += (err / norms.clamp_min(1e-30)).sum().item()
                s[3] += norms.numel()
    return {key: {"rel_l2": (e / n) ** 0.5, "mean_token_rel": r / count}
            for key, (e, n, r, count) in sums.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--ctx", default="2048,32768,131072")
    parser.add_argument("--steps", type=int, default=4, help="teacher-forced decode positions")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args()
    spec = resolve_model(args.model)
    contexts = [int(c) for c in args.ctx.split(",")]
    config = DecoderConfig.from_hf(spec.config)
    if max(contexts) > config.max_positions or min(contexts) <= args.steps:
        parser.error(f"contexts must lie in ({args.steps}, {config.max_positions}]")
    dtype = DTYPES[args.dtype]
    weights = random_weights(config, args.device, dtype, args.seed)
    engines = {kv: Engine(spec, args.device, max(contexts), dtype=dtype, kv=kv,
                          decoder_weights=weights) for kv in ("bf16", "fp8")}
    device = getattr(torch, torch.device(args.device).type, None)
    report = {"model": args.model, "dtype": args.dtype, "device": args.device,
              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
              "steps": args.steps, "rows": []}
    for ctx in contexts:
        t0 = time.time()
        tokens = torch.randint(config.vocab, (ctx - args.steps,),
                               generator=torch.Generator().manual_seed(ctx))
        errors, agree, max_abs = [], 0, 0.0
        with torch.no_grad():
            logits = {kv: e.prefill(tokens) for kv, e in engines.items()}
            for step in range(args.steps + 1):
                errors.append(relative_error(logits["fp8"], logits["bf16"]))
                agree += int(logits["fp8"].argmax() == logits["bf16"].argmax())
                max_abs = max(max_abs, (logits["fp8"] - logits["bf16"]).abs().max().item())
                if step == args.steps:
                    break
                chosen = engines["bf16"].token.clone()  # both go on from the 16-bit choice
                for e in engines.values():
                    e.token.copy_(chosen)
                    e.step()
                logits = {kv: e.logits.clone() for kv, e in engines.items()}
            cache = granularity_errors(engines["bf16"].decoder.cache, ctx)
        if hasattr(device, "synchronize"):
            device.synchronize()
        row = {"ctx": ctx, "positions": len(errors), "rel_err": errors,
               "rel_err_median": sorted(errors)[len(errors) // 2], "max_abs": max_abs,
               "argmax_agree": agree, "cache": cache, "seconds": round(time.time() - t0, 1)}
        report["rows"].append(row)
        print(f"{args.model} ctx {ctx}: logits fp8 vs 16-bit cache, relative error median "
              f"{row['rel_err_median']:.2e} (max {max(errors):.2e}), max |diff| {max_abs:.3f}, "
              f"argmax agree {agree}/{len(errors)} ({row['seconds']} s)", flush=True)
        for key, e in cache.items():
            print(f"  cache {key:14} rel L2 {e['rel_l2']:.2e}  mean per token "
                  f"{e['mean_token_rel']:.2e}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
