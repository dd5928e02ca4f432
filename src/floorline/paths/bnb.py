"""bitsandbytes: `bnb-nf4` (NF4, block 64, fp32 absmax, no double quantisation) and `bnb-int8`
(LLM.int8 with transformers' default outlier threshold 6.0), quantised from 16-bit weights by
bitsandbytes' own quantiser as transformers' BitsAndBytesConfig does it."""

from __future__ import annotations

import logging

from floorline.paths.base import Library, PathFacts
from floorline.paths.quantised import QuantisingHFPath, replace_linears

# On a CPU with AVX512-BF16, importing bitsandbytes logs that it could not fetch an optional
# kernel from the Hugging Face hub (it falls back to its own): not the user's concern.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: not record.getMessage().startswith("Failed to load CPU gemm_4bit_forward"))


BITSANDBYTES = Library("bitsandbytes", "bitsandbytes", "bnb")


class BnbPath(QuantisingHFPath):
    FACTS = {kind: PathFacts(f"bnb-{kind}", weight_format, reference="hf-static", dtype="bfloat16",
                             library=BITSANDBYTES)
             for kind, weight_format in (("nf4", "nf4"), ("int8", "bnb-int8"))}

    def __init__(self, kind: str):
        super().__init__(self.FACTS[kind])
        self.kind = kind

    def quantise(self, hf_model, device: str) -> None:
        import bitsandbytes as bnb

        def make(name, linear):
            shape = (linear.in_features, linear.out_features, linear.bias is not None)
            # The parameter classes quantise when they are moved to a device.
            if self.kind == "nf4":
                q = bnb.nn.Linear4bit(*shape, compute_dtype=linear.weight.dtype, quant_type="nf4",
                                      compress_statistics=False, device="meta")
                q.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, blocksize=64,
                                             compress_statistics=False, quant_type="nf4").to(device)
            else:
                q = bnb.nn.Linear8bitLt(*shape, has_fp16_weights=False, threshold=6.0,
                                        device="meta")
                q.weight = bnb.nn.Int8Params(linear.weight.data, requires_grad=False,
                                             has_fp16_weights=False).to(device)
            if linear.bias is not None:
                q.bias = linear.bias
            return q

        replace_linears(hf_model, make)
