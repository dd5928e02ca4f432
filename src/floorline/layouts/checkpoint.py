"""A packed int4 checkpoint (AutoAWQ GEMM or GPTQ v1) of any config, written from random
integers as those tools store them, beside the transformers model that holds exactly the
matrices the packed tensors stand for: the same weights for every runtime that loads the
directory, and a float32 reference to compare them with."""

from __future__ import annotations

import json
from pathlib import Path

from floorline.layouts import awq, gptq
from floorline.layouts.int4 import random_groups
from floorline.models import build_model

QUANTIZATION_CONFIGS = {
    "awq": {"quant_method": "awq", "bits": 4, "version": "gemm", "zero_point": True},
    "gptq": {"quant_method": "gptq", "bits": 4, "desc_act": False, "sym": True,
             "checkpoint_format": "gptq"},
}


def write_packed_checkpoint(model_spec, directory: Path, layout_name: str, *, group: int = 128,
                            seed: int = 5, device: str = "cpu", **qc_extra):
    """`model_spec`'s config as a `layout_name` ('awq' or 'gptq') int4 checkpoint in `directory`:
    its decoder linears packed from random integers, every other tensor fp16, and config.json
    with the quantization_config (qc_extra overrides its fields; GPTQ's zero points are 8 unless
    sym is False). Returns the float32 transformers model whose linears are (q - zero) * scale,
    computed from the integers drawn, not through any unpacking, and whose other tensors are the
    stored fp16 ones."""
    import torch
    from safetensors.torch import save_file

    layout = {"awq": awq, "gptq": gptq}[layout_name]
    hf = build_model(model_spec.without_weights(), device, torch.float32, seed)
    generator = torch.Generator(device).manual_seed(seed + 1)
    qc = {**QUANTIZATION_CONFIGS[layout_name], "group_size": group, **qc_extra}
    tensors = {}
    packed_weights = set()  # the linears' weights, stored packed; their biases stay fp16
    head = hf.get_output_embeddings()
    with torch.no_grad():
        for name, module in hf.named_modules():
            if not isinstance(module, torch.nn.Linear) or module is head:
                continue
            q, zeros, scales = random_groups(module.out_features, module.in_features, group,
                                             generator, device)
            if layout_name == "gptq" and qc.get("sym", True):
                zeros = torch.full_like(zeros, 8)
            packed = layout.pack(q, zeros, scales, group)
            tensors.update({f"{name}.{k}": v.cpu() for k, v in packed.items()})
            packed_weights.add(f"{name}.weight")
            cols = torch.arange(module.in_features, device=device) // group
            module.weight.copy_((q - zeros.t()[:, cols]).float() * scales.float().t()[:, cols])
        for name, p in hf.named_parameters():
            if name not in packed_weights:
                stored = p.to(torch.float16)
                tensors[name] = stored.cpu().contiguous()
                p.copy_(stored.float())  # the reference runs on the stored values
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = hf.config.to_dict()
    config["quantization_config"] = qc
    config["torch_dtype"] = "float16"
    (directory / "config.json").write_text(json.dumps(config))
    return hf
