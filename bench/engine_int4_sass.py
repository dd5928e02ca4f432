"""Instructions per weight in the int4 GEMV's inner loop, read from the code Triton compiles for
Hopper (sm_90), on any machine: no GPU is needed, only Triton's bundled ptxas and cuobjdump.

    python bench/engine_int4_sass.py [--json out.json] [--q4_1]

For each launch shape of the tuning table, the kernel is compiled as the engine launches it
(divisibility of the sizes as Triton's launcher sees it), its loop (the body of the backward
branch) disassembled, and its instructions counted against the weights one thread reads per
iteration (tile words / threads x 8, doubled for the gate/up pair), with the registers a thread
uses and the bytes it spills. --grid compiles every tile that fills its threads, not only the
tuning table's; --q4_1 the kernel as GGUF Q4_1 blocks run it (groups of 32 with fp16 minimums,
four times the groups of 128 per tile, the same K).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from floorline.engine.kernels.gemv import _gemv_int4_kernel
from floorline.engine.tuning import INT4_SHAPES

POINTERS = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "up_ptr": "*i32",
            "up_s_ptr": "*fp16", "up_z_ptr": "*u8", "bias_ptr": "*bf16", "norm_ptr": "*bf16",
            "out_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32"}
CONSTEXPRS = ("NORM", "SWIGLU", "GELU", "BIAS", "ACCUMULATE", "REDUCE", "BLOCK_N", "GROUPS",
              "GROUP", "WORDS", "SPLIT_K", "EVEN", "PDL", "ASM", "MIN")


def cuobjdump(cubin: bytes, flag: str) -> str:
    """What Triton's bundled cuobjdump prints for a compiled kernel (-sass, -res-usage)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), flag, f.name], capture_output=True, text=True,
                              check=True).stdout


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """Registers per thread and bytes spilled to the stack."""
    usage = cuobjdump(cubin, "-res-usage")
    registers, stack = (int(re.search(rf"{k}:(\d+)", usage).group(1)) for k in ("REG", "STACK"))
    return registers, stack


def loops(sass: str) -> list[list[str]]:
    """The instructions of each loop (the body of each backward branch) of disassembled code, in
    the code's order."""
    code = [(int(m.group(1), 16), m.group(2).strip())
            for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    back = [(int(b.group(1), 16), a) for a, t in code
            for b in [re.search(r"(?:@!?P\d )?BRA 0x([0-9a-f]+)", t)]
            if b and int(b.group(1), 16) < a]
    return [[t for a, t in code if start <= a <= end] for start, end in back]


def loop_body(cubin: bytes) -> list[str]:
    """The instructions of a compiled kernel's first loop (the body of its first backward
    branch); IndexError where it has none."""
    return loops(cuobjdump(cubin, "-sass"))[0]


def opcode(instruction: str) -> str:
    """An instruction's opcode without its predicate and modifiers (HFMA2.MMA -> HFMA2)."""
    return re.sub(r"^@!?P\d+ ", "", instruction).split()[0].split(".")[0]


def compile_loop(block_n: int, groups: int, warps: int, words: int, norm_swiglu: bool,
                 q4_1: bool = False) -> dict:
    pointers = {**POINTERS, **({"z_ptr": "*fp16", "up_z_ptr": "*fp16"} if q4_1 else {})}
    signature = {**pointers, "N": "i32", "K": "i32", "K_WORDS": "i32", "eps": "fp32",
                 **{c: "constexpr" for c in CONSTEXPRS}}
    group = 32 if q4_1 else 128
    if q4_1:  # the same K a tile: four groups of 32 for each of 128; 4 word positions a group
        groups, words = groups * 4, min(words, 4)
    if norm_swiglu:
        signature["x_ptr"] = "*fp32"  # the fp32 residual stream
    divisible = [*POINTERS, "N", "K", "K_WORDS"]
    attrs = {(_gemv_int4_kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in divisible}
    constexprs = dict(NORM=norm_swiglu, SWIGLU=norm_swiglu, GELU=False, BIAS=False,
                      ACCUMULATE=False, REDUCE=False, BLOCK_N=block_n, GROUPS=groups,
                      GROUP=group, WORDS=words, SPLIT_K=1, EVEN=True, PDL=True, ASM=True,
                      MIN=q4_1)
    src = ASTSource(fn=_gemv_int4_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=warps, num_stages=3))
    body = loop_body(kernel.asm["cubin"])
    ops = collections.Counter(opcode(t) for t in body)
    weights = block_n * groups * group // 8 / (warps * 32) * 8 * (2 if norm_swiglu else 1)
    registers, stack = resource_usage(kernel.asm["cubin"])
    return {"block_n": block_n, "groups": groups, "warps": warps, "words": words,
            "registers": registers, "spilled_bytes": stack,
            "norm_swiglu": norm_swiglu,
            "loop_instructions": len(body), "weights_per_thread": weights,
            "per_weight": len(body) / weights, "shared_memory_barriers": ops["BAR"],
            "top": ops.most_common(8)}


# tiles whose groups x chunks cover the program's threads (group 128: 16 word positions)
GRID = [(bn, g, w, v) for bn in (8, 16) for g in (4, 8) for w in (1, 2)
        for v in (2, 4) if g * 16 // v >= 32 * w and bn * v <= 64]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--q4_1", action="store_true",
                        help="the kernel as GGUF Q4_1 blocks run it")
    parser.add_argument("--grid", action="store_true",
                        help="every tile whose (group, chunk) positions fill the threads, not only "
                             "the tuning table's")
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    shapes = GRID if args.grid else INT4_SHAPES
    rows = [compile_loop(bn, g, w, v, fused, args.q4_1) for fused in (False, True)
            for bn, g, w, v in shapes]
    print(f"{'block_n':>7} {'groups':>6} {'warps':>5} {'words':>5} "
          f"{'norm+swiglu':>11} {'regs':>4} {'spill':>5} {'loop':>5} {'weights':>7} "
          f"{'per weight':>10}  most frequent")
    for r in rows:
        print(f"{r['block_n']:7} {r['groups']:6} {r['warps']:5} {r['words']:5} "
              f"{str(r['norm_swiglu']):>11} {r['registers']:4} "
              f"{r['spilled_bytes']:5} "
              f"{r['loop_instructions']:5} {r['weights_per_thread']:7.0f} {r['per_weight']:10.2f}  "
              + ", ".join(f"{k} {v}" for k, v in r["top"]))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
