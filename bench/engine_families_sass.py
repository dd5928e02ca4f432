"""The kernel variants Qwen3, Gemma 3 and Phi-4-mini add, compiled for Hopper (sm_90) on any
machine: no GPU is needed, only Triton's bundled ptxas. Triton's interpreter, where the CPU tests
run them, does not type-check as the compiler does (a loop-carried value that changes type, for
one), so each variant is compiled here at its model's real shape, as the engine launches it.

    python bench/engine_families_sass.py [--json out.json]

Prints, per variant, the registers a thread uses, the bytes it spills and the shared memory a
program takes; where the kernel has a loop, the loop's instructions and, among them, the
asynchronous copies from global memory into shared memory (LDGSTS: the loads Triton's software
pipeline runs ahead), the loads from shared memory into registers (LDS, LDSM) and the
conversions of packed values (F2FP).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine_int4_sass import loop_body, opcode, resource_usage  # beside this script
from floorline.engine.kernels.attention import _attention_split_kernel, attention_warps
from floorline.engine.kernels.gemv import _gemv_int4_kernel, _gemv_kernel
from floorline.engine.kernels.norm import _add_norm_kernel
from floorline.engine.model import attention_block_t

ATTENTION_TYPES = {"qkv_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "ks_ptr": "*fp32",
                   "vs_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i32",
                   "part_ptr": "*fp32", "stats_ptr": "*fp32", "capacity": "i32", "scale": "fp32",
                   "window": "i32", "qn_ptr": "*fp32", "kn_ptr": "*fp32", "eps": "fp32"}
GEMV_TYPES = {"x_ptr": "*fp32", "w_ptr": "*bf16", "up_ptr": "*bf16", "bias_ptr": "*bf16",
              "norm_ptr": "*bf16", "scale_ptr": "*fp32", "up_scale_ptr": "*fp32",
              "out_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32", "N": "i32",
              "K": "i32", "eps": "fp32"}
INT4_TYPES = {"x_ptr": "*fp32", "w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8",
              "up_ptr": "*i32", "up_s_ptr": "*fp16", "up_z_ptr": "*u8", "bias_ptr": "*bf16",
              "norm_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32",
              "N": "i32", "K": "i32", "K_WORDS": "i32", "eps": "fp32"}
NORM_TYPES = {"x_ptr": "*fp32", "w_ptr": "*fp32", "h_ptr": "*fp32", "N": "i32", "eps": "fp32"}


def attention(name, heads, kv_heads, d, rot, qk_norm, windowed, fp8=False, norm_type="*fp32"):
    group = heads // kv_heads
    types = dict(ATTENTION_TYPES, qn_ptr=norm_type, kn_ptr=norm_type)
    if fp8:
        types.update(k_ptr="*fp8e4nv", v_ptr="*fp8e4nv")
    constexprs = dict(
        ROT=rot, QK_NORM=qk_norm, HQ=heads, HKV=kv_heads, G=group,
        G_PAD=max(16, triton.next_power_of_2(group)), D=d,
        BLOCK_T=attention_block_t(d, "fp8" if fp8 else "bf16"), SPLITS=32, WINDOWED=windowed,
        KV_FP8=fp8, FP8_DOTS=fp8, EXACT=False, PRECISION="tf32", PDL=True)
    # an fp8 cache's slots are a multiple of 16 (floorline.engine.kvcache), as Triton sees at launch
    return (name, _attention_split_kernel, types, constexprs, attention_warps(d),
            ("capacity",) if fp8 else ())


def gemv_geglu(name, n, k, split_k=1):
    return name, _gemv_kernel, GEMV_TYPES, dict(
        NORM=True, SWIGLU=True, BIAS=False, SCALE=False, GELU=True, ACCUMULATE=False,
        REDUCE=split_k > 1, BLOCK_N=8, BLOCK_K=512, SPLIT_K=split_k,
        EVEN=n % 8 == 0 and k % (512 * split_k) == 0, PDL=True, BLOCKS=False), 4


def int4_geglu(name, split_k=1, gelu=True):
    return name, _gemv_int4_kernel, INT4_TYPES, dict(
        NORM=True, SWIGLU=True, GELU=gelu, BIAS=False, ACCUMULATE=False, REDUCE=split_k > 1,
        BLOCK_N=8, GROUPS=4, GROUP=128, WORDS=4, SPLIT_K=split_k, EVEN=True,
        PDL=True, ASM=True, MIN=False), 2


VARIANTS = [
    attention("attention qwen2.5-7b (as before, for reference)", 28, 4, 128, 128, False, False),
    attention("attention qwen3-8b (q/k norm)", 32, 8, 128, 128, True, False, norm_type="*bf16"),
    attention("attention gemma-3-12b local (q/k norm, d 256, window)", 16, 8, 256, 256, True,
              True),
    attention("attention gemma-3-12b global (q/k norm, d 256)", 16, 8, 256, 256, True, False),
    attention("attention gemma-3-12b local, fp8 cache", 16, 8, 256, 256, True, True, fp8=True),
    attention("attention llama-3.1-8b, 16-bit cache", 32, 8, 128, 128, False, False),
    attention("attention llama-3.1-8b, fp8 cache", 32, 8, 128, 128, False, False, fp8=True),
    attention("attention phi-4-mini (96 of 128 dims turned, window)", 24, 8, 128, 96, False,
              True),
    gemv_geglu("gemv gemma-3-12b gate/up GeGLU", 15360, 3840),
    int4_geglu("gemv int4 gemma-3-12b gate/up GeGLU"),
    # K-splits that meet in partials (the last split to arrive finishes the block)
    gemv_geglu("gemv gemma-3-12b gate/up GeGLU, 2 splits", 15360, 3840, split_k=2),
    int4_geglu("gemv int4 qwen2.5-7b gate/up SwiGLU, 2 splits", split_k=2, gelu=False),
    ("add_norm gemma-3-12b (hidden 3840)", _add_norm_kernel, NORM_TYPES,
     dict(BLOCK=4096, PDL=True), 16),
]


def compile_variant(name, kernel, types, constexprs, warps, divisible=()) -> dict:
    signature = {a: types.get(a, "constexpr") for a in kernel.arg_names}
    missing = [a for a in kernel.arg_names if signature[a] == "constexpr" and a not in constexprs]
    if missing:
        raise SystemExit(f"{name}: no value for {', '.join(missing)}")
    # pointers 16-byte aligned, as Triton specialises them at launch for torch's allocations,
    # and the integers in `divisible` multiples of 16
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]]
             for a, t in signature.items() if t.startswith("*") or a in divisible}
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, num_stages=3))
    cubin = compiled.asm["cubin"]
    registers, stack = resource_usage(cubin)
    row = {"variant": name, "registers": registers, "spilled_bytes": stack,
           "shared_bytes": compiled.metadata.shared}
    try:
        body = loop_body(cubin)
    except IndexError:  # no backward branch: the kernel has no loop
        return row
    ops = collections.Counter(opcode(t) for t in body)
    return {**row, "loop_instructions": len(body), "loop_async_copies": ops["LDGSTS"],
            "loop_shared_loads": ops["LDS"] + ops["LDSM"], "loop_conversions": ops["F2FP"]}


def compile_all(variants) -> None:
    """Each variant compiled and printed as it comes; with --json, every row into that file."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    rows = []
    for variant in variants:
        rows.append(compile_variant(*variant))
        r = rows[-1]
        loop = (f" | loop {r['loop_instructions']:5}: async copies {r['loop_async_copies']:3}, "
                f"shared loads {r['loop_shared_loads']:3}, conversions {r['loop_conversions']:3}"
                if "loop_instructions" in r else "")
        print(f"{r['variant']:58} registers {r['registers']:4} spilled {r['spilled_bytes']:5} B "
              f"shared {r['shared_bytes']:6} B{loop}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def main() -> None:
    compile_all(VARIANTS)


if __name__ == "__main__":
    main()
