"""GGUF files with seeded random weights, for llama.cpp, written with the `gguf` package.

Tensor types follow llama.cpp's own tools: `bf16` is convert_hf_to_gguf's --outtype bf16 (every
matrix BF16, norms and biases F32); `q4_0` and `q4_1` are llama-quantize's Q4_0 and Q4_1
(matrices and the embedding table in that type, the LM head Q6_K, or Q8_0 where a row is not a
multiple of 256; a tied table is quantised as the head); `q8_0` is its Q8_0 (every matrix Q8_0,
the head too). Quantised tensors are drawn directly as random blocks in ggml's layout
(ggml-common.h), never through floats, with scales chosen so that the weights they hold have a
standard deviation near 0.02. The vocabulary is llama.cpp's "none" model: token ids without text.
"""

from __future__ import annotations

import math
from pathlib import Path

from floorline.errors import FloorlineError

STD = 0.02
CHUNK = 1 << 24  # weights drawn per chunk, so that a 7B file is written in bounded memory
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
WRITER_VERSION = 1  # part of the cache key: a changed writer writes new files


def _fp16_bytes(x):
    import numpy as np

    return x.astype(np.float16).view(np.uint8).reshape(-1, 2)


def q4_0_blocks(rng, n: int):
    """block_q4_0 {fp16 d; uint8 qs[16]}: weight = d * (q - 8), q[j] low and q[j + 16] high
    nibble of qs[j]. q is drawn from 1..15, so that the weights are centred on zero."""
    import numpy as np

    out = np.empty((n, 18), np.uint8)
    out[:, :2] = _fp16_bytes(STD / math.sqrt((15**2 - 1) / 12) * rng.uniform(0.9, 1.1, n))
    q = rng.integers(1, 16, (n, 32), dtype=np.uint8)
    out[:, 2:] = q[:, :16] | (q[:, 16:] << 4)
    return out


def q4_1_blocks(rng, n: int):
    """block_q4_1 {fp16 d; fp16 m; uint8 qs[16]}: weight = d * q + m, nibbles as Q4_0's. q is
    drawn from 0..15 and m near -7.5 d, so that the weights are centred on zero."""
    import numpy as np

    out = np.empty((n, 20), np.uint8)
    d = (STD / math.sqrt((16**2 - 1) / 12) * rng.uniform(0.9, 1.1, n)).astype(np.float16)
    out[:, :2] = _fp16_bytes(d)
    out[:, 2:4] = _fp16_bytes(-d.astype(np.float32) * rng.uniform(7.0, 8.0, n))
    q = rng.integers(0, 16, (n, 32), dtype=np.uint8)
    out[:, 4:] = q[:, :16] | (q[:, 16:] << 4)
    return out


def q8_0_blocks(rng, n: int):
    """block_q8_0 {fp16 d; int8 qs[32]}: weight = d * q."""
    import numpy as np

    out = np.empty((n, 34), np.uint8)
    out[:, :2] = _fp16_bytes(STD / math.sqrt((255**2 - 1) / 12) * rng.uniform(0.9, 1.1, n))
    out[:, 2:] = rng.integers(-127, 128, (n, 32), dtype=np.int8).view(np.uint8)
    return out


def q6_k_blocks(rng, n: int):
    """block_q6_K {uint8 ql[128]; uint8 qh[64]; int8 scales[16]; fp16 d} for 256 weights:
    weight = d * scale * (q - 32), q a 6-bit value split over ql and qh."""
    import numpy as np

    out = np.empty((n, 210), np.uint8)
    out[:, :192] = rng.integers(0, 256, (n, 192), dtype=np.uint8)
    out[:, 192:208] = rng.integers(8, 17, (n, 16), dtype=np.int8).view(np.uint8)
    scale = STD / (12.3 * math.sqrt((64**2 - 1) / 12))
    out[:, 208:] = _fp16_bytes(scale * rng.uniform(0.9, 1.1, n))
    return out


def _plan(cfg, fmt: str, head: str | None = None):
    """[(name, numpy shape, ggml type, kind)] of a Llama/Mistral/Qwen2 config, in file order;
    `head` a type for the LM head (and a tied table) in place of llama-quantize's choice."""
    from gguf import GGMLQuantizationType as T

    h, ff, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    hd = getattr(cfg, "head_dim", None) or h // heads
    vocab, tied = cfg.vocab_size, bool(cfg.tie_word_embeddings)

    def matrix(is_head=False):
        if is_head and head is not None:
            return T[head.upper()]
        if fmt in ("bf16", "q8_0"):
            return T[fmt.upper()]
        return (T.Q6_K if h % 256 == 0 else T.Q8_0) if is_head else T[fmt.upper()]

    plan = [("token_embd.weight", (vocab, h), matrix(is_head=tied), "matrix")]
    bias = cfg.model_type == "qwen2" or getattr(cfg, "attention_bias", False)
    for i in range(layers):
        p = f"blk.{i}."
        plan.append((p + "attn_norm.weight", (h,), T.F32, "norm"))
        for name, rows in (("attn_q", heads * hd), ("attn_k", kv * hd), ("attn_v", kv * hd)):
            plan.append((p + name + ".weight", (rows, h), matrix(), "matrix"))
            if bias:
                plan.append((p + name + ".bias", (rows,), T.F32, "bias"))
        plan += [(p + "attn_output.weight", (h, heads * hd), matrix(), "matrix"),
                 (p + "ffn_norm.weight", (h,), T.F32, "norm"),
                 (p + "ffn_gate.weight", (ff, h), matrix(), "matrix"),
                 (p + "ffn_up.weight", (ff, h), matrix(), "matrix"),
                 (p + "ffn_down.weight", (h, ff), matrix(), "matrix")]
    plan.append(("output_norm.weight", (h,), T.F32, "norm"))
    if not tied:
        plan.append(("output.weight", (vocab, h), matrix(is_head=True), "matrix"))
    return plan


def _chunks(shape, qtype, kind, rng):
    """The tensor's bytes, a bounded number of rows at a time."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as T

    row = shape[-1]
    rows = math.prod(shape[:-1])
    step = max(1, CHUNK // row)
    for start in range(0, rows, step):
        n = min(step, rows - start) * row
        if qtype == T.F32:
            yield ((1.0 if kind == "norm" else 0.0)
                   + STD * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)
        elif qtype == T.BF16:
            bits = (STD * rng.standard_normal(n, dtype=np.float32)).view(np.uint32)
            # round to nearest even
            yield ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        else:
            block = GGML_QUANT_SIZES[qtype][0]
            blocks = {T.Q4_0: q4_0_blocks, T.Q4_1: q4_1_blocks, T.Q8_0: q8_0_blocks,
                      T.Q6_K: q6_k_blocks}[qtype]
            yield blocks(rng, n // block)


class _Streamed:
    """What GGUFWriter.write_tensor_data needs of an array (nbytes, tofile), drawn in chunks."""

    def __init__(self, nbytes: int, chunks):
        self.nbytes, self.chunks = nbytes, chunks

    def tofile(self, fp) -> None:
        for chunk in self.chunks:
            fp.write(memoryview(chunk).cast("B"))


def tensor_bytes(shape, qtype) -> int:
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    return math.prod(shape) // block * size


def write_random_gguf(config, path: Path, fmt: str, seed: int, head: str | None = None) -> None:
    """Writes a GGUF of `config` (a transformers config) in `fmt`; `head` (a GGML type name,
    as llama-quantize's --output-tensor-type) overrides the LM head's type."""
    import gguf
    import numpy as np

    cfg = config.get_text_config()
    arch = ARCHITECTURES.get(cfg.model_type)
    if arch is None:
        raise FloorlineError(f"no GGUF writer for model_type '{cfg.model_type}' "
                             f"(known: {', '.join(ARCHITECTURES)})")
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type not in ("default", "llama3"):
        raise FloorlineError(f"no GGUF writer for rope scaling {rope}")
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        raise FloorlineError("no GGUF writer for sliding-window attention")
    theta = float(getattr(cfg, "rope_theta", None) or rope.get("rope_theta", 10000.0))
    plan = _plan(cfg, fmt, head)
    heads = cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"floorline random {cfg.model_type} {fmt}")
    w.add_file_type(file_type_value(fmt))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_vocab_size(cfg.vocab_size)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(getattr(cfg, "num_key_value_heads", None) or heads)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_tokenizer_model("none")
    extra = []
    if rope_type == "llama3":
        extra = [("rope_freqs.weight", (hd // 2,), gguf.GGMLQuantizationType.F32, "rope")]
    plan = extra + plan
    for name, shape, qtype, _ in plan:
        w.add_tensor_info(name, shape, np.dtype(np.float32), tensor_bytes(shape, qtype),
                          raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for index, (_name, shape, qtype, kind) in enumerate(plan):
        rng = np.random.default_rng([seed, index])
        chunks = iter([llama3_rope_factors(rope, hd, theta)]) if kind == "rope" else \
            _chunks(shape, qtype, kind, rng)
        w.write_tensor_data(_Streamed(tensor_bytes(shape, qtype), chunks))
    w.close()


FORMATS = ("bf16", "q4_0", "q4_1", "q8_0")  # the files this module writes


def file_type_value(fmt: str) -> int:
    """general.file_type of a file of `fmt` (llama.cpp's LlamaFileType MOSTLY_*)."""
    import gguf

    return int(getattr(gguf.LlamaFileType, f"MOSTLY_{fmt.upper()}"))


def file_type(path: Path) -> str | None:
    """One of FORMATS for a GGUF of that general.file_type, else None."""
    from floorline.models.gguf_checkpoint import open_gguf

    field = open_gguf(path).fields.get("general.file_type")
    if field is None:
        return None
    value = int(field.parts[field.data[0]][0])
    return next((f for f in FORMATS if file_type_value(f) == value), None)


def llama3_rope_factors(rope: dict, head_dim: int, theta: float):
    """Llama-3's frequency scaling as a per-frequency divisor (convert_hf_to_gguf's rope_freqs)."""
    import numpy as np

    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor, old = rope["factor"], rope["original_max_position_embeddings"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    wavelength = 2 * math.pi / freqs
    smooth = (old / wavelength - low) / (high - low)
    out = np.where(wavelength < old / high, 1.0,
                   np.where(wavelength > old / low, factor, 1 / ((1 - smooth) / factor + smooth)))
    return out.astype(np.float32)
