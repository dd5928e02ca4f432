"""`awq-marlin`: AWQ int4 group-128 weights (AutoAWQ GEMM layout) through the Marlin kernels
with zero points that vLLM wrote for AWQ (gptq_marlin_gemm with has_zp, awq_marlin_repack).

No packaged Marlin runs on torch 2.11 (vLLM and sgl-kernel wheels are tied to other torch
releases; marlin-kernels 0.3.x ships no sources; torchao 0.18 has no dense Marlin), so floorline
builds the kernels of the marlin-kernels 0.2.0 sdist into its own small torch library,
`floorline_marlin` (third_party/marlin/build.sh), and loads it from FLOORLINE_MARLIN_LIB.

Repacking follows vLLM's awq_marlin.process_weights_after_loading: the weights through
awq_marlin_repack on the GPU; the scales and zero points through the column permutations of
vllm/model_executor/layers/quantization/utils/marlin_utils.py, redone here in torch.
"""

from __future__ import annotations

import os
from functools import cache

from floorline.errors import FloorlineError
from floorline.layouts import awq
from floorline.layouts.int4 import pack_int4, unpack_int4
from floorline.paths.base import PathFacts
from floorline.paths.quantised import PackedHFPath

LIBRARY_VARIABLE = "FLOORLINE_MARLIN_LIB"
# marlin_utils.get_scale_perms: the order in which a thread block's 64 columns are read.
SCALE_PERM = [i + 8 * j for i in range(8) for j in range(8)]
ZERO_INTERLEAVE = (0, 2, 4, 6, 1, 3, 5, 7)  # marlin_zero_points for 4 bits
MIN_N, MAX_PARALLEL = 64, 16  # workspace: (N / 64) * 16 locks


def marlin_scales(scales):
    """marlin_permute_scales for grouped scales [groups, N]."""
    n = scales.shape[1]
    return scales.reshape(-1, 64)[:, SCALE_PERM].reshape(-1, n).contiguous()


def marlin_zero_points(zeros):
    """awq_to_marlin_zero_points from logical zero points [groups, N] (0..15): the scale
    permutation, then the dequantiser's interleave, packed eight columns to a word in natural
    nibble order."""
    n = zeros.shape[1]
    z = zeros.reshape(-1, 64)[:, SCALE_PERM].reshape(-1, 8)[:, list(ZERO_INTERLEAVE)]
    return pack_int4(z.reshape(-1, n), dim=1)


def marlin_library_missing() -> str | None:
    lib = os.environ.get(LIBRARY_VARIABLE)
    if not lib:
        return ("the floorline_marlin kernels are not built: run `bash "
                f"third_party/marlin/build.sh` (nvcc and a CUDA torch) and set {LIBRARY_VARIABLE} "
                "to the .so it writes")
    if not os.path.isfile(lib):
        return f"{LIBRARY_VARIABLE}={lib} is not a file"
    return None


@cache
def marlin_linear():
    """The module class, made on first use, once the library is loaded."""
    import torch

    torch.ops.load_library(os.environ[LIBRARY_VARIABLE])
    ops = torch.ops.floorline_marlin

    class Linear(torch.nn.Module):
        def __init__(self, t: dict, bias, device: str):
            super().__init__()
            k, n = t["qweight"].shape[0], t["qweight"].shape[1] * 8
            self.in_features, self.out_features = k, n
            self.weight_q = ops.awq_marlin_repack(t["qweight"].to(device).contiguous(), k, n, 4)
            self.scales = marlin_scales(t["scales"].to(device, torch.float16))
            zeros = unpack_int4(t["qzeros"].to(device), dim=1, order=awq.AWQ_ORDER)
            self.zeros = marlin_zero_points(zeros)
            self.bias_fp16 = None if bias is None else bias.to(device, torch.float16)
            self.empty = torch.empty(0, dtype=torch.int32, device=device)  # no act-order
            self.workspace = torch.zeros(n // MIN_N * MAX_PARALLEL, dtype=torch.int32,
                                         device=device)

        def forward(self, x):
            rows = x.reshape(-1, self.in_features).to(torch.float16).contiguous()
            out = ops.gptq_marlin_gemm(rows, self.weight_q, self.scales, self.zeros, self.empty,
                                       self.empty, self.workspace, 4, rows.shape[0],
                                       self.out_features, self.in_features, True, True, True)
            if self.bias_fp16 is not None:
                out = out + self.bias_fp16
            return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    return Linear


class AwqMarlinPath(PackedHFPath):
    # No library: the kernels are floorline's own build (unavailable() says how to make it).
    FACTS = PathFacts("awq-marlin", "awq-int4-g128", "fp16", reference="hf-static",
                      dtype="float16", cuda_only=True)
    layout = awq
    quant_method = "awq"

    def __init__(self):
        super().__init__(self.FACTS)

    def unavailable(self, device: str) -> str | None:
        if not device.startswith("cuda"):
            return "the Marlin kernels run on CUDA only"
        return marlin_library_missing()

    def versions(self) -> dict:
        return {"marlin-kernels": "0.2.0 sources (third_party/marlin/build.sh)"}

    def check_checkpoint(self, qc: dict, name: str) -> None:
        super().check_checkpoint({**qc, "bits": qc.get("bits", qc.get("w_bit")),
                                  "group_size": qc.get("group_size", qc.get("q_group_size"))}, name)
        if qc.get("version", "gemm").lower() != "gemm" or not qc.get("zero_point", True):
            raise FloorlineError(f"{name}: awq-marlin runs AutoAWQ GEMM checkpoints with zero "
                                 f"points (quantization_config: {qc})")

    def make_linear(self, tensors: dict, bias, device: str, shared: dict):
        return marlin_linear()(tensors, bias, device)
