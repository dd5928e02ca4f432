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
