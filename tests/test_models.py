import json

import pytest
import torch

from conftest import shipped_config
from floorline.errors import FloorlineError
from floorline.models import build_model, resolve_model


def test_random_weights_are_seeded_realistic_and_not_zero():
    spec = resolve_model("tiny-llama")
    a = build_model(spec, "cpu", torch.bfloat16, seed=1)
    b = build_model(spec, "cpu", torch.bfloat16, seed=1)
    c = build_model(spec, "cpu", torch.bfloat16, seed=2)
    wa = a.model.layers[0].mlp.up_proj.weight.float()
    assert torch.equal(wa, b.model.layers[0].mlp.up_proj.weight.float())
    assert not torch.equal(wa, c.model.layers[0].mlp.up_proj.weight.float())
    assert wa.std().item() == pytest.approx(0.02, rel=0.1)  # the config's initializer_range
    for name, p in a.named_parameters():
        assert p.abs().sum() > 0, name


def test_local_directory_with_safetensors_loads_real_weights(tmp_path):
    original = build_model(resolve_model("tiny-qwen2"), "cpu", torch.bfloat16, seed=7)
    original.save_pretrained(tmp_path, safe_serialization=True)
    assert list(tmp_path.glob("*.safetensors"))
    spec = resolve_model(str(tmp_path))
    assert spec.has_real_weights
    loaded = build_model(spec, "cpu", torch.bfloat16, seed=0)
    for (n, p), (_, q) in zip(original.named_parameters(), loaded.named_parameters()):
        assert torch.equal(p, q), n


def test_local_directory_without_weights_builds_random_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(shipped_config("tiny-llama")))
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle files are never read")
    spec = resolve_model(str(tmp_path))
    assert not spec.has_real_weights
    built = build_model(spec, "cpu", torch.bfloat16)
    assert built.model.layers[0].self_attn.q_proj.weight.std() > 0


@pytest.mark.parametrize("content, message", [
    (None, "has no config.json"),
    ("{not json", "is not valid JSON"),
    ('{"hidden_size": 8}', "has no 'model_type'"),
    ('{"model_type": "no-such-arch"}', "transformers cannot build this config"),
    ('{"model_type": "llama", "auto_map": {"AutoModelForCausalLM": "x.Y"}}', "--trust-remote-code"),
])
def test_bad_local_configs(tmp_path, content, message):
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises(FloorlineError, match=message):
        resolve_model(str(tmp_path))


def test_unknown_model_name():
    with pytest.raises(FloorlineError, match="unknown model 'qwen9'"):
        resolve_model("qwen9")


@pytest.mark.parametrize("change, message", [
    ({"num_hidden_layers": 0}, "num_hidden_layers = 0 is outside 1..4096"),
    ({"num_hidden_layers": 10**6}, "num_hidden_layers = 1000000 is outside"),
    ({"hidden_size": "128"}, "Field 'hidden_size' expected int, got str"),
    ({"vocab_size": 1000.0}, "Field 'vocab_size' expected int, got float"),
    ({"num_attention_heads": True}, "Field 'num_attention_heads' expected int, got bool"),
    ({"intermediate_size": -1}, "intermediate_size = -1 is outside"),
    ({"sliding_window": 0}, "sliding_window = 0 is outside"),
    ({"num_key_value_heads": 3}, "num_key_value_heads = 3 does not divide num_attention_heads = 4"),
    ({"num_key_value_heads": 8}, "num_key_value_heads = 8 does not divide"),
    ({"hidden_size": 130}, "is not a multiple of the number of attention heads"),
])
def test_impossible_sizes_are_one_line_naming_the_field(tmp_path, cli, change, message):
    (tmp_path / "config.json").write_text(json.dumps({**shipped_config("tiny-llama"), **change}))
    with pytest.raises(FloorlineError, match=message):
        resolve_model(str(tmp_path))
    proc = cli("floor", "--model", tmp_path, "--gpu", "l4", "--ctx", "64")
    assert proc.returncode == 2 and message.split(" is ")[0] in proc.stderr.replace("\n", " ")
    assert str(tmp_path / "config.json") in proc.stderr and "Traceback" not in proc.stderr


def test_shipped_models_resolve_in_any_case_and_by_their_hub_id(tmp_path, cli):
    assert resolve_model("Qwen/Qwen2.5-7B").name == "qwen2.5-7b"
    assert resolve_model("meta-llama/llama-3.1-8b").name == "llama-3.1-8b"
    assert resolve_model("Mistral-7B-v0.3").name == "mistral-7b-v0.3"
    with pytest.raises(FloorlineError, match="did you mean 'qwen2.5-7b'"):
        resolve_model("qwen2.5-7")
    with pytest.raises(FloorlineError, match="nor a directory$"):
        resolve_model("no-such-model-anywhere")
    proc = cli("floor", "--model", "Qwen/Qwen2.5-7B", "--gpu", "h200", "--ctx", "2048", "--json",
               check=True)
    assert json.loads(proc.stdout)[0]["model"] == "qwen2.5-7b"
