"""A GGUF's blocks run as stored (`engine-gguf`): each block type decoded exactly as gguf-py
decodes it, the engine's logits those of the same weights decoded to float32, the floor the
bytes of the blocks the engine holds, and a file it cannot run refused in one line."""

import json

import numpy as np
import pytest
import torch

from conftest import run_here
from floorline.errors import FloorlineError
from floorline.hardware import lookup
from floorline.models import resolve_model
from floorline.traffic import floor

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType

# hidden 128: not a multiple of 256, so that llama-quantize's head is Q8_0 (the engine runs it)
CONFIG = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "vocab_size": 512, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
          "tie_word_embeddings": False}
FORMATS = ("q4_0", "q4_1", "q8_0")
ENGINE_FORMAT = {"q4_0": "int4", "q4_1": "q4_1", "q8_0": "q8_0"}


def model_dir(tmp_path, fmt, **config):
    from floorline.layouts.gguf import write_random_gguf

    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, **config}))
    write_random_gguf(resolve_model(str(tmp_path)).config, tmp_path / f"m-{fmt}.gguf", fmt,
                      seed=3)
    return tmp_path


def blocks(type_name: str, rows: int, row_blocks: int) -> np.ndarray:
    from floorline.layouts import gguf as writer

    draw = getattr(writer, f"{type_name.lower()}_blocks")
    return draw(np.random.default_rng(7), rows * row_blocks).reshape(rows, -1)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_blocks_decode_exactly_as_gguf_py_decodes_them(type_name):
    from floorline.engine.gguf_blocks import block_weight
    from floorline.engine.quant import dense
    from floorline.models.gguf_checkpoint import unpermute_rotary

    raw = blocks(type_name, 16, 3)  # 16 rows of 96 weights
    truth = gguf.quants.dequantize(raw, T[type_name]).reshape(16, 96)
    assert torch.equal(dense(block_weight(raw, type_name, "w")), torch.from_numpy(truth))
    # a q or k projection's rows, permuted back from llama.cpp's rotary order
    permuted = dense(block_weight(raw, type_name, "w", heads=2))
    assert torch.equal(permuted, torch.from_numpy(unpermute_rotary(truth, 2)))


def test_a_block_type_the_engine_does_not_run_is_named():
    from floorline.engine.gguf_blocks import block_weight

    with pytest.raises(FloorlineError, match=r"tensor 'blk.0.ffn_up.weight' is of type Q6_K; "
                                             r"the engine runs GGUF blocks of Q4_0, Q4_1, Q8_0"):
        block_weight(blocks("Q6_K", 2, 1), "Q6_K", "blk.0.ffn_up.weight")


def dequantised(path, config):
    """The file's weights decoded to float32 by gguf-py, by Hugging Face's names."""
    from floorline.models.gguf_checkpoint import hf_name, unpermute_rotary

    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        name = hf_name(t.name)
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        kind = name.split(".")[-2]
        out[name] = torch.from_numpy(np.array(unpermute_rotary(w, heads[kind]) if kind in heads
                                              else w))
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_engine_runs_the_file_as_the_float32_model_of_its_values(tmp_path, fmt):
    from floorline.engine import Engine
    from floorline.engine.model import DecoderConfig
    from floorline.engine.weights import from_named

    directory = model_dir(tmp_path, fmt)
    spec = resolve_model(str(directory))
    stored = Engine(spec, "cpu", 16, weights="gguf", dtype=torch.float32, backend="reference")
    assert (stored.weights, stored.head) == (ENGINE_FORMAT[fmt], "q8_0")
    assert stored.group_size == (32 if fmt == "q4_0" else None)
    values = dequantised(directory / f"m-{fmt}.gguf", CONFIG)
    decoded = from_named(DecoderConfig.from_hf(spec.config), values.__getitem__, "cpu",
                         torch.float32)
    plain = Engine(spec, "cpu", 16, dtype=torch.float32, backend="reference",
                   decoder_weights=decoded)
    ids = torch.tensor([5, 77, 300, 9])
    assert torch.equal(stored.prefill(ids), plain.prefill(ids))
    for _ in range(3):
        stored.step()
        plain.step()
        assert torch.equal(stored.logits, plain.logits)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_kernels_step_the_file_as_the_reference_does(tmp_path, fmt):
    # Triton's kernels (the interpreter, on the CPU) against the PyTorch reference on the same
    # stored weights, in bf16, in the step (the prefill is PyTorch's in both)
    from conftest import KERNEL_DEVICE
    from floorline.engine import Engine
    from floorline.engine.check import relative_error

    spec = resolve_model(str(model_dir(tmp_path, fmt)))
    kernels = Engine(spec, KERNEL_DEVICE, 16, weights="gguf", backend="triton")
    reference = Engine(spec, KERNEL_DEVICE, 16, weights="gguf", backend="reference")
    ids = torch.tensor([5, 77, 300, 9])
    kernels.prefill(ids)
    reference.prefill(ids)
    for _ in range(2):
        kernels.step()
        reference.step()
        assert relative_error(kernels.logits, reference.logits) < 2e-2
        top2 = reference.logits.float().topk(2).values
        if top2[0] - top2[1] > 0.05:  # not a near-tie, which bf16 sums may break either way
            assert kernels.token.item() == reference.token.item()
        kernels.seek(kernels.filled, reference.token.view(1))  # the same token next


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_floor_counts_the_blocks_the_engine_holds(tmp_path, fmt):
    # the file's layer matrices and head as stored (Q4_0 with the int4 layout's zero point, one
    # byte per block, beside them), norms and one embedding row in bf16
    directory = model_dir(tmp_path, fmt)
    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(
        str(directory / f"m-{fmt}.gguf")).tensors}
    matrices = sum(n for name, n in sizes.items() if name.startswith("blk.")
                   and "norm" not in name)
    if fmt == "q4_0":
        matrices = matrices * 19 // 18
    h, layers = CONFIG["hidden_size"], CONFIG["num_hidden_layers"]
    expected = matrices + sizes["output.weight"] + 2 * (h * (2 * layers + 1) + h)
    f = floor(resolve_model(str(directory)), lookup("h200"), 16, weight_format="engine-gguf")
    assert f.weight_format == f"engine-{'int4-g32' if fmt == 'q4_0' else fmt}-q8_0head"
    assert f.weight_bytes == expected


def test_a_file_with_a_k_quant_head_is_refused_in_one_line(tmp_path):
    from floorline.engine import Engine

    directory = model_dir(tmp_path, "q4_0", hidden_size=256)  # the head is Q6_K
    spec = resolve_model(str(directory))
    with pytest.raises(FloorlineError, match="tensor 'output.weight' is of type Q6_K"):
        Engine(spec, "cpu", 16, weights="gguf")
    with pytest.raises(FloorlineError, match="tensors of type Q6_K, which the engine does not "
                                             "run as stored"):
        floor(spec, lookup("h200"), 16, weight_format="engine-gguf")


def test_a_row_of_partial_blocks_names_its_tensor(tmp_path):
    from floorline.models.gguf_checkpoint import open_gguf

    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor_info("blk.0.ffn_up.weight", (2, 48), np.dtype(np.float32), 2 * 51,
                      raw_dtype=T.Q8_0)  # 48 weights a row: a block and a half
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.write_tensor_data(np.zeros(2 * 51, np.uint8))
    w.close()
    with pytest.raises(FloorlineError, match=r"tensor 'blk.0.ffn_up.weight' is Q8_0 with rows "
                                             r"of 48 weights, not a multiple of its blocks of 32"):
        open_gguf(path)


def test_the_files_reader_reads_what_gguf_pys_own_reads(tmp_path):
    from floorline.models.gguf_checkpoint import open_gguf

    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_token_list([f"token {i}" for i in range(3000)])  # the arrays a tokenizer brings
    w.add_token_scores([i / 7 for i in range(3000)])
    w.add_block_count(2)
    w.add_tensor("blk.0.ffn_up.weight", np.arange(96, dtype=np.float32).reshape(3, 32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, theirs = open_gguf(path), gguf.GGUFReader(str(path))
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.types, mine.data, mine.offset) == (field.types, field.data, field.offset)
        assert [p.tobytes() for p in mine.parts] == [p.tobytes() for p in field.parts]
    [t], [u] = ours.tensors, theirs.tensors
    assert (t.name, t.tensor_type, list(t.shape), t.data_offset) == \
        (u.name, u.tensor_type, list(u.shape), u.data_offset)
    assert np.array_equal(t.data, u.data)


def test_a_cut_short_file_is_one_line(tmp_path):
    from floorline.models.gguf_checkpoint import open_gguf

    directory = model_dir(tmp_path, "q4_1")
    path = directory / "m-q4_1.gguf"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(FloorlineError, match="is not a readable GGUF file"):
        open_gguf(path)


def test_a_sweep_measures_the_file_and_refuses_random_weights(tmp_path, monkeypatch):
    (tmp_path / "m").mkdir()
    directory = model_dir(tmp_path / "m", "q4_1")
    db = tmp_path / "r.db"
    monkeypatch.setenv("FLOORLINE_CACHE", str(tmp_path / "cache"))
    done = run_here("sweep", "--db", db, "--device", "cpu", "--models", f"{directory},tiny-llama",
                    "--ctx", "16", "--paths", "engine-gguf", "--steps", "4", "--warmup", "2",
                    "--no-quality")
    assert "Traceback" not in done.stderr, done.stderr
    cells = {c["model"]: c for c in json.loads(run_here("show", "--db", db, "--json",
                                                        check=True).stdout)}
    mine = cells[str(directory)]
    assert mine["status"] == "valid", mine
    assert mine["weight_format"] == "engine-q4_1-q8_0head"
    assert mine["details"]["real_weights"] is True
    random = cells["tiny-llama"]
    assert random["status"] == "invalid"
    assert "'tiny-llama' has random weights: no GGUF file to run as stored" in random["reason"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_step_reads_the_blocks_as_stored_as_the_reference_does(tmp_path, fmt, dtype,
                                                                       monkeypatch):
    """floorline's CPU kernel on the file's blocks as stored (the step never multiplies the fp32
    copy that the prefill keeps): the reference's logits within the order of fp32 sums, and its
    tokens."""
    from floorline.engine import Engine, cpu_kernel, runtime
    from floorline.engine.cpu_products import KERNEL, ProductPlan
    from floorline.engine.ops import ReferenceOps

    if isinstance(cpu_kernel.kernel(), str):
        pytest.skip(f"no CPU kernel here: {cpu_kernel.kernel()}")
    spec = resolve_model(str(model_dir(tmp_path, fmt)))
    ids = torch.tensor([5, 77, 300, 9])
    reference = Engine(spec, "cpu", 16, weights="gguf", dtype=dtype, backend="reference")
    reference.prefill(ids)
    expected = []
    for _ in range(4):
        reference.step()
        expected.append((reference.logits.float().clone(), reference.token.item()))
    monkeypatch.setattr(runtime, "plan_products", lambda weights: ProductPlan(blocks=KERNEL))
    ours = Engine(spec, "cpu", 16, weights="gguf", dtype=dtype, backend="cpu")
    ours.prefill(ids)

    def from_floats(*args, **kwargs):
        raise AssertionError("a step's product went through the matrix's fp32 form")
    monkeypatch.setattr(ReferenceOps, "gemv", from_floats)
    for logits, token in expected:
        ours.step()
        error = ((ours.logits.float() - logits).norm() / logits.norm()).item()
        assert error < (1e-5 if dtype == torch.float32 else 1e-2), error
        assert ours.token.item() == token
