"""`gptq-exllamav2`: GPTQ int4 group-128 weights through exllamav2's own CUDA kernels
(exllamav2_ext: make_q_matrix, gemm_half_q_half), in fp16 as exllamav2 runs them.

Each layer's tensors go to make_q_matrix as exllamav2's own loader passes them (its g_idx too,
so the kernel reads activations through the identity permutation it builds), with the bias
fused. make_q_matrix shuffles qweight in place and keeps raw pointers to the tensors, so the
module holds them as plain attributes that nothing moves or casts afterwards.
"""

from __future__ import annotations

from functools import cache

from floorline.errors import FloorlineError
from floorline.layouts import gptq
from floorline.paths.base import Library, PathFacts
from floorline.paths.quantised import PackedHFPath


@cache
def exllamav2_linear():
    """The module class, made on first use: importing exllamav2 builds its extension."""
    import torch
    from exllamav2.ext import exllamav2_ext as ext  # builds the extension at first import

    none = torch.empty((1, 1), device="meta")

    class Linear(torch.nn.Module):
        def __init__(self, t: dict, bias, device: str, shared: dict):
            super().__init__()
            self.in_features, self.out_features = t["qweight"].shape[0] * 8, t["qweight"].shape[1]
            self.qweight = t["qweight"].to(device).contiguous()
            self.qzeros = t["qzeros"].to(device).contiguous()
            self.scales = t["scales"].to(device, torch.float16).contiguous()
            self.bias_fp16 = None if bias is None else bias.to(device, torch.float16).contiguous()
            self.q_perm = torch.empty(self.in_features, dtype=torch.int16, device=device)
            self.q_invperm = torch.empty_like(self.q_perm)
            # Prefill (more than 32 rows) dequantises into a buffer the model's layers share and
            # calls cuBLAS; decode never touches it.
            scratch = shared.get("temp_dq")
            need = self.in_features * self.out_features
            if scratch is None or scratch.numel() < need:
                scratch = shared["temp_dq"] = torch.empty(need, dtype=torch.float16, device=device)
            self.temp_dq = scratch
            self.handle = ext.make_q_matrix(
                self.qweight, self.q_perm, self.q_invperm, none, none, none, none, self.qzeros,
                self.scales, t["g_idx"].to("cpu", torch.int32).contiguous(),
                none if self.bias_fp16 is None else self.bias_fp16, scratch, self.in_features)

        def forward(self, x):
            rows = x.reshape(-1, self.in_features)
            out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float16,
                              device=x.device)
            ext.gemm_half_q_half(rows.to(torch.float16).contiguous(), self.handle, out, False)
            return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    return Linear


class ExllamaV2Path(PackedHFPath):
    FACTS = PathFacts("gptq-exllamav2", "gptq-int4-g128", "fp16", reference="hf-static",
                      dtype="float16", library=Library("exllamav2", "exllamav2", "exllamav2"),
                      cuda_only=True)
    layout = gptq
    quant_method = "gptq"

    def __init__(self):
        super().__init__(self.FACTS)

    def check_checkpoint(self, qc: dict, name: str) -> None:
        super().check_checkpoint(qc, name)
        if qc.get("checkpoint_format", "gptq") != "gptq":  # gptq_v2 stores zeros without the -1
            raise FloorlineError(f"{name}: exllamav2 reads GPTQ v1 checkpoints, not "
                                 f"{qc['checkpoint_format']}")

    def make_linear(self, tensors: dict, bias, device: str, shared: dict):
        return exllamav2_linear()(tensors, bias, device, shared)
