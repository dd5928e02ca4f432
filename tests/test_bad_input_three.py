"""More malformed input, fed where a user feeds it: a local GEMV tuning table, a user without a
home directory, an incomplete or unreadable checkpoint, a KV cache no memory holds. Each ends in
one line naming the file or entry, never an internal error."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from floorline.errors import FloorlineError
from floorline.models import model_label, resolve_model
from floorline.paths import REGISTRY
from test_bad_input import checkpoint, drop_head, edit_tensors, refused, run  # noqa: F401
from test_generate import EOS, WORDS, word_tokenizer

ENTRY = {"block_n": 4, "block_k": 256, "num_warps": 4, "split_k": 1, "num_stages": 3}


@pytest.mark.parametrize("change, fragment", [
    ({"block_n": "abc"}, "block_n is 'abc', not a power of two from 1 to 1024"),
    ({"block_k": -1}, "block_k is -1, not a power of two from 1 to 65536"),
    ({"block_k": 10**30}, f"block_k is {10**30}, not a power of two from 1 to 65536"),
    ({"block_k": 384}, "block_k is 384, not a power of two from 1 to 65536"),
    ({"num_warps": 4.0}, "num_warps is 4.0, not a power of two from 1 to 32"),
    ({"split_k": True}, "split_k is True, not an integer from 1 to 1024"),
    ({"num_stages": 0}, "num_stages is 0, not an integer from 1 to 16"),
    ({"words": 3}, "words is 3, not a power of two from 1 to 16"),
])
def test_a_tuning_table_entry_out_of_range_is_one_line(tmp_path, monkeypatch, change, fragment):
    from floorline.engine.tuning import GemvTuner

    monkeypatch.setenv("FLOORLINE_CACHE", str(tmp_path))
    table = tmp_path / "engine-gemv.json"
    table.write_text(json.dumps({"good": ENTRY, "bad": {**ENTRY, **change}}))
    with pytest.raises(FloorlineError) as raised:
        GemvTuner("cpu")
    assert str(raised.value) == (f"cannot read the GEMV tuning table {table} (entry 'bad': "
                                 f"{fragment}); delete it to tune again")
    table.write_text(json.dumps({"good": ENTRY, "split": {**ENTRY, "split_k": 7, "words": 2}}))
    assert len(GemvTuner("cpu").table) > 2  # the shipped tables, and these two


def test_a_local_models_label_needs_no_home_directory(monkeypatch):
    """As Path.home() fails with HOME unset for a uid the password database does not know; and
    a working folder removed under the process."""
    def no_home():
        raise RuntimeError("Could not determine home directory.")

    def no_cwd():
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(Path, "home", no_home)
    assert model_label("/models/a/b/c/" + "x" * 40) == "…/c/" + "x" * 40
    monkeypatch.setattr(Path, "cwd", no_cwd)
    assert model_label("/models/tiny") == "/models/tiny"


def test_a_checkpoint_without_its_head_is_refused_by_every_path(tmp_path, checkpoint):  # noqa: F811
    directory = tmp_path / "ck"
    shutil.copytree(checkpoint, directory)
    edit_tensors(directory, drop_head)
    db = tmp_path / "r.db"
    run("sweep", "--models", directory, "--ctx", "8", "--paths", "engine,hf-eager", "--steps",
        "1", "--warmup", "0", "--device", "cpu", "--gpu", "l4", "--no-quality", "--db", db)
    code, out, err = run("show", "--db", db, "--json")
    assert code == 0, err
    cells = {c["path"]: c for c in json.loads(out)}
    for path in ("engine", "hf-eager"):
        assert cells[path]["status"] == "invalid", cells[path]
        assert cells[path]["reason"].startswith(
            f"{directory}: no tensor 'lm_head.weight' in its safetensors files "
            "(tie_word_embeddings is false)")


def test_an_unreadable_checkpoint_is_named_unreadable(tmp_path, checkpoint, monkeypatch):  # noqa: F811
    directory = tmp_path / "ck"
    shutil.copytree(checkpoint, directory)
    weights = directory / "model.safetensors"
    weights.chmod(0)
    if os.access(weights, os.R_OK):  # root reads any file: refused here as a user is refused
        opened = Path.open

        def refuse(self, *args, **kwargs):
            if self == weights:
                raise PermissionError(13, "Permission denied", str(self))
            return opened(self, *args, **kwargs)

        monkeypatch.setattr(Path, "open", refuse)
    try:
        refused("generate", "--model", directory, "--prompt", "w1 w2", "--max-new-tokens", 2,
                "--device", "cpu", naming=f"{weights} cannot be read: permission denied")
        with pytest.raises(FloorlineError, match=f"{weights} cannot be read: permission denied"):
            REGISTRY["hf-eager"].build(resolve_model(str(directory)), "cpu", 0)
    finally:
        weights.chmod(0o644)


@pytest.fixture(scope="module")
def huge_cache_checkpoint(tmp_path_factory):
    """A checkpoint of 2^26 positions whose KV cache (4 MiB a position: 64 layers of one head of
    16384) is 2^48 bytes, beyond any address space; its weights are 17 MB."""
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("huge")
    config = LlamaConfig(vocab_size=len(WORDS), hidden_size=2, intermediate_size=2,
                         num_hidden_layers=64, num_attention_heads=1, num_key_value_heads=1,
                         head_dim=16384, max_position_embeddings=2**26, bos_token_id=None,
                         eos_token_id=EOS, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    word_tokenizer().save_pretrained(directory)
    return directory


def test_a_kv_cache_no_memory_holds_is_one_line_with_its_size(huge_cache_checkpoint):
    line = refused("generate", "--model", huge_cache_checkpoint, "--prompt", "w1 w2",
                   "--device", "cpu", "--max-new-tokens", 2**26 - 64,
                   naming="cannot allocate the KV cache: ", also="more than cpu could give")
    positions = int(line.split("KV cache: ")[1].split(" positions")[0].replace(",", ""))
    assert f"positions take {positions * 2**22:,} bytes" in line
