"""float8 e4m3 in Triton kernels: rounding onto its grid, and fp32 values split into two e4m3
parts for the tensor cores' 8-bit dots (decode attention's fp8 cache, the fp8 GEMV's dots)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e4m3_grid(x):
    """fp32 values within e4m3's range, rounded to the nearest e4m3 value (ties to even) in
    fp32, so that the conversion after it is exact. The hardware converts so itself; Triton's
    interpreter, where the CPU tests run, rounds ties away from zero and loses the carry into
    the exponent (31.75 becomes 16), so the rounding is done here, the same everywhere: adding
    2^(e + 20) to a value of exponent e leaves its bits at e4m3's step, 2^(e - 3)."""
    exponent = tl.maximum(((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    magic = ((exponent + 20 + 127) << 23).to(tl.float32, bitcast=True)
    r = (tl.abs(x) + magic) - magic  # below 2^-6 the step stays 2^-9 (subnormals)
    return tl.where(x < 0, -r, r)


@triton.jit
def e4m3(x, dtype: tl.constexpr, EXACT: tl.constexpr):
    """fp32 values within e4m3's range in e4m3, rounded to nearest (ties to even): the
    hardware's conversion, or in Triton's interpreter (EXACT) on the grid first (e4m3_grid)."""
    if EXACT:
        x = e4m3_grid(x)
    return x.to(dtype)


@triton.jit
def row_powers(largest):
    """Per row, 2^k and 2^-k with largest * 2^k in [128, 256) (largest >= 0; k clamped so that
    both stay normal floats, which leaves a zero row at zero)."""
    e = tl.minimum(tl.maximum((largest.to(tl.int32, bitcast=True) >> 23) & 0xFF, 8), 254)
    return (((261 - e) << 23).to(tl.float32, bitcast=True),
            ((e - 7) << 23).to(tl.float32, bitcast=True))


@triton.jit
def split_e4m3(x, dtype: tl.constexpr, EXACT: tl.constexpr):
    """fp32 x with |x| < 256 as e4m3 (hi, lo), x ~ hi + lo / 16: hi keeps four significant
    bits, lo the next four (the rest of a bf16 value exactly, down to e4m3's subnormals)."""
    hi = e4m3(x, dtype, EXACT)
    return hi, e4m3((x - hi.to(tl.float32)) * 16.0, dtype, EXACT)
