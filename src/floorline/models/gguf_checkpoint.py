"""A Llama-architecture GGUF file -> a Hugging Face checkpoint directory that every path loads:
config.json from the GGUF's `llama.*` metadata, the tensors dequantised to float32 into
model.safetensors, the tokenizer and chat template from its `tokenizer.*` metadata, and
floorline-source.json saying where the weights came from.

The tensors are read and dequantised by gguf-py (the `gguf` package, llama.cpp's own reader).
llama.cpp's converter stores the q and k projections with the rows of each head permuted for its
rotary layout (pairs (2i, 2i + 1) rather than halves (i, i + d/2)); they are permuted back here,
as transformers' own GGUF loader does. The tokenizer is built by transformers from the same
metadata (its GGUF tokenizer converter), so that its byte-level BPE matches the library's.

A quantised GGUF's weights are stored as the float32 values its blocks stand for (exact: a
Q4_0/Q4_1/Q8_0 weight is an fp16 scale times a small integer, plus an fp16 minimum for Q4_1):
the directory is the quantised model, in float32, not the model it was quantised from.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from functools import cache
from pathlib import Path

from floorline.errors import FloorlineError, one_line

SOURCE_FILE = "floorline-source.json"

# GGUF tensor names of one layer -> Hugging Face's
LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter name of a GGUF tensor, None for one the model does not use
    (llama.cpp's precomputed rotary factors)."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.{parts[3]}"
    return None


def gguf_files(model_spec) -> list[Path]:
    """The .gguf files of a model's directory (its checkpoint's, or the directory it was named
    by); none for a config of random weights."""
    directory = model_spec.weights_dir or Path(model_spec.name)
    return sorted(directory.glob("*.gguf")) if directory.is_dir() else []


def model_gguf(model_spec) -> Path:
    """The one .gguf file of a model's directory, or one line saying why there is none to
    run."""
    found = gguf_files(model_spec)
    directory = model_spec.weights_dir or Path(model_spec.name)
    if len(found) > 1:
        raise FloorlineError(f"{directory} holds {len(found)} .gguf files; keep one")
    if found:
        return found[0]
    if not directory.is_dir():
        raise FloorlineError(f"'{model_spec.name}' has random weights: no GGUF file to run as "
                             "stored (give a model directory that holds one)")
    raise FloorlineError(f"{directory} holds no .gguf file to run as stored (a model fetched "
                         "by an earlier floorline keeps none: run `floorline models fetch` "
                         "for it again)")


def stored_types(path: Path) -> tuple[frozenset[str], str]:
    """The GGML type names of a Llama GGUF's layer matrices, and of its LM head (the token
    table where the two are tied); read once a process for each version of the file (its size
    and modification time): a sweep asks for them at each cell of the file."""
    stat = path.stat()
    return _stored_types(str(path), stat.st_size, stat.st_mtime_ns)


@cache
def _stored_types(path: str, size: int, mtime_ns: int) -> tuple[frozenset[str], str]:
    types = {t.name: t.tensor_type.name for t in open_gguf(Path(path)).tensors}
    head = types.get("output.weight", types.get("token_embd.weight", "F32"))
    matrices = {kind for name, kind in types.items()
                if name.startswith("blk.") and name.endswith(".weight")
                and name.split(".")[2] in LAYER_TENSORS and "norm" not in name.split(".")[2]}
    return frozenset(matrices), head


def rotary_heads(name: str, heads: int, kv_heads: int) -> int | None:
    """The heads whose rows llama.cpp's converter permuted in the Hugging Face tensor `name`:
    the q projection's, the k projection's, or None for any other tensor."""
    if name.endswith("q_proj.weight"):
        return heads
    if name.endswith("k_proj.weight"):
        return kv_heads
    return None


def decoded(t, heads: int, kv_heads: int, where: Path):
    """A GGUF tensor's values as gguf-py decodes them: float32 numpy shaped as Hugging Face's
    [out, in], the q and k projections' rows permuted back (`where`: the file, for messages)."""
    import numpy as np
    from gguf.quants import dequantize

    try:
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
    except NotImplementedError:
        raise FloorlineError(f"{where}: tensor '{t.name}' is of type {t.tensor_type.name}, "
                             "which gguf-py cannot dequantise") from None
    w = w.reshape(tuple(int(d) for d in reversed(t.shape)))  # ggml lists dims inner first
    rows = rotary_heads(hf_name(t.name) or "", heads, kv_heads)
    return w if rows is None else unpermute_rotary(w, rows)


def unpermute_rotary(w, heads: int):
    """The inverse of llama.cpp's q/k permutation: rows of each head from interleaved pairs
    back to rotate-half order (numpy [heads * head_dim, hidden])."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, where: Path, required: bool = True):
    field = reader.fields.get(key)
    if field is None:
        if required:
            raise FloorlineError(f"{where}: no '{key}' in its metadata")
        return None
    return field.contents()


def config_from_metadata(reader, where: Path) -> dict:
    """config.json for a `llama` GGUF's metadata (`where`: the file, for messages)."""
    arch = _field(reader, "general.architecture", where)
    if arch != "llama":
        raise FloorlineError(f"{where}: architecture '{arch}' (floorline converts "
                             "Llama-architecture GGUF files)")

    def get(key, required=True):
        return _field(reader, f"llama.{key}", where, required)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = get("vocab_size", False)
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else None
    if vocab is None:
        raise FloorlineError(f"{where}: neither llama.vocab_size nor a token list")
    head_dim = get("attention.key_length", False) or get("rope.dimension_count", False)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", False) or heads),
        "head_dim": int(head_dim or hidden // heads),
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", False) or 10000.0),
        "vocab_size": int(vocab), "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False, "mlp_bias": False, "dtype": "float32",
    }
    for key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("pad_token_id", "padding_token_id")):
        value = _field(reader, f"tokenizer.ggml.{gguf_key}", where, False)
        if value is not None:
            config[key] = int(value)
    return config


@cache
def _reader_class():
    """gguf-py's reader, reading the file's bytes through a plain array view of its memory map.
    The reader slices its numpy memmap once for each value of the header, some 250,000 times for
    a tokenizer of 49,152 tokens and as many merges, and a memmap's slice costs ten times a plain
    array's: the file's header took 3.6 s to read, 1.1 s this way (SmolLM2-135M's Q4_1 file on
    2 cores of an Intel Xeon). The values are the same bytes of the same mapping."""
    import gguf
    import numpy as np

    class Reader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            if type(self.data) is not np.ndarray:
                self.data = self.data.view(np.ndarray)  # the map stays open under the view
            return super()._get(offset, dtype, count, override_order)

    return Reader


def open_gguf(gguf_path: Path):
    """gguf-py's reader of the file, or one line naming what is wrong with it (the tensor, where
    one's rows are not whole blocks of its type)."""
    try:
        return _reader_class()(str(gguf_path))
    except Exception as e:  # ValueError for a bad magic, struct errors for a cut-short file
        odd = _partial_row(gguf_path)
        if odd:
            raise FloorlineError(f"{gguf_path}: {odd}") from None
        raise FloorlineError(f"{gguf_path} is not a readable GGUF file "
                             f"({type(e).__name__}: {one_line(e)})") from None


def _partial_row(gguf_path: Path) -> str | None:
    """Which tensor has a row that is not a whole number of its type's blocks, read from the
    header alone (the reader refuses the file without naming it); None where none has."""
    import gguf

    class Header(_reader_class()):  # stops after the tensors' descriptions
        def _build_tensors(self, start_offs, fields):
            self.descriptions = fields

    try:
        descriptions = Header(str(gguf_path)).descriptions
        for field in descriptions:
            _, name, _, dims, raw_type, _ = field.parts
            kind = gguf.GGMLQuantizationType(int(raw_type[0]))
            block = gguf.GGML_QUANT_SIZES[kind][0]
            if int(dims[0]) % block:
                return (f"tensor '{bytes(name).decode()}' is {kind.name} with rows of "
                        f"{int(dims[0])} weights, not a multiple of its blocks of {block}")
    except Exception:  # a header the reader cannot parse either: the caller's line stands
        return None
    return None


def convert(gguf_path: Path, directory: Path,
            progress: Callable[[int, int], None] | None = None, source: dict | None = None):
    """Write the checkpoint of `gguf_path` into `directory` (made anew: any files there are
    replaced). `progress(done, total)` is called per tensor; `source` is recorded beside."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    reader = open_gguf(gguf_path)
    config = config_from_metadata(reader, gguf_path)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors, types = {}, Counter()
    for done, t in enumerate(reader.tensors, 1):
        name = hf_name(t.name)
        if name is None:
            continue
        w = decoded(t, heads, kv_heads, gguf_path)
        tensors[name] = torch.from_numpy(np.array(w, dtype=np.float32))  # a writable copy
        types[t.tensor_type.name] += 1
        if progress is not None:
            progress(done, len(reader.tensors))
    _check_complete(tensors, config, gguf_path)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _save_tokenizer(gguf_path, directory)
    record = {**(source or {}), "gguf_file": gguf_path.name, "tensor_types": dict(types),
              "weights": "the GGUF's values as its blocks store them (dequantised), in float32",
              "name": _field(reader, "general.name", gguf_path, False)}
    (directory / SOURCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return record


def _check_complete(tensors: dict, config: dict, gguf_path: Path) -> None:
    needed = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config["tie_word_embeddings"]:
        needed.append("lm_head.weight")
    needed += [f"model.layers.{i}.{part}.weight" for i in range(config["num_hidden_layers"])
               for part in LAYER_TENSORS.values()]
    missing = [n for n in needed if n not in tensors]
    if missing:
        raise FloorlineError(f"{gguf_path}: {len(missing)} tensors of a Llama model are missing "
                             f"(the first: '{missing[0]}')")


def _save_tokenizer(gguf_path: Path, directory: Path) -> None:
    """tokenizer.json and tokenizer_config.json (with the chat template), built by transformers
    from the GGUF's metadata."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except Exception as e:  # the converter raises many kinds for metadata it cannot use
        raise FloorlineError(f"{gguf_path}: transformers cannot build a tokenizer from its "
                             f"metadata ({type(e).__name__}: {one_line(e)})") from None
    tokenizer.save_pretrained(directory)
