"""Whether Triton packs 16-bit arithmetic and logic two to a 32-bit register, read from the code
it compiles for Hopper (sm_90) on any machine: a loop that dequantises int16 words of nibbles
into fp16 with the 0x6400 bit trick and multiply-adds them, 8 values a thread per iteration.

    python bench/triton_half2_sass.py

Packed arithmetic shows as HADD2/HFMA2 at half an instruction per value; the mask-and-or of each
value as one LOP3 per value means the logic is not packed.
"""

from __future__ import annotations

import collections
import os

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine_int4_sass import loop_body, opcode

BLOCK = 256  # values per iteration: 8 per thread of one warp


@triton.jit
def _half2_loop(w_ptr, x_ptr, out_ptr, K, BLOCK: tl.constexpr):
    acc = tl.zeros((BLOCK,), tl.float16)
    offs = tl.arange(0, BLOCK)
    for k0 in range(0, K, BLOCK):
        w = tl.load(w_ptr + k0 + offs)
        x = tl.load(x_ptr + k0 + offs)
        q = ((w & 0x000F) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
        acc += q * x
    tl.store(out_ptr + offs, acc)


def main() -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    signature = {"w_ptr": "*i16", "x_ptr": "*fp16", "out_ptr": "*fp16", "K": "i32",
                 "BLOCK": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(4)}
    src = ASTSource(fn=_half2_loop, signature=signature, constexprs={"BLOCK": BLOCK}, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=1, num_stages=1))
    body = loop_body(kernel.asm["cubin"])
    ops = collections.Counter(opcode(t) for t in body)
    values = ops["LDG"] // 2 * 8  # each iteration loads 8 words and 8 x values, 16 B each
    print(f"loop of {len(body)} instructions over {values} values a thread (Triton "
          f"{triton.__version__}, sm_90)")
    for name, count in ops.most_common():
        print(f"  {name:8} {count:3}  {count / values:.2f} per value")


if __name__ == "__main__":
    main()
