"""torchao: `torchao-int4`, int4 weight-only with group 128 in the tinygemm layout
(Int4TilePackedTo4dTensor: bf16 scale and zero per group), quantised by torchao's `quantize_`.
The layout needs CUDA (torch's _weight_int4pack_mm); `+compile` is what torchao recommends."""

from __future__ import annotations

from floorline.paths.base import Library, PathFacts
from floorline.paths.quantised import QuantisingHFPath


class TorchaoInt4Path(QuantisingHFPath):
    FACTS = PathFacts("torchao-int4", "int4-g128", reference="hf-static", dtype="bfloat16",
                      library=Library("torchao", "torchao", "torchao"), cuda_only=True)

    def __init__(self):
        super().__init__(self.FACTS)

    def quantise(self, hf_model, device: str) -> None:
        import torch
        from torchao.quantization import Int4WeightOnlyConfig, quantize_

        head = hf_model.get_output_embeddings()
        config = Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d")
        quantize_(hf_model, config,
                  filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and m is not head)
