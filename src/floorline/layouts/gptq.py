"""GPTQ int4 (AutoGPTQ "v1" on-disk layout, what exllamav2 reads):

    qweight int32 [in/8, out]     8 input rows per word, natural nibble order
    qzeros  int32 [groups, out/8] zero point - 1, 8 output columns per word
    scales  fp16  [groups, out]
    g_idx   int32 [in]            group of each input row: i // group_size (no act-order)
    W[o, i] = (q[i, o] - zero[g_idx[i], o]) * scales[g_idx[i], o]

(auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py, QuantLinear.pack; exllamav2's kernel adds the
1 back, q_gemm_kernel_gptq.cuh.) A zero point is therefore 1..16 in this layout.
"""

from __future__ import annotations

from floorline.layouts.int4 import dequantise_groups, pack_int4, random_groups, unpack_int4

TENSORS = ("qweight", "qzeros", "scales", "g_idx")


def pack(q, zeros, scales, group_size: int) -> dict:
    """q [out, in] 0..15, zeros [groups, out] 1..16, scales [groups, out] -> GPTQ tensors."""
    import torch

    if zeros.numel() and (zeros.min() < 1 or zeros.max() > 16):
        raise ValueError("GPTQ v1 stores zero - 1 in 4 bits: zero points must lie in 1..16")
    in_features = q.shape[1]
    return {
        "qweight": pack_int4(q.t(), dim=0),
        "qzeros": pack_int4(zeros - 1, dim=1),
        "scales": scales.to(torch.float16).contiguous(),
        "g_idx": (torch.arange(in_features, device=q.device) // group_size).to(torch.int32),
    }


def unpack(t: dict):
    """GPTQ tensors -> (q [out, in], zeros [groups, out]) as integers."""
    return unpack_int4(t["qweight"], dim=0).t(), unpack_int4(t["qzeros"], dim=1) + 1


def dequantise(t: dict, group_size: int):
    """The fp16 [out, in] weight the layout holds."""
    q, zeros = unpack(t)
    return dequantise_groups(q, zeros, t["scales"], group_size)


def random(out_features: int, in_features: int, group_size: int, generator, device) -> dict:
    groups = random_groups(out_features, in_features, group_size, generator, device)
    return pack(*groups, group_size)
