"""The prototype int4 GEMV in CUDA on the tensor cores (bench/engine_int4_mma.py): its
arithmetic, lane by lane as the kernel indexes registers and shared memory, against the
dequantised product; and, where nvcc is installed, the kernel built for Hopper (sm_90) with the
instructions its design rests on, and its launch's checks."""

import shutil
import sys
from pathlib import Path

import pytest
import torch

from floorline.engine import quant

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from engine_int4_mma import emulate  # noqa: E402


@pytest.mark.parametrize("n, k, sets, warps, splits", [
    (128, 256, 1, 4, 1),  # one tile of two groups
    (128, 1280, 2, 2, 2),  # ten groups in two splits: tiles of five, rows in two sets
])
def test_the_kernels_indexing_computes_w_x(n, k, sets, warps, splits):
    torch.manual_seed(n + k)
    w = quant.quantise(torch.randn(n, k) * 0.02, "int4")
    x = torch.randn(k).to(torch.bfloat16)
    x[7] = 30.0  # an outlier: its group scaled by it, as the residual stream's are
    got = emulate(x, w, sets, warps, splits).double()

    def error(want):
        return ((got - want).norm() / want.norm()).item()

    # x on the kernel's grid: per group of 128, 2^-14 of the power of two above its largest |x|
    # (2^14 itself clamped to 2^14 - 1), where the integer arithmetic after it is exact
    groups = x.double().reshape(-1, 128)
    exponent = torch.frexp(groups.abs().amax(1, keepdim=True))[1] - 1
    scale = torch.pow(2.0, 13 - exponent.double())
    on_grid = (torch.round(groups * scale).clamp(max=16383) / scale).flatten()
    assert error(w.dequantise().double() @ on_grid) < 1e-6
    assert error(w.dequantise().double() @ x.double()) < 1e-3  # the bench's MAX_ERROR


def test_the_emulation_refuses_launches_the_kernel_has_not():
    w = quant.quantise(torch.randn(64, 256) * 0.02, "int4")
    with pytest.raises(ValueError, match="a launch of"):
        emulate(torch.zeros(256, dtype=torch.bfloat16), w, sets=1, warps=1)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_the_kernel_builds_for_hopper_on_the_tensor_cores(tmp_path):
    from engine_int4_mma import Int4Mma, build, compiled

    library = build("sm_90", tmp_path)
    rows = compiled(library)
    assert len(rows) == 7  # one per launch built
    for row in rows:
        # no spills; a group's loop (two groups with the loads ahead): the products on the tensor
        # cores and 16-byte weight loads, one of each per row block, slice and set
        top, groups = dict(row["group_top"]), 2 if row["ahead"] else 1
        assert row["spilled_bytes"] == 0 and top["IMMA"] == 16 * row["sets"] * groups, row
        assert top["LDG"] == 4 * row["sets"] * groups, row
    kernel = Int4Mma(library)  # loads without a GPU; launching needs one
    w = quant.quantise(torch.randn(64, 256) * 0.02, "int4")
    x, out = torch.zeros(256, dtype=torch.bfloat16), torch.zeros(64)
    # 64 rows: not 4 warps' 256; no split; no instance
    for sets, warps, ahead, splits in [(2, 4, 0, 1), (1, 2, 0, 0), (1, 2, 1, 1)]:
        with pytest.raises(ValueError, match="64x256"):
            kernel(x, w, out, sets, warps, ahead, splits)
