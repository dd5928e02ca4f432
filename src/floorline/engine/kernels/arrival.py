"""Where a kernel's programs meet: the last of them to arrive at a counter finishes what the
others left (the GEMV's K-splits of one block of rows, the argmax's blocks of the vector)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def last_to_arrive(count_ptr, programs):
    """Whether this program is the last of `programs` to arrive at the int32 counter at
    `count_ptr`. Every thread's writes before the call come first (the barrier), the arrival
    releases them and the last program's acquires the others', so the last program may read
    what they wrote, and must set the counter back to zero for the next launch."""
    tl.debug_barrier()
    return tl.atomic_add(count_ptr, 1, sem="acq_rel") == programs - 1


@triton.jit
def _taken(ptr, ok):
    """What the atomics left at `ptr` (read by adding zero: Triton's CPU interpreter has no
    floating-point exchange), zeroed for the next launch; undefined where masked off."""
    value = tl.atomic_add(ptr, 0.0, mask=ok, sem="relaxed")
    tl.store(ptr, 0.0, mask=ok)
    return value


@triton.jit
def meet_in_partials(y, y_up, squares, at, ok, squares_at, part_ptr, up_ptr, squares_ptr,
                     count_ptr, SWIGLU: tl.constexpr, NORM: tl.constexpr,
                     SPLIT_K: tl.constexpr):
    """One K-split's sums added into fp32 partials: the gate's (or only) sums y at `part_ptr +
    at` (masked by ok), the up matrix's at `up_ptr + at` with SWIGLU, the norm's sums of squares
    at `squares_ptr + squares_at` with NORM; then an arrival at `count_ptr`. Returns whether
    this split arrived last and, where it did, the whole sums, with partials and count left at
    zero (any shapes: a GEMV's vector, the rows product's tile)."""
    tl.atomic_add(part_ptr + at, y, mask=ok, sem="relaxed")
    if SWIGLU:
        tl.atomic_add(up_ptr + at, y_up, mask=ok, sem="relaxed")
    if NORM:
        tl.atomic_add(squares_ptr + squares_at, squares, sem="relaxed")
    last = last_to_arrive(count_ptr, SPLIT_K)
    if last:
        y = _taken(part_ptr + at, ok)
        if SWIGLU:
            y_up = _taken(up_ptr + at, ok)
        if NORM:
            squares = _taken(squares_ptr + squares_at, None)
        tl.store(count_ptr, 0)
    return last, y, y_up, squares
