"""Malformed input of every kind, fed through the command line as a user would: one line on
stderr naming the file or option, exit code 2, never a traceback or an internal error."""

import json
import shutil
import sqlite3
import time

import pytest
import torch

from conftest import run_here, shipped_config
from floorline.cli import render
from floorline.errors import FloorlineError
from floorline.records import INVALID, VALID, CellKey, CellResult
from floorline.store import Store


def run(*args):
    """`floorline ARGS` in this process: (exit code, stdout, stderr)."""
    proc = run_here(*args)
    return proc.returncode, proc.stdout, proc.stderr


def refused(*args, naming: str, also: str = "") -> str:
    """Runs the command and checks it ended in one line naming `naming`, exit code 2."""
    code, _, err = run(*args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("floorline: error: "), err
    assert "Traceback" not in err and "internal error" not in err
    assert naming in lines[0] and also in lines[0], err
    return lines[0]


def config_dir(tmp_path, name="model", base="tiny-llama", raw: bytes | None = None, **change):
    directory = tmp_path / name
    directory.mkdir(parents=True)
    data = json.dumps({**shipped_config(base), **change}).encode()
    (directory / "config.json").write_bytes(data if raw is None else raw)
    return directory


# --- text from a user's files is printed as text, never as markup ----------------------------

MARKUP = "[/bold]x[red]"  # a closing tag with nothing open: rich's MarkupError if interpreted


def test_markup_in_a_model_folder_is_printed_as_text(tmp_path):
    model = config_dir(tmp_path, f"tiny{MARKUP}")
    db = tmp_path / "r.db"
    code, out, err = run("sweep", "--models", model, "--ctx", "8", "--paths", "hf-eager",
                         "--steps", "1", "--warmup", "0", "--device", "cpu", "--gpu", "l4",
                         "--db", db)
    assert code == 0, err
    assert f"tiny{MARKUP}" in out and "invalid" not in err
    code, out, err = run("show", "--db", db)
    assert code == 0 and f"tiny{MARKUP}" in out, err
    code, out, _ = run("floor", "--model", model, "--gpu", "l4", "--ctx", "8")
    assert code == 0 and f"tiny{MARKUP}" in out


def test_show_prints_markup_from_the_database_as_text(tmp_path):
    db = tmp_path / "r.db"
    store = Store(db)
    result = CellResult(CellKey(f"/models/{MARKUP}", 8, "hf-eager", 3, 1), f"gpu{MARKUP}", INVALID,
                        f"error: ValueError: bad [bold]value[/] {MARKUP}", floor={
                            "floor_ms": 1.0, "total_bytes": 10, "weight_bytes": 5, "kv_bytes": 5})
    store.add(result, {}, "env")
    store.close()
    code, out, err = run("show", "--db", db)
    assert code == 0, err
    assert MARKUP in out and f"gpu{MARKUP}" in out and "bad [bold]value[/]" in out


def test_long_local_model_paths_stay_readable(tmp_path):
    assert render.model_label("qwen2.5-7b") == "qwen2.5-7b"
    long = "/data/" + "a-rather-long-folder-name/" * 3 + "my-model"
    assert render.model_label(long) == "…/a-rather-long-folder-name/my-model"
    assert render.model_label("/data/m") == "/data/m"


# --- impossible numbers ------------------------------------------------------------------------

@pytest.mark.parametrize("change, field", [
    ({"sliding_window": -5}, "sliding_window"), ({"sliding_window": 0}, "sliding_window"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"intermediate_size": 0}, "intermediate_size"),
])
def test_floor_and_sweep_refuse_impossible_sizes_alike(tmp_path, change, field):
    model = config_dir(tmp_path, **change)
    line = refused("floor", "--model", model, "--gpu", "l4", "--ctx", "64",
                   naming=str(model / "config.json"), also=field)
    assert refused("sweep", "--models", model, "--ctx", "64", "--device", "cpu", "--gpu", "l4",
                   "--db", tmp_path / "r.db", naming=field) == line
    assert not (tmp_path / "r.db").exists()


def test_a_cell_whose_bytes_are_not_positive_is_never_valid(tmp_path, monkeypatch):
    from dataclasses import replace

    from floorline.hardware import lookup
    from floorline.measure import cell as cell_module

    real_floor = cell_module.floor
    monkeypatch.setattr(cell_module, "floor",
                        lambda *a, **k: replace(real_floor(*a, **k), kv_bytes=0))
    result = cell_module.measure_cell(CellKey("tiny-llama", 8, "hf-eager", 1, 0), "cpu",
                                      lookup("l4"))
    assert result.status == INVALID and "bytes are not positive" in result.reason
    assert result.samples_ms == []  # refused before anything ran
    result.status = VALID
    with pytest.raises(ValueError, match="never valid"):
        Store(tmp_path / "r.db").add(result, {}, "env")


# --- config values -----------------------------------------------------------------------------

@pytest.mark.parametrize("change, raw, fragment", [
    ({"hidden_size": "128"}, None, "hidden_size"),
    ({"vocab_size": 1024.0}, None, "vocab_size"),
    ({"num_attention_heads": True}, None, "num_attention_heads"),
    ({"max_position_embeddings": -1}, None, "max_position_embeddings"),
    ({"num_key_value_heads": 3}, None, "num_key_value_heads"),
    ({}, b'{"model_type": "llama", "name": "\xff\xfe"}', "not UTF-8"),
    ({"text_config": [1, 2]}, None, "text_config must be an object"),
    ({"torch_dtype": "float99"}, None, "torch_dtype 'float99' is not a torch dtype"),
    ({"dtype": 16}, None, "dtype 16 is not a torch dtype"),
])
def test_bad_config_values_are_one_line_naming_the_file(tmp_path, change, raw, fragment):
    model = config_dir(tmp_path, raw=raw, **change)
    line = refused("floor", "--model", model, "--gpu", "l4", "--ctx", "64",
                   naming=str(model / "config.json"), also=fragment)
    assert refused("sweep", "--models", model, "--device", "cpu", "--gpu", "l4",
                   "--db", tmp_path / "r.db", naming=fragment) == line


def test_auto_map_whose_module_is_missing(tmp_path):
    model = config_dir(tmp_path, auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    refused("floor", "--model", model, "--gpu", "l4", "--trust-remote-code",
            naming=str(model / "config.json"), also="has no modeling_x.py")


def test_an_absurd_size_is_refused_at_once(tmp_path):
    model = config_dir(tmp_path, num_hidden_layers=4096, hidden_size=65536,
                       num_attention_heads=512, num_key_value_heads=8,
                       intermediate_size=1 << 20, vocab_size=1 << 24)
    start = time.perf_counter()
    refused("floor", "--model", model, "--gpu", "l4", "--ctx", "64",
            naming=str(model / "config.json"), also="parameters")
    assert time.perf_counter() - start < 5


def test_floor_notes_a_context_above_the_models_positions():
    code, out, err = run("floor", "--model", "tiny-llama", "--gpu", "l4", "--ctx", "4096,64",
                         "--json")
    assert code == 0
    assert [f["ctx"] for f in json.loads(out)] == [4096, 64]  # the number is still given
    notes = err.splitlines()
    assert len(notes) == 1 and "ctx 4096 is above the model's 2048 positions" in notes[0]


# --- arguments -----------------------------------------------------------------------------------

@pytest.mark.parametrize("args, naming", [
    (["floor", "--model", "tiny-llama", "--gpu", ""], "unknown GPU ''"),
    (["floor", "--model", "tiny-llama", "--gpu", "l4", "--ctx", ""], "--ctx"),
    (["floor", "--model", "tiny-llama", "--gpu", "l4", "--ctx", "64,,128"], "--ctx"),
    (["sweep", "--models", ""], "--models"),
    (["sweep", "--models", "tiny-llama", "--paths", " , "], "--paths"),
    (["sweep", "--models", "tiny-llama", "--device", ""], "--device"),
    (["paths", "--device", "cuda:x"], "--device"),
    (["floor", "--model", "tiny-llama", "--gpu", "l4", "--ctx", str(2**63)], "context"),
    (["sweep", "--steps", str(2**63)], "--steps"),
    (["sweep", "--warmup", "-1"], "--warmup"),
    (["ab", "--a", "hf-eager", "--b", "hf-static", "--seed", str(2**64)], "--seed"),
    (["generate", "--model", "x", "--prompt", "p", "--max-new-tokens", str(2**63)],
     "--max-new-tokens"),
    (["floor", "--model", " ", "--gpu", "l4"], "the model is empty"),
    (["generate", "--model", "x", "--prompt", "p", "--temperature", "inf"], "temperature"),
    (["generate", "--model", "x", "--prompt", "p", "--temperature", "nan"], "--temperature"),
    (["sweep", "--no-such-option"], "--no-such-option"),
    (["floor", "--gpu", "l4"], "--model"),
])
def test_bad_arguments_are_one_line_naming_the_option(args, naming):
    refused(*args, naming=naming)


def test_gpu_names_as_floorline_gpus_prints_them():
    from floorline.hardware import CATALOGUE

    for spec in CATALOGUE:
        for name in (spec.name, spec.name.upper(), spec.full_name, spec.full_name.lower()):
            code, out, _ = run("floor", "--model", "tiny-llama", "--gpu", name, "--ctx", "64",
                               "--json")
            assert code == 0 and json.loads(out)[0]["gpu"] == spec.name
    refused("floor", "--model", "tiny-llama", "--gpu", "h20", naming="unknown GPU 'h20'",
            also="did you mean 'h200'?")


def test_a_probe_buffer_larger_than_memory(tmp_path):
    refused("probe", "--device", "cpu", "--buffer-mib", 2**40, "--db", tmp_path / "r.db",
            naming="--buffer-mib")
    assert not (tmp_path / "r.db").exists()


def test_explain_and_ab_refuse_a_context_the_sweep_calls_invalid(tmp_path):
    # ctx itself above the positions (a ctx that fits is run with its prompt shortened)
    line = refused("explain", "--model", "tiny-llama", "--ctx", "2100", "--path", "hf-eager",
                   "--device", "cpu", "--gpu", "l4", "--db", tmp_path / "r.db",
                   naming="context above the model's limit")
    assert "2048 positions" in line and not (tmp_path / "r.db").exists()
    line = refused("ab", "--a", "hf-static", "--b", "hf-static", "--model", "tiny-llama",
                   "--ctx", "2100", "--device", "cpu", "--gpu", "l4", "--db", tmp_path / "r.db",
                   naming="context above the model's limit")
    assert "2048 positions" in line and not (tmp_path / "r.db").exists()


def test_cluster_options_refused_before_any_database(tmp_path):
    db = ("--db", tmp_path / "r.db")
    refused("sweep", *db, "--models", "tiny-llama", "--cluster", "localhost:8786",
            naming="--cluster must be 'local-cuda' or a Dask scheduler's address (tcp://HOST:PORT)",
            also="got 'localhost:8786'")
    refused("sweep", *db, "--models", "tiny-llama", "--cluster", "tcp://127.0.0.1:1",
            "--device", "cuda:1", naming="with --cluster, --device is 'cuda' (each worker's own "
                                         "GPU) or 'cpu', got 'cuda:1'")
    refused("sweep", *db, "--models", "tiny-llama", "--cluster", "local-cuda", "--device", "cpu",
            naming="--cluster local-cuda runs a worker per GPU: --device cpu does not apply")
    if not torch.cuda.is_available():
        pytest.importorskip("distributed")
        refused("sweep", *db, "--models", "tiny-llama", "--cluster", "local-cuda",
                naming="--cluster local-cuda: torch sees no CUDA device here")
    assert not (tmp_path / "r.db").exists()


@pytest.mark.parametrize("command", ["models", "gpus", "floor", "formats", "paths", "sweep",
                                     "show", "merge", "ab", "probe", "explain", "report",
                                     "predict", "generate", "quality", "models fetch"])
def test_help_fits_80_columns_with_every_option_whole(monkeypatch, command):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run(*command.split(), "--help")
    assert code == 0
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "…" not in out
    for option in ("--trust-remote-code", "--force", "--max-new-tokens"):
        assert f"--no-{option[2:]}" not in out


# --- databases -----------------------------------------------------------------------------------

def valid_cell(ctx):
    return CellResult(CellKey("m", ctx, "hf-eager", 3, 1), "l4", VALID, None, [1.0, 2.0, 3.0],
                      {"median_ms": 2.0, "p10_ms": 1.0, "p90_ms": 3.0, "mean_ms": 2.0, "n": 3},
                      {"floor_ms": 1.0, "total_bytes": 300, "weight_bytes": 200, "kv_bytes": 100})


def test_invalid_json_in_a_row_is_one_line_and_the_rest_is_shown(tmp_path):
    db = tmp_path / "r.db"
    store = Store(db)
    for ctx in (8, 16, 32):
        store.add(valid_cell(ctx), {}, "env")
    store.db.execute("UPDATE cells SET samples_ms = '[1.0, 2' WHERE ctx = 16")
    store.close()
    code, out, err = run("show", "--db", db, "--json")
    assert code == 2 and [r["ctx"] for r in json.loads(out)] == [8, 32]
    assert err.count("\n") == 1 and "cells row 2: samples_ms is not a JSON list" in err
    assert str(db) in err and "Traceback" not in err
    with pytest.raises(FloorlineError, match="cells row 2"):
        Store(db, read_only=True).rows()  # readers that need every row stop at it
    refused("merge", tmp_path / "out.db", db, naming="cells row 2")
    refused("report", "--db", db, "--out", tmp_path / "report", naming="cells row 2")
    con = sqlite3.connect(db)
    con.execute("UPDATE cells SET median_ms = 'fast' WHERE ctx = 32").connection.commit()
    code, out, err = run("show", "--db", db, "--json")
    assert code == 2 and [r["ctx"] for r in json.loads(out)] == [8]
    assert "2 damaged row(s)" in err and "cells row 3: median_ms is not a number" in err


def test_a_corrupt_page_is_one_line(tmp_path):
    db = tmp_path / "r.db"
    store = Store(db)
    for ctx in range(1, 400):
        store.add(valid_cell(ctx), {}, "env")
    store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()
    reader = sqlite3.connect(db)
    page = reader.execute("PRAGMA page_size").fetchone()[0]
    root = reader.execute("SELECT rootpage FROM sqlite_master WHERE name = 'cells'").fetchone()[0]
    reader.close()
    data = bytearray(db.read_bytes())
    assert len(data) > 8 * page and root > 1
    data[(root - 1) * page: root * page] = b"\xa5" * page  # the cells table's root, overwritten
    db.write_bytes(bytes(data))
    refused("show", "--db", db, naming=str(db), also="malformed")
    refused("merge", tmp_path / "out.db", db, naming=str(db), also="malformed")


# --- generate ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A 1-layer untied Llama with its word tokenizer (as tests/test_generate.py writes one)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from test_generate import EOS, WORDS, word_tokenizer

    directory = tmp_path_factory.mktemp("checkpoint")
    config = LlamaConfig(vocab_size=len(WORDS), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, bos_token_id=None, eos_token_id=EOS,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).float().save_pretrained(directory, safe_serialization=True)
    word_tokenizer().save_pretrained(directory)
    return directory


def edit_tensors(directory, change):
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def edit_json(path, **change):
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))


def drop_head(tensors):
    del tensors["lm_head.weight"]


def transpose_up(tensors):
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].T.contiguous()


def halve_q(tensors):
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name][:32].contiguous()


def break_template(directory):
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        path = directory / name
        if name.endswith(".jinja") and path.exists():
            path.write_text("{% for m in messages %}{{ m['content'] }")
    config = directory / "tokenizer_config.json"
    if "chat_template" in json.loads(config.read_text()):
        edit_json(config, chat_template="{% for m in messages %}{{ m['content'] }")


@pytest.mark.parametrize("case, fragment", [
    ("truncated", "model.safetensors is not a readable safetensors file"),
    ("random", "model.safetensors is not a readable safetensors file"),
    ("transposed", "'model.layers.0.mlp.up_proj.weight' has shape [64, 128], where the config "
                   "makes it [128, 64]"),
    ("wrong-shape", "'model.layers.0.self_attn.q_proj.weight' has shape [32, 64]"),
    ("config-disagrees", "'model.layers.0.mlp.gate_proj.weight' has shape [128, 64], where the "
                         "config makes it [256, 64]"),
    ("no-head", "no tensor 'lm_head.weight'"),
    ("vocab", "the tokenizer's ids run to 63, past the model's vocab_size of 32"),
    # as many tokens as the model's vocabulary, but one id far past it
    ("vocab-gap", "the tokenizer's ids run to 5000, past the model's vocab_size of 64"),
    ("template", "its chat template cannot be applied"),
    ("generation-config-list", "generation_config.json must hold a JSON object"),
    ("generation-config-eos", "generation_config.json: eos_token_id must be a token id"),
    ("generation-config-bytes", "generation_config.json is not UTF-8 text"),
])
def test_generate_refuses_damaged_checkpoints(tmp_path, checkpoint, case, fragment):
    directory = tmp_path / "ck"
    shutil.copytree(checkpoint, directory)
    weights = directory / "model.safetensors"
    if case == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif case == "random":
        weights.write_bytes(torch.randint(256, (4096,), dtype=torch.uint8,
                                          generator=torch.Generator().manual_seed(0)).numpy()
                            .tobytes())
    elif case == "transposed":
        edit_tensors(directory, transpose_up)
    elif case == "wrong-shape":
        edit_tensors(directory, halve_q)
    elif case == "config-disagrees":
        edit_json(directory / "config.json", intermediate_size=256)
    elif case == "no-head":
        edit_tensors(directory, drop_head)
    elif case == "vocab":
        edit_json(directory / "config.json", vocab_size=32)
    elif case == "vocab-gap":
        data = json.loads((directory / "tokenizer.json").read_text())
        vocab = data["model"]["vocab"]
        vocab[max(vocab, key=vocab.get)] = 5000
        (directory / "tokenizer.json").write_text(json.dumps(data))
    elif case == "template":
        break_template(directory)
    elif case == "generation-config-list":
        (directory / "generation_config.json").write_text("[1, 2]")
    elif case == "generation-config-eos":
        edit_json(directory / "generation_config.json", eos_token_id="</s>")
    elif case == "generation-config-bytes":
        (directory / "generation_config.json").write_bytes(b'{"eos_token_id": 1\xff}')
    refused("generate", "--model", directory, "--prompt", "w1 w2", "--max-new-tokens", 2,
            "--device", "cpu", "--dtype", "float32", naming=str(directory), also=fragment)


def test_a_tokenizer_error_is_printed_whole(tmp_path, checkpoint):
    from transformers import AutoTokenizer

    from floorline.errors import one_line

    for name in ("config.json", "model.safetensors"):
        shutil.copy(checkpoint / name, tmp_path)
    with pytest.raises(Exception) as raised:
        AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    refused("generate", "--model", tmp_path, "--prompt", "w1", "--device", "cpu",
            naming=str(tmp_path), also=one_line(raised.value))
