"""The decoder's weights in the engine's layout: q, k and v fused into one matrix (one product
per layer instead of three), everything else as the checkpoint stores it ([out, in] rows).

Sources: a Hugging Face checkpoint directory (sharded safetensors, read straight onto the
device), any mapping of Hugging Face names to tensors (a transformers model's state_dict, for
the comparisons), or seeded random weights drawn on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from floorline.errors import FloorlineError


@dataclass
class LayerWeights:
    wqkv: torch.Tensor
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    wgate: torch.Tensor
    wup: torch.Tensor
    wdown: torch.Tensor
    ln1: torch.Tensor
    ln2: torch.Tensor


@dataclass
class DecoderWeights:
    embed: torch.Tensor
    head: torch.Tensor  # the embedding table itself when tied
    norm: torch.Tensor
    layers: list[LayerWeights]

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device


def from_named(config, get: Callable[[str], torch.Tensor], device, dtype) -> DecoderWeights:
    """Weights from Hugging Face parameter names; `get(name)` returns the tensor."""
    def take(name):
        return get(name).to(device=device, dtype=dtype)

    layers = []
    for i in range(config.layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        layers.append(LayerWeights(
            wqkv=torch.cat([take(a + f"{x}_proj.weight") for x in "qkv"]),
            bqkv=torch.cat([take(a + f"{x}_proj.bias") for x in "qkv"]) if config.qkv_bias else None,
            wo=take(a + "o_proj.weight"),
            bo=take(a + "o_proj.bias") if config.o_bias else None,
            wgate=take(p + "mlp.gate_proj.weight"), wup=take(p + "mlp.up_proj.weight"),
            wdown=take(p + "mlp.down_proj.weight"),
            ln1=take(p + "input_layernorm.weight"), ln2=take(p + "post_attention_layernorm.weight"),
        ))
    embed = take("model.embed_tokens.weight")
    head = embed if config.tied else take("lm_head.weight")
    return DecoderWeights(embed, head, take("model.norm.weight"), layers)


def load_checkpoint(directory: Path, config, device, dtype) -> DecoderWeights:
    """A checkpoint directory's safetensors shards, each tensor read onto `device` as needed."""
    from safetensors import safe_open

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FloorlineError(f"{directory} holds no .safetensors files")
    where = {}
    for f in files:
        handle = safe_open(str(f), framework="pt", device=str(device))
        for name in handle.keys():
            if name in where:
                raise FloorlineError(f"{directory}: tensor '{name}' is in more than one "
                                     "safetensors file")
            where[name] = handle

    def get(name):
        if name not in where:
            raise FloorlineError(f"{directory}: no tensor '{name}' in its safetensors files "
                                 "(the engine reads Hugging Face Llama/Qwen2/Mistral names)")
        return where[name].get_tensor(name)

    return from_named(config, get, device, dtype)


def random_weights(config, device, dtype, seed: int) -> DecoderWeights:
    """Seeded normal(0, initializer_range) matrices and biases, norms near one, drawn on the
    device (a 7B model in seconds on a GPU)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    c = config

    def normal(*shape, mean=0.0, std=c.initializer_range):
        return torch.empty(shape, device=device, dtype=dtype).normal_(mean, std,
                                                                       generator=generator)

    def norm():
        return normal(c.hidden, mean=1.0, std=0.02)

    layers = [LayerWeights(
        wqkv=normal(c.qkv_rows, c.hidden),
        bqkv=normal(c.qkv_rows) if c.qkv_bias else None,
        wo=normal(c.hidden, c.heads * c.head_dim),
        bo=normal(c.hidden) if c.o_bias else None,
        wgate=normal(c.intermediate, c.hidden), wup=normal(c.intermediate, c.hidden),
        wdown=normal(c.hidden, c.intermediate), ln1=norm(), ln2=norm(),
    ) for _ in range(c.layers)]
    embed = normal(c.vocab, c.hidden)
    head = embed if c.tied else normal(c.vocab, c.hidden)
    return DecoderWeights(embed, head, norm(), layers)
