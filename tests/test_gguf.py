"""GGUF files of random weights: what llama.cpp's tools would write, block by block, and the
bytes the floor counts for them; llama.cpp decoding them where llama-cpp-python is installed."""

import importlib.util
import json

import numpy as np
import pytest

from conftest import run_cli
from floorline.hardware import lookup
from floorline.models import resolve_model
from floorline.traffic import floor

gguf = pytest.importorskip("gguf")
needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="llama-cpp-python not installed")

# hidden 256, so that the LM head is Q6_K as in the 7B models' Q4_0 files
CONFIG = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "vocab_size": 512, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
          "tie_word_embeddings": False}


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return tmp_path


def write(model_dir, fmt):
    from floorline.layouts.gguf import write_random_gguf

    path = model_dir / f"m-{fmt}.gguf"
    write_random_gguf(resolve_model(str(model_dir)).config, path, fmt, seed=1)
    return gguf.GGUFReader(str(path))


@pytest.mark.parametrize("fmt", ["bf16", "q4_0"])
def test_tensor_types_are_llama_cpps(model_dir, fmt):
    T = gguf.GGMLQuantizationType
    reader = write(model_dir, fmt)
    types = {t.name: T(t.tensor_type) for t in reader.tensors}
    matrix = T.BF16 if fmt == "bf16" else T.Q4_0
    assert types["blk.1.ffn_down.weight"] == types["token_embd.weight"] == matrix
    assert types["output.weight"] == (T.BF16 if fmt == "bf16" else T.Q6_K)
    assert types["blk.0.attn_norm.weight"] == types["output_norm.weight"] == T.F32
    assert len(reader.tensors) == 3 + 2 * 9  # embd, out norm, head; per layer 2 norms + 7 linears
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    assert arch == "llama"


@pytest.mark.parametrize("fmt", ["bf16", "q4_0"])
def test_weights_are_random_and_trained_sized(model_dir, fmt):
    reader = write(model_dir, fmt)
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
        if "norm" in t.name:
            assert abs(w.mean() - 1) < 0.01
        else:
            assert abs(w.mean()) < 2e-3 and 0.015 < w.std() < 0.025, t.name
            assert len(np.unique(w)) > 10


@pytest.mark.parametrize("fmt", ["bf16", "q4_0"])
def test_floor_counts_the_files_bytes(model_dir, fmt):
    # The floor's weights = every tensor of the file but the embedding table, of which one row.
    reader = write(model_dir, fmt)
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    row = sizes["token_embd.weight"] // CONFIG["vocab_size"]
    expected = sum(sizes.values()) - sizes["token_embd.weight"] + row
    f = floor(resolve_model(str(model_dir)), lookup("h200"), 16, weight_format=f"gguf-{fmt}")
    assert f.weight_bytes == expected


def test_q4_0_blocks_decode_as_ggml_defines_them():
    from floorline.layouts.gguf import q4_0_blocks

    blocks = q4_0_blocks(np.random.default_rng(0), 3)
    values = gguf.quants.dequantize(blocks.reshape(-1), gguf.GGMLQuantizationType.Q4_0)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    q = np.concatenate([blocks[:, 2:] & 0xF, blocks[:, 2:] >> 4], axis=1).astype(np.float32)
    assert np.array_equal(values.reshape(3, 32), d * (q - 8))


@needs_llama_cpp
def test_llama_cpp_decodes_both_formats_and_reports_the_reduction(model_dir, tmp_path):
    db = tmp_path / "r.db"
    run_cli("sweep", "--db", db, "--models", model_dir, "--ctx", "32", "--paths",
            "llamacpp-bf16,llamacpp-q4_0", "--steps", "4", "--warmup", "2", "--gpu", "l4",
            check=True, env={"FLOORLINE_CACHE": str(tmp_path / "cache")})
    shown = json.loads(run_cli("show", "--db", db, "--json", check=True).stdout)
    cells = {c["path"]: c for c in shown}
    assert cells["llamacpp-bf16"]["status"] == cells["llamacpp-q4_0"]["status"] == "valid"
    assert cells["llamacpp-bf16"]["details"]["real_weights"] is False  # a config alone: random
    r = cells["llamacpp-q4_0"]["reduction"]
    assert r["reference_id"] == cells["llamacpp-bf16"]["id"]
    assert r["expected"] == pytest.approx(cells["llamacpp-bf16"]["total_bytes"]
                                          / cells["llamacpp-q4_0"]["total_bytes"])
    assert r["realised"] == pytest.approx(cells["llamacpp-bf16"]["median_ms"]
                                          / cells["llamacpp-q4_0"]["median_ms"])


@needs_llama_cpp
def test_llama_cpp_steps_are_not_ours_to_capture(model_dir, monkeypatch, tmp_path):
    from floorline.paths import PathUnavailable, open_session, parse_path

    monkeypatch.setenv("FLOORLINE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(PathUnavailable, match="llama.cpp replays its own CUDA graphs"):
        open_session(parse_path("llamacpp-q4_0+compile"), resolve_model(str(model_dir)), "cpu",
                     64, 0)


@pytest.mark.parametrize("fmt", ["bf16", "q4_0"])
def test_a_directorys_gguf_must_be_the_paths_format(model_dir, fmt):
    from floorline.errors import FloorlineError
    from floorline.layouts.gguf import file_type
    from floorline.paths.llamacpp import gguf_file

    write(model_dir, fmt)
    assert file_type(model_dir / f"m-{fmt}.gguf") == fmt
    spec = resolve_model(str(model_dir))
    assert gguf_file(spec, fmt, seed=0) == model_dir / f"m-{fmt}.gguf"
    other = "q4_0" if fmt == "bf16" else "bf16"
    with pytest.raises(FloorlineError, match=f"not a {other} GGUF: run it as llamacpp-{fmt}"):
        gguf_file(spec, other, seed=0)


def test_tiny_q4_0_heads_fall_back_to_q8_0_and_the_floor_knows(tmp_path):
    # hidden 96: llama-quantize (and the writer) keep the head in Q8_0, not Q6_K.
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "hidden_size": 96,
                                                      "intermediate_size": 192}))
    reader = write(tmp_path, "q4_0")
    assert gguf.GGMLQuantizationType(
        {t.name: t for t in reader.tensors}["output.weight"].tensor_type).name == "Q8_0"
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    expected = sum(sizes.values()) - sizes["token_embd.weight"] + sizes["token_embd.weight"] // 512
    f = floor(resolve_model(str(tmp_path)), lookup("h200"), 16, weight_format="gguf-q4_0")
    assert f.weight_bytes == expected
