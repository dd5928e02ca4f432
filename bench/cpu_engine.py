"""The engine's CPU step against transformers' on the CPU demo's model, and the products it
was chosen from (floorline.engine.cpu). Two parts, each in this one process:

1. products: every decoder matrix of a model's shapes (30 layers' qkv, o, gate, up, down, in
   turn, so that none stays in cache) and its head, as a one-row product, by each route: bf16
   through PyTorch's default (oneDNN), through ATen's own GEMV (oneDNN off), through oneDNN's
   packed weights (where the processor has AVX-512), through floorline's AVX2 kernel
   (floorline.engine.cpu_kernel, where it can be built), fp32 (the reference's), int8
   (`torch._weight_int8pack_mm`); and 1 to 256 bf16 rows (a verify step, a prefill's chunk)
   through oneDNN, ATen and widened to fp32 (floorline.engine.cpu_products). Median ms over
   --runs.
2. steps: the engine's step (`cpu` and `reference` backends, with the routes the CPU step
   chose) and hf-eager's on SmolLM2-135M (fetched: `floorline models fetch smollm2-135m`) at
   each context, interleaved step by step windows so that a disturbance of the host falls on
   all alike; the median ms of each and the ratio hf-eager / engine.

    python bench/cpu_engine.py
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python bench/cpu_engine.py

The second holds ATen and oneDNN to the kernels a processor without AVX-512 runs.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from floorline.engine import Engine, cpu_kernel
from floorline.engine.cpu_products import ALL_WIDENED, aten_linear, linear
from floorline.models import resolve_model
from floorline.paths import open_session, parse_path
from floorline.paths.engine import EngineSession

MODEL = "smollm2-135m"


def median_ms(fn, runs: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def products(config, runs: int) -> None:
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    q = config.num_attention_heads * (h // config.num_attention_heads)
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    shapes = [(q + 2 * kv, h), (h, q), (i, h), (i, h), (h, i)]
    mats = [[torch.randn(n, k).bfloat16() for n, k in shapes] for _ in range(layers)]
    head = torch.randn(config.vocab_size, h).bfloat16()
    x = {k: torch.randn(1, k).bfloat16() for k in (h, i)}

    def every(product, ws, hw, xs):
        def run():
            for layer in ws:
                for w in layer:
                    product(xs[w.shape[1]], w)
            product(xs[h], hw)
        return run

    def packed(xr, w):
        return torch.ops.mkldnn._linear_pointwise(xr, w, None, "none", [], "")

    rows = {
        "bf16, PyTorch's default (oneDNN)": every(F.linear, mats, head, x),
        "bf16, ATen's GEMV (oneDNN off; the engine's)": every(aten_linear, mats, head, x),
    }
    try:
        rows["bf16, oneDNN packed weights"] = every(
            packed, [[torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in layer]
                     for layer in mats],
            torch.ops.mkldnn._reorder_linear_weight(head, 1), x)
    except RuntimeError as e:  # oneDNN packs bf16 only where the processor has AVX-512
        print(f"  bf16, oneDNN packed weights: not on this processor ({e})")
    built = cpu_kernel.kernel()
    if isinstance(built, str):
        print(f"  bf16, floorline's AVX2 kernel: not here ({built})")
    else:
        rows["bf16, floorline's AVX2 kernel"] = every(built.product, mats, head, x)
    for name, fn in rows.items():
        print(f"  {name}: {median_ms(fn, runs):.2f} ms")
    del rows
    fp32 = every(F.linear, [[w.float() for w in layer] for layer in mats], head.float(),
                 {k: v.float() for k, v in x.items()})
    print(f"  fp32 (the reference's): {median_ms(fp32, runs):.2f} ms")
    del fp32
    q8 = [[(torch.randint(-127, 127, w.shape, dtype=torch.int8),
            torch.rand(w.shape[0]).bfloat16()) for w in layer] for layer in mats]
    hq = (torch.randint(-127, 127, head.shape, dtype=torch.int8),
          torch.rand(head.shape[0]).bfloat16())

    def int8():
        for layer in q8:
            for w, s in layer:
                torch._weight_int8pack_mm(x[w.shape[1]], w, s)
        torch._weight_int8pack_mm(x[h], *hq)
    print(f"  int8 (_weight_int8pack_mm): {median_ms(int8, runs):.2f} ms")
    for m in (1, 2, 4, 16, 64, 256):
        xm = {k: torch.randn(m, k).bfloat16() for k in (h, i)}
        default = median_ms(every(F.linear, mats, head, xm), runs)
        aten = (f"ATen {median_ms(every(aten_linear, mats, head, xm), runs):.2f} ms, "
                if m <= 16 else "")  # ATen's bf16 GEMM: seconds from 64 rows
        wide = median_ms(every(lambda x, w: linear(x, w, ALL_WIDENED), mats, head, xm), runs)
        print(f"  {m} rows: oneDNN {default:.2f} ms, {aten}widened to fp32 {wide:.2f} ms")


def steps(spec, contexts, windows: int, window: int) -> None:
    for ctx in contexts:
        capacity = ctx + windows * window + 8
        sessions = {f"engine ({b})": EngineSession(Engine(spec, "cpu", capacity, backend=b),
                                                   "cpu", 0) for b in ("cpu", "reference")}
        print(f"the engine's products: {sessions['engine (cpu)'].engine.products()}")
        sessions["hf-eager"] = open_session(parse_path("hf-eager"), spec, "cpu", capacity, 0)
        for s in sessions.values():
            s.prefill(ctx)
            for _ in range(4):
                s.step()
        times = {name: [] for name in sessions}
        for _ in range(windows):
            for name, s in sessions.items():
                for _ in range(window):
                    t0 = time.perf_counter()
                    s.step()
                    times[name].append((time.perf_counter() - t0) * 1e3)
        med = {name: statistics.median(t) for name, t in times.items()}
        print(f"ctx {ctx} ({windows} x {window} steps each, interleaved):")
        for name, m in med.items():
            t = sorted(times[name])
            print(f"  {name}: {m:.2f} ms (p10-p90 {t[len(t) // 10]:.2f}-{t[9 * len(t) // 10]:.2f})"
                  f", hf-eager / it = {med['hf-eager'] / m:.2f}x")
        for s in sessions.values():
            s.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", default="128,512")
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--skip-products", action="store_true")
    args = ap.parse_args()
    spec = resolve_model(MODEL)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    if not args.skip_products:
        print(f"one-row products of {MODEL}'s matrices, every layer's and the head's:")
        products(spec.config, args.runs)
    with torch.no_grad():
        steps(spec, [int(c) for c in args.ctx.split(",")], args.windows, args.window)


if __name__ == "__main__":
    main()
