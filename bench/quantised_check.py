"""GPU check of the quantised kernels against the layouts' plain-torch dequantisation: each
library's linear on random packed weights at Qwen2.5-7B's shapes, batch 1 and a prefill-sized
batch, eager and replayed from a CUDA graph. Prints one line per kernel and shape; exits 1 if
any relative error is above bf16/fp16 bands (1e-2).

    PYTHONPATH=src python3 bench/quantised_check.py [gptq-exllamav2 awq-marlin ...]
"""

import sys

import torch

from floorline.paths import REGISTRY

SHAPES = [(512, 3584), (3584, 3584), (18944, 3584), (3584, 18944)]  # (out, in)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check(name: str) -> bool:
    path = REGISTRY[name]
    ok = True
    for out_f, in_f in SHAPES:
        g = torch.Generator("cuda").manual_seed(out_f + in_f)
        tensors = path.layout.random(out_f, in_f, path.group_size, g, "cuda")
        weight = path.layout.dequantise(tensors, path.group_size)  # before any in-place repack
        bias = torch.randn(out_f, device="cuda", dtype=torch.float16) * 0.01
        linear = path.make_linear(tensors, bias, "cuda", {})
        errors = []
        for rows in (1, 64):
            x = torch.randn(rows, in_f, device="cuda", dtype=torch.float16)
            ref = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
            errors.append(rel(linear(x), ref))
        x = torch.randn(1, in_f, device="cuda", dtype=torch.float16)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            linear(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = linear(x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        errors.append(rel(y, torch.nn.functional.linear(x.float(), weight.float(), bias.float())))
        good = max(errors) < 1e-2
        ok &= good
        print(f"{name} {out_f}x{in_f}: rel err batch 1 {errors[0]:.2e}, batch 64 {errors[1]:.2e}, "
              f"graph replay {errors[2]:.2e} {'ok' if good else 'FAIL'}", flush=True)
    return ok


if __name__ == "__main__":
    names = sys.argv[1:] or [n for n, p in REGISTRY.items() if getattr(p, "layout", None)]
    results = {}
    for n in names:
        try:
            results[n] = check(n)
        except Exception as e:  # report every kernel, not just the first that fails
            print(f"{n}: cannot run: {type(e).__name__}: {e}", flush=True)
            results[n] = False
    sys.exit(0 if all(results.values()) else 1)
