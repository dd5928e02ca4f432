"""Micro-benchmarks of the engine's kernels at a model's shapes, on a CUDA GPU: achieved GB/s
of each GEMV (tuned Triton launch vs cuBLAS through F.linear on 16-bit weights, same rotation
past L2, both replayed from a CUDA graph), and of decode attention (with rope and the KV write)
at each context. --weights int4|fp8 times the quantised GEMVs (bytes as stored) and checks each
against its dequantise-then-multiply reference at the real shape. --kv fp8 times decode attention
alone on an fp8 cache (its bytes: e4m3 values and a 4-byte scale per token and kv head).

    python bench/engine_kernels.py --model qwen2.5-7b --ctx 2048,16384 [--weights int4] \
        [--kv fp8] [--retune] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from floorline.engine.check import relative_error
from floorline.engine.kernels.attention import attention_scratch, attention_warps, decode_attention
from floorline.engine.kernels.gemv import gemv_reference
from floorline.engine.kvcache import KV_FORMATS, KVCache
from floorline.engine.model import DecoderConfig, attention_block_t, attention_splits
from floorline.engine.ops import TritonOps
from floorline.engine.quant import FORMATS, HEAD_FORMATS, format_of, quantise
from floorline.engine.quant import nbytes as weight_nbytes
from floorline.engine.tuning import random_like, time_graph
from floorline.models import resolve_model
from floorline.timing import rotation_copies


def product_shapes(c: DecoderConfig) -> list[tuple]:
    """The step's products: name, N, K, flags, x dtype, out dtype (the head's name starts
    "lm head")."""
    # Gemma: o and down write a buffer that add_norm normalises into the residual stream
    into = "" if c.gemma else "+residual"
    return [
        ("qkv+norm+bias" if c.qkv_bias else "qkv+norm", c.qkv_rows, c.hidden,
         dict(norm=True, bias=c.qkv_bias), torch.float32, torch.bfloat16),
        ("o" + into, c.hidden, c.heads * c.head_dim, dict(accumulate=not c.gemma),
         torch.bfloat16, torch.float32),
        ("gate/up+norm+" + ("swiglu" if c.act == "silu" else "geglu"), c.intermediate, c.hidden,
         dict(norm=True, up=True), torch.float32, torch.bfloat16),
        ("down" + into, c.hidden, c.intermediate, dict(accumulate=not c.gemma), torch.bfloat16,
         torch.float32),
        ("lm head+norm", c.vocab, c.hidden, dict(norm=True), torch.float32, torch.float32),
    ]


def gemv_rows(c: DecoderConfig, ops: TritonOps, weights: str = "bf16",
              head: str = "bf16") -> list[dict]:
    def draw(*shape, dtype=torch.bfloat16):
        return torch.empty(shape, dtype=dtype, device="cuda").normal_(0, 0.02)

    def matrix(n, k, is_head):
        return quantise(draw(n, k), head if is_head else weights)

    rows = []
    for name, n, k, flags, x_dtype, out_dtype in product_shapes(c):
        mats = 2 if flags.get("up") else 1
        is_head = name.startswith("lm head")
        ws = [[matrix(n, k, is_head) for _ in range(mats)]]
        nbytes = weight_nbytes(ws[0][0]) * mats
        copies = rotation_copies(nbytes, "cuda")
        ws += [[random_like(w, None) for w in ws[0]] for _ in range(copies - 1)]
        x, out = draw(k, dtype=x_dtype), torch.zeros(n, dtype=out_dtype, device="cuda")
        kw = dict(norm=draw(k) if flags.get("norm") else None, eps=1e-6,
                  bias=draw(n) if flags.get("bias") else None,
                  accumulate=flags.get("accumulate", False), act=c.act)

        def mine():
            for w in ws:
                ops.gemv(x, w[0], out, up=w[1] if mats == 2 else None, **kw)

        # the kernel against its reference on the first copy, before any timing
        up = ws[0][1] if mats == 2 else None
        got, want = out.clone(), out.clone()
        ops.gemv(x, ws[0][0], got, up=up, **kw)
        gemv_reference(x, ws[0][0], want, up=up, **kw)
        err = relative_error(got, want)
        t_mine = time_graph(mine) / copies
        if weights == "bf16" or is_head and head == "bf16":
            xb = x.to(torch.bfloat16)[None]
            dense_ws = ws

            def cublas():  # the products alone, no fusion
                for w in dense_ws:
                    for m in w:
                        torch.nn.functional.linear(xb, m)

            t_lib = time_graph(cublas) / copies
        else:
            t_lib = None
        config = ops.tuner.config(ws[0][0], out, norm=kw["norm"] is not None,
                                  up=mats == 2, bias=kw["bias"] is not None,
                                  accumulate=kw["accumulate"])
        row = dict(kernel=f"gemv {name}", format=format_of(ws[0][0]),
                   shape=f"{n}x{k}" + (" x2" if mats == 2 else ""), MB=nbytes / 1e6, us=t_mine,
                   gbps=nbytes / t_mine / 1e3, rel_err=err, config=str(config))
        # where this run tuned the shape: the fastest launch of each fp8 kernel, as the tuner
        # timed them (the CUDA cores' and the tensor cores')
        key = ops.tuner.key(ws[0][0], out, norm=kw["norm"] is not None, up=mats == 2,
                            bias=kw["bias"] is not None, accumulate=kw["accumulate"])
        for dots in (False, True):
            fastest = next(((us, c) for us, c in ops.tuner.trials.get(key, []) if c.dots == dots),
                           None)
            if fastest and format_of(ws[0][0]) == "fp8":
                kernel = "dots" if dots else "cores"
                row.update(key=key, **{f"{kernel}_us": fastest[0],
                                       f"{kernel}_config": dataclasses.asdict(fastest[1])})
        if t_lib is not None:
            row.update(cublas_us=t_lib, cublas_gbps=nbytes / t_lib / 1e3)
        rows.append(row)
    return rows


def attention_rows(c: DecoderConfig, contexts: list[int], kv: str = "bf16") -> list[dict]:
    """Each context at the engine's choice (the first row) and at other splits and blocks; the
    kernel also rotates q and k and writes the new token's k and v."""
    rows = []
    for ctx in contexts:
        capacity = ctx + 1
        fp8 = kv == "fp8"
        nbytes = 2 * c.kv_heads * ctx * (c.head_dim + 4 if fp8 else c.head_dim * 2)
        copies = rotation_copies(nbytes, "cuda")

        def cache():
            """((K, K scales), (V, V scales)) as the engine holds them (fp8: V transposed)."""
            stored = KVCache.allocate(kv, 1, c.kv_heads, capacity, c.head_dim, torch.bfloat16,
                                      "cuda")
            stored.write(0, 0, *(torch.randn(c.kv_heads, capacity, c.head_dim, device="cuda",
                                             dtype=torch.bfloat16) for _ in "kv"))
            k_scale, v_scale = stored.scales(0) or (None, None)
            return (stored.k[0], k_scale), (stored.v[0], v_scale)

        caches = [cache() for _ in range(copies)]
        qkv = torch.randn(c.qkv_rows, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(c.heads * c.head_dim, device="cuda", dtype=torch.bfloat16)
        pos = torch.tensor([ctx - 1], dtype=torch.int32, device="cuda")
        rotary = c.rotary or c.head_dim
        cos = torch.randn(capacity, rotary // 2, device="cuda")
        # the model's own variant: q/k norms (Qwen3, Gemma 3), partial rotary (Phi-3)
        norms = (dict(q_norm=torch.ones(c.head_dim, device="cuda"),
                      k_norm=torch.ones(c.head_dim, device="cuda"), eps=c.eps)
                 if c.qk_norm else {})
        own = (attention_splits(c.kv_heads, "cuda"), attention_block_t(c.head_dim, kv), True,
               attention_warps(c.head_dim))
        # tiles of K up to 16 KB, or 32 KB with 8 warps: larger ones spill or overflow shared
        # memory on the H200
        tile = c.head_dim * (1 if fp8 else 2)
        variants = [own] + [
            (attention_splits(c.kv_heads, "cuda", per_sm), block_t, fp8_dots, warps)
            for per_sm in (1, 2, 4) for block_t in (32, 64, 128, 256) for warps in (4, 8)
            for fp8_dots in ((True, False) if fp8 else (True,))
            if block_t * tile <= (32768 if warps == 8 else 16384)]
        for splits, block_t, fp8_dots, warps in dict.fromkeys(variants):
            scratch = attention_scratch(c.heads, c.head_dim, splits, "cuda")

            def run():
                for (k, ks), (v, vs) in caches:
                    decode_attention(qkv, k, v, cos, cos, pos, out, scale=c.head_dim ** -0.5,
                                     window=None, scratch=scratch, block_t=block_t,
                                     scales=(ks, vs) if fp8 else None, rotary=rotary,
                                     fp8_dots=fp8_dots, num_warps=warps, **norms)

            t = time_graph(run) / copies
            engine = (splits, block_t, fp8_dots, warps) == own
            rows.append(dict(kernel=f"attention+rope ctx {ctx}" + (" fp8 KV" if fp8 else "")
                             + (" (engine)" if engine else ""),
                             shape=f"{c.kv_heads} kv heads x {ctx}", MB=nbytes / 1e6, us=t,
                             gbps=nbytes / t / 1e3,
                             config=f"splits={splits} block_t={block_t} warps={warps}"
                             + (f" dots={'fp8' if fp8_dots else 'tf32'}" if fp8 else "")))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-7b")
    parser.add_argument("--ctx", default="2048,16384")
    parser.add_argument("--weights", default="bf16", choices=FORMATS)
    parser.add_argument("--head", default="bf16", choices=HEAD_FORMATS)
    parser.add_argument("--kv", default="bf16", choices=KV_FORMATS,
                        help="fp8: decode attention on an fp8 cache only, no GEMVs")
    parser.add_argument("--retune", action="store_true",
                        help="tune every GEMV shape again, ignoring the shipped table (the new "
                             "choices go to the local table, which the engine then uses)")
    parser.add_argument("--json")
    args = parser.parse_args()
    c = DecoderConfig.from_hf(resolve_model(args.model).config)
    contexts = [int(x) for x in args.ctx.split(",")]
    if args.kv == "fp8":
        rows = attention_rows(c, contexts, "fp8")
    else:
        ops = TritonOps("cuda")
        if args.retune:
            ops.tuner.table = {}
        rows = gemv_rows(c, ops, args.weights, args.head)
        if args.weights == "bf16":
            rows += attention_rows(c, contexts)
    print(f"{args.model} on {torch.cuda.get_device_name()}, weights {args.weights}, "
          f"head {args.head}")
    print(f"{'kernel':34} {'shape':24} {'format':7} {'MB':>8} {'us':>8} {'GB/s':>7} "
          f"{'cuBLAS GB/s':>11} {'rel err':>8}  config")
    for r in rows:
        lib = f"{r['cublas_gbps']:11.0f}" if "cublas_gbps" in r else " " * 11
        err = f"{r['rel_err']:8.1e}" if "rel_err" in r else " " * 8
        print(f"{r['kernel']:34} {r['shape']:24} {r.get('format', ''):7} {r['MB']:8.1f} "
              f"{r['us']:8.2f} {r['gbps']:7.0f} {lib} {err}  {r['config']}")
        if "dots_us" in r:
            print(f"{'':34} fp8 on the CUDA cores {r['cores_us']:.2f} us, on the tensor cores "
                  f"{r['dots_us']:.2f} us ({r['dots_config']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "gpu": torch.cuda.get_device_name(),
                       "weights": args.weights, "head": args.head, "kv": args.kv, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
