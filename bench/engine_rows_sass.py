"""The verify step's product for several rows (floorline.engine.kernels.rows), compiled for
Hopper (sm_90) on any machine (Triton's bundled ptxas, no GPU) in each weight format and fusion
the verify step launches, unsplit and, for a few, split along K (with atomics into the residual
rows, or meeting in partials): that it compiles (the interpreter, where the CPU tests run it, does
not type-check as the compiler does), its registers, spills and shared memory, and its loop's
instructions (bench/engine_families_sass.py prints them).

    python bench/engine_rows_sass.py [--json out.json]
"""

from __future__ import annotations

import triton.language as tl

from engine_families_sass import compile_all  # beside this script
from floorline.engine.kernels.rows import BLOCK_M, _rows_kernel

TYPES = {"x_ptr": "*fp32", "w_ptr": "*bf16", "up_ptr": "*bf16", "s_ptr": "*bf16",
         "z_ptr": "*bf16", "up_s_ptr": "*bf16", "up_z_ptr": "*bf16", "bias_ptr": "*bf16",
         "norm_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32",
         "M": "i32", "N": "i32", "K": "i32", "eps": "fp32"}
FORMATS = {  # the weight format's pointer types and its constexprs
    "bf16": ({}, dict(FORMAT=0, GROUP=8, BLOCK_K=64)),
    "fp8": ({"w_ptr": "*fp8e4nv", "up_ptr": "*fp8e4nv", "s_ptr": "*fp32", "up_s_ptr": "*fp32"},
            dict(FORMAT=1, GROUP=8, BLOCK_K=64)),
    "int4": ({"w_ptr": "*i32", "up_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8",
              "up_s_ptr": "*fp16", "up_z_ptr": "*u8"}, dict(FORMAT=2, GROUP=128, BLOCK_K=128)),
}
FUSIONS = {  # the verify step's products: qkv (norm, bias), gate/up (norm, SwiGLU), down
    "qkv+norm+bias": ({}, dict(NORM=True, SWIGLU=False, BIAS=True, ACCUMULATE=False)),
    "gate/up+norm+swiglu": ({}, dict(NORM=True, SWIGLU=True, BIAS=False, ACCUMULATE=False)),
    "down, accumulate": ({"x_ptr": "*bf16", "out_ptr": "*fp32"},
                         dict(NORM=False, SWIGLU=False, BIAS=False, ACCUMULATE=True)),
}
# (format, fusion, splits): a store that meets in partials (REDUCE), atomics into the rows
SPLITS = [("bf16", "qkv+norm+bias", 2), ("bf16", "down, accumulate", 4),
          ("fp8", "gate/up+norm+swiglu", 2), ("int4", "gate/up+norm+swiglu", 2),
          ("int4", "down, accumulate", 4)]


def variant(fmt: str, fusion: str, split_k: int = 1):
    fmt_types, fmt_constexprs = FORMATS[fmt]
    fusion_types, fusion_constexprs = FUSIONS[fusion]
    name = f"rows {fmt} {fusion}" + (f", {split_k} splits" if split_k > 1 else "")
    reduce = split_k > 1 and not fusion_constexprs["ACCUMULATE"]
    return (name, _rows_kernel, {**TYPES, **fmt_types, **fusion_types},
            dict(GELU=False, SPLIT=True, EMULATE=False, DOT=tl.bfloat16, BLOCK_M=BLOCK_M,
                 BLOCK_N=64, REDUCE=reduce, SPLIT_K=split_k, **fmt_constexprs,
                 **fusion_constexprs), 4)


def main() -> None:
    compile_all([variant(fmt, fusion) for fmt in FORMATS for fusion in FUSIONS]
                + [variant(*split) for split in SPLITS])


if __name__ == "__main__":
    main()
