"""AWQ int4 (AutoAWQ GEMM on-disk layout):

    qweight int32 [in, out/8]       8 output columns per word, interleaved nibble order
    qzeros  int32 [groups, out/8]   zero point (0..15), same packing
    scales  fp16  [groups, out]
    W[o, i] = (q[i, o] - zero[i // group_size, o]) * scales[i // group_size, o]

(awq/modules/linear/gemm.py, WQLinear_GEMM.from_linear; awq/utils/packing_utils.py.)
"""

from __future__ import annotations

from floorline.layouts.int4 import dequantise_groups, pack_int4, random_groups, unpack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
TENSORS = ("qweight", "qzeros", "scales")


def pack(q, zeros, scales, group_size: int) -> dict:
    """q [out, in] 0..15, zeros [groups, out] 0..15, scales [groups, out] -> AWQ tensors."""
    import torch

    return {
        "qweight": pack_int4(q.t(), dim=1, order=AWQ_ORDER),
        "qzeros": pack_int4(zeros, dim=1, order=AWQ_ORDER),
        "scales": scales.to(torch.float16).contiguous(),
    }


def unpack(t: dict):
    """AWQ tensors -> (q [out, in], zeros [groups, out]) as integers."""
    return (unpack_int4(t["qweight"], dim=1, order=AWQ_ORDER).t(),
            unpack_int4(t["qzeros"], dim=1, order=AWQ_ORDER))


def dequantise(t: dict, group_size: int):
    q, zeros = unpack(t)
    return dequantise_groups(q, zeros, t["scales"], group_size)


def random(out_features: int, in_features: int, group_size: int, generator, device,
           std: float = 0.02) -> dict:
    return pack(*random_groups(out_features, in_features, group_size, generator, device, std),
                group_size)
