"""A GGUF file's weights as the engine's, as the file stores them: the `gguf` weights.

Each matrix keeps its blocks' own values, never decoded to floats and rounded again: Q4_0 blocks
become the int4 layout in groups of 32 with zero point 8, Q4_1 and Q8_0 blocks the engine's
q4_1 and q8_0 formats (floorline.engine.quant), and an F32, F16 or BF16 matrix the 16-bit dtype.
The LM head is the file's `output.weight`, or its token table where the two are tied, in that
table's blocks. What a step reads whole is kept as stored; what it reads a row of (the token
table, for the embedding) and the norms are decoded by gguf-py and held in the 16-bit dtype.

Blocks are read from the file's bytes as ggml-common.h lays them out, 32 weights along K each:
    Q4_0: fp16 d, 16 bytes of nibbles          W = d * (q - 8)
    Q4_1: fp16 d, fp16 m, 16 bytes of nibbles  W = d * q + m
    Q8_0: fp16 d, 32 int8 q                    W = d * q
where byte j's low nibble is weight j of the block and its high nibble weight j + 16. The q and
k projections' rows are permuted back from llama.cpp's rotary order as the checkpoint
converter permutes them (floorline.models.gguf_checkpoint).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from floorline.engine import quant
from floorline.engine.weights import DecoderWeights, from_named
from floorline.errors import FloorlineError
from floorline.models.gguf_checkpoint import (
    decoded,
    hf_name,
    open_gguf,
    rotary_heads,
    unpermute_rotary,
)

BLOCK_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # run as stored
DENSE_TYPES = ("F32", "F16", "BF16")  # held in the 16-bit dtype
HEADER = {"Q4_0": 2, "Q4_1": 4, "Q8_0": 2}  # bytes before a block's weights


def _fp16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte `at` of each block: [rows, blocks]."""
    return blocks[..., at:at + 2].contiguous().view(torch.float16)[..., 0]


def block_weight(raw: np.ndarray, type_name: str, name: str, heads: int | None = None,
                 device="cpu"):
    """One matrix from its blocks: `raw` uint8 [rows, bytes per row] as the reader gives it,
    `heads` set for the q and k projections (their rows permuted back); unpacked on `device`."""
    if type_name not in BLOCK_TYPES:
        raise FloorlineError(f"tensor '{name}' is of type {type_name}; the engine runs GGUF "
                             f"blocks of {', '.join(BLOCK_TYPES)} as stored (and "
                             f"{', '.join(DENSE_TYPES)} matrices)")
    size = HEADER[type_name] + (quant.BLOCK if type_name == "Q8_0" else quant.BLOCK // 2)
    rows = raw.shape[0]
    if raw.ndim != 2 or raw.shape[1] % size:
        raise FloorlineError(f"tensor '{name}' ({type_name}): {list(raw.shape)} bytes are not "
                             f"whole rows of {size}-byte blocks")
    if heads is not None:
        raw = unpermute_rotary(raw, heads)
    blocks = torch.from_numpy(np.array(raw)).to(device).view(rows, -1, size)  # off the file
    scales = _fp16(blocks, 0)
    body = blocks[..., HEADER[type_name]:]
    if type_name == "Q8_0":
        return quant.Q8_0Weight(body.contiguous().view(torch.int8).reshape(rows, -1), scales)
    # byte j: weight j in the low nibble, weight j + 16 in the high one
    q = torch.cat([body & 0xF, body >> 4], dim=-1).reshape(rows, -1)
    try:
        if type_name == "Q4_0":
            return quant.int4_from_integers(q, torch.full_like(scales, 8, dtype=torch.uint8),
                                            scales, quant.BLOCK)
        return quant.q4_1_from_integers(q, scales, _fp16(blocks, 2))
    except ValueError as e:
        raise FloorlineError(f"tensor '{name}' ({type_name}): {e}") from None


def load_gguf(path: Path, config, device, dtype) -> DecoderWeights:
    """The engine's weights from a Llama-architecture GGUF file (`config`: its DecoderConfig),
    each matrix as stored (module docstring), on `device`."""
    reader = open_gguf(path)
    by_name = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is not None:
            by_name[name] = t

    def tensor(name):
        t = by_name.get(name)
        if t is None:
            raise FloorlineError(f"{path}: no tensor for '{name}' (the engine reads "
                                 "Llama-architecture GGUF files)")
        return t

    def get(name):
        """The tensor's values as floats, shaped as Hugging Face's [out, in]."""
        return torch.from_numpy(np.array(decoded(tensor(name), config.heads, config.kv_heads,
                                                 path)))

    def linear(prefix):
        name = prefix + ".weight"
        t = tensor(name)
        if t.tensor_type.name in DENSE_TYPES:
            return get(name).to(device=device, dtype=dtype)
        w = block_weight(np.asarray(t.data), t.tensor_type.name, t.name,
                         rotary_heads(name, config.heads, config.kv_heads), device)
        shape = tuple(int(d) for d in reversed(t.shape))
        if tuple(w.shape) != shape:
            raise FloorlineError(f"{path}: tensor '{t.name}' holds {list(w.shape)} weights "
                                 f"where its header says {list(shape)}")
        return w

    return from_named(config, get, device, dtype, linear=linear, head_weight=linear,
                      source=str(path))
