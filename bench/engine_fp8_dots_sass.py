"""The fp8 GEMV on the tensor cores (floorline.engine.kernels.gemv, GemvConfig.dots) compiled for
Hopper (sm_90) on any machine (Triton's bundled ptxas, no GPU) in each fusion the decode step
launches, unsplit and split along K (meeting in partials, or with atomics into the residual
stream): that it compiles (the interpreter, where the CPU tests run it, does not type-check as the
compiler does), its registers, spills and shared memory, and its loop's instructions
(bench/engine_families_sass.py prints them), among them the asynchronous copies of W's tiles.

    python bench/engine_fp8_dots_sass.py [--json out.json]
"""

from __future__ import annotations

from engine_families_sass import compile_all  # beside this script
from floorline.engine.kernels.gemv import _gemv_fp8_dots_kernel

TYPES = {"x_ptr": "*fp32", "w_ptr": "*fp8e4nv", "up_ptr": "*fp8e4nv", "bias_ptr": "*bf16",
         "norm_ptr": "*bf16", "scale_ptr": "*fp32", "up_scale_ptr": "*fp32", "out_ptr": "*bf16",
         "part_ptr": "*fp32", "count_ptr": "*i32", "N": "i32", "K": "i32", "eps": "fp32"}
FUSIONS = {  # the step's products: qkv (norm, bias), gate/up (norm, SwiGLU), o and down
    "qkv+norm+bias": ({}, dict(NORM=True, SWIGLU=False, BIAS=True, ACCUMULATE=False)),
    "gate/up+norm+swiglu": ({}, dict(NORM=True, SWIGLU=True, BIAS=False, ACCUMULATE=False)),
    "down, accumulate": ({"x_ptr": "*bf16", "out_ptr": "*fp32"},
                         dict(NORM=False, SWIGLU=False, BIAS=False, ACCUMULATE=True)),
    "lm head+norm": ({"out_ptr": "*fp32"},
                     dict(NORM=True, SWIGLU=False, BIAS=False, ACCUMULATE=False)),
}


def variant(fusion: str, split_k: int = 1, even: bool = True):
    """`even`: whole blocks and splits, no masks (a split of K that ends mid-block has them,
    such as Qwen2.5-7B's down product, 18944 in 5 splits of 256-wide blocks)."""
    fusion_types, fusion_constexprs = FUSIONS[fusion]
    reduce = split_k > 1 and not fusion_constexprs["ACCUMULATE"]
    name = (f"gemv fp8 dots {fusion}" + (f", {split_k} splits" if split_k > 1 else "")
            + ("" if even else ", masked"))
    return (name, _gemv_fp8_dots_kernel, {**TYPES, **fusion_types},
            dict(GELU=False, REDUCE=reduce, BLOCK_N=64, BLOCK_K=256, SPLIT_K=split_k, EVEN=even,
                 PDL=True, EXACT=False, **fusion_constexprs), 4,
            ("N", "K"))  # every model's widths are multiples of 16, as Triton sees at launch


def main() -> None:
    compile_all([variant(fusion) for fusion in FUSIONS]
                + [variant("gate/up+norm+swiglu", 4), variant("down, accumulate", 4),
                   variant("down, accumulate", 5, even=False)])


if __name__ == "__main__":
    main()
