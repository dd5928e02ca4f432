"""The engine's prefill on a CUDA GPU: time to first token, prefill tokens/s, and the peak memory
it takes beyond the weights and the KV cache, for prompts up to the model's full context.

    python bench/engine_prefill.py --model qwen2.5-7b --ctx 2048,16384,32000 [--chunk 2048] \
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from floorline.engine import Engine
from floorline.models import resolve_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-7b")
    parser.add_argument("--ctx", default="2048,16384,32000")
    parser.add_argument("--chunk", type=int, nargs="+", default=[2048])
    parser.add_argument("--weights", default="bf16")
    parser.add_argument("--json")
    args = parser.parse_args()
    spec = resolve_model(args.model)
    contexts = [int(c) for c in args.ctx.split(",")]
    engine = Engine(spec, "cuda", max(contexts) + 1, weights=args.weights)
    d = engine.decoder
    resident = torch.cuda.memory_allocated()  # weights, cache and step buffers
    cache_gb = 2 * d.k_cache.numel() * d.k_cache.element_size() / 1e9
    rows = []
    print(f"{args.model} on {torch.cuda.get_device_name()}, weights {args.weights}: resident "
          f"{resident / 1e9:.2f} GB (KV cache {cache_gb:.2f} GB at capacity {d.capacity})")
    print(f"{'ctx':>6} {'chunk':>6} {'ttft ms':>9} {'tokens/s':>9} {'peak above resident GB':>23}")
    for ctx in contexts:
        tokens = torch.randint(engine.config.vocab, (ctx,), device="cuda",
                               generator=torch.Generator("cuda").manual_seed(ctx))
        for chunk in args.chunk:
            for _attempt in range(2):  # the first compiles and warms the allocator
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                with torch.no_grad():
                    d.prefill(tokens, chunk=chunk)
                token = d.token.item()  # the first new token, read back
                ms = (time.perf_counter() - t0) * 1e3
            peak = (torch.cuda.max_memory_allocated() - resident) / 1e9
            rows.append(dict(ctx=ctx, chunk=chunk, ttft_ms=ms, tokens_per_s=ctx / ms * 1e3,
                             peak_above_resident_gb=peak, first_token=token))
            print(f"{ctx:6} {chunk:6} {ms:9.1f} {ctx / ms * 1e3:9.0f} {peak:23.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "gpu": torch.cuda.get_device_name(),
                       "weights": args.weights, "resident_gb": resident / 1e9,
                       "kv_cache_gb": cache_gb, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
