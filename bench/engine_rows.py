"""The verify step's rows product (floorline.engine.kernels.rows) at a model's real shapes, on a
CUDA GPU: every launch configuration its tuner tries (floorline.engine.tuning.rows_candidates:
block sizes, warps, stages, splits along K) on m rows, against the one-token GEMV of the same
shape at its tuned launch. Both are timed as the tuner times them (launches replayed from a CUDA
graph, over copies of the weights that overflow L2); each configuration's output is checked
against the reference at the real shape. Prints, per product, microseconds, GB/s of the weights
and the ratio rows/GEMV of each configuration, fastest first, then per layer the GEMVs' time
against the fastest rows products' (the verify step's products over the one-token step's).

    python bench/engine_rows.py --model qwen2.5-7b [--weights int4] [--head bf16] [--rows 8] \
        [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
from triton.runtime.errors import OutOfResources

from engine_kernels import product_shapes  # beside this script
from floorline.engine.check import relative_error
from floorline.engine.kernels.gemv import gemv_reference
from floorline.engine.kernels.rows import rows_product
from floorline.engine.model import DecoderConfig
from floorline.engine.ops import TritonOps
from floorline.engine.quant import FORMATS, HEAD_FORMATS, nbytes, quantise
from floorline.engine.tuning import group_of, random_like, rows_candidates, time_graph
from floorline.models import resolve_model
from floorline.timing import rotation_copies


def draw(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="cuda").normal_(0, 0.02)


def product_rows(name, n, k, flags, x_dtype, out_dtype, fmt, m, ops) -> list[dict]:
    """The GEMV's row, then one per rows configuration, for one product."""
    up = flags.get("up", False)
    first = [quantise(draw(n, k), fmt) for _ in range(2 if up else 1)]
    size = nbytes(first[0]) * len(first)
    copies = rotation_copies(size, "cuda")
    ws = [first] + [[random_like(w, None) for w in first] for _ in range(copies - 1)]
    kw = dict(norm=draw(k) if flags.get("norm") else None, eps=1e-6,
              bias=draw(n) if flags.get("bias") else None,
              accumulate=flags.get("accumulate", False))
    x1, out1 = draw(k, dtype=x_dtype), torch.zeros(n, dtype=out_dtype, device="cuda")
    xm, outm = draw(m, k, dtype=x_dtype), torch.zeros(m, n, dtype=out_dtype, device="cuda")

    def product(x, out, w, config=None):
        upm = w[1] if up else None
        if config is None:  # the GEMV at its tuned launch
            ops.gemv(x, w[0], out, up=upm, **kw)
        else:
            rows_product(x, w[0], out, config=config, up=upm, partials=ops.partials, **kw)

    def time(x, out, config=None) -> float:
        return time_graph(lambda: [product(x, out, w, config) for w in ws]) / copies

    shape = f"{n}x{k}" + (" x2" if up else "")
    gemv_us = time(x1, out1)
    config = ops.tuner.config(first[0], out1, norm=kw["norm"] is not None, up=up,
                              bias=kw["bias"] is not None, accumulate=kw["accumulate"])
    rows = [dict(product=name, shape=shape, kernel="gemv", us=gemv_us, gbps=size / gemv_us / 1e3,
                 ratio=1.0, config=dataclasses.asdict(config))]
    # an accumulating product adds into its output, which the timing below keeps changing: each
    # check starts from the same output as the reference
    start = outm.clone()
    want = start.clone()
    gemv_reference(xm, first[0], want, up=first[1] if up else None, **kw)
    for config in rows_candidates(k, group_of(first[0])):
        got = start.clone()
        try:
            product(xm, got, first, config)
        except OutOfResources as e:
            rows.append(dict(product=name, shape=shape, kernel=f"rows m={m}", skipped=str(e),
                             config=dataclasses.asdict(config)))
            continue
        us = time(xm, outm, config)
        rows.append(dict(product=name, shape=shape, kernel=f"rows m={m}", us=us,
                         gbps=size / us / 1e3, ratio=us / gemv_us,
                         rel_err=relative_error(got, want), config=dataclasses.asdict(config)))
    return rows


def launch(config: dict) -> str:
    return (f"n{config['block_n']} k{config['block_k']} w{config['num_warps']} "
            f"s{config['num_stages']} split{config['split_k']}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-7b")
    parser.add_argument("--weights", default="bf16", choices=FORMATS)
    parser.add_argument("--head", default="bf16", choices=HEAD_FORMATS)
    parser.add_argument("--rows", type=int, default=8, help="m, the verify step's tokens")
    parser.add_argument("--json")
    args = parser.parse_args()
    c = DecoderConfig.from_hf(resolve_model(args.model).config)
    ops = TritonOps("cuda")
    print(f"{args.model} on {torch.cuda.get_device_name()}, weights {args.weights}, head "
          f"{args.head}, rows product on m={args.rows} against the one-token GEMV", flush=True)
    print(f"{'product':26} {'shape':16} {'kernel':10} {'us':>8} {'GB/s':>7} {'ratio':>6} "
          f"{'rel err':>8}  launch", flush=True)
    rows, best = [], {}
    for name, n, k, flags, x_dtype, out_dtype in product_shapes(c):
        fmt = args.head if name.startswith("lm head") else args.weights
        found = product_rows(name, n, k, flags, x_dtype, out_dtype, fmt, args.rows, ops)
        timed = [r for r in found[1:] if "us" in r]
        best[name] = (found[0]["us"], min(r["us"] for r in timed))
        for r in [found[0]] + sorted(timed, key=lambda r: r["us"]) + [
                r for r in found if "skipped" in r]:
            if "skipped" in r:
                print(f"{name:26} {r['shape']:16} {r['kernel']:10} skipped ({r['skipped']})  "
                      f"{launch(r['config'])}", flush=True)
                continue
            err = f"{r['rel_err']:8.1e}" if "rel_err" in r else " " * 8
            print(f"{name:26} {r['shape']:16} {r['kernel']:10} {r['us']:8.2f} {r['gbps']:7.0f} "
                  f"{r['ratio']:6.2f} {err}  {launch(r['config'])}", flush=True)
        rows += found
    head = best.pop("lm head+norm")
    one, many = (sum(times[i] for times in best.values()) for i in (0, 1))
    step = (c.layers * many + head[1]) / (c.layers * one + head[0])
    print(f"a layer's products: GEMVs {one:.1f} us, fastest rows products {many:.1f} us, "
          f"ratio {many / one:.2f}; {c.layers} layers and the head: ratio {step:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "gpu": torch.cuda.get_device_name(),
                       "weights": args.weights, "head": args.head, "m": args.rows,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
