import functools
import json
import re

import pytest
import torch
from tests.test_engine_families import CONFIGS as FAMILY_CONFIGS
from tests.test_engine_families import spec as family_spec

from conftest import run_here, shipped_config
from floorline import traffic
from floorline.errors import FloorlineError
from floorline.hardware import lookup
from floorline.models import build_model, resolve_model, shipped_models
from floorline.models.zoo import SOURCES, ModelSpec, ShippedConfig, _config_from_dict, stand_in
from floorline.traffic import (
    FAMILIES,
    KV_FORMATS,
    WEIGHT_FORMATS,
    counts_from_model,
    counts_from_sizes,
    floor,
    kv_heads_and_dim,
    kv_layout,
)


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
def test_impossible_sizes_are_one_line_naming_the_field(tmp_path, change, message):
    (tmp_path / "config.json").write_text(json.dumps({**shipped_config("tiny-llama"), **change}))
    with pytest.raises(FloorlineError, match=message):
        resolve_model(str(tmp_path))


# The command's line for each kind of refusal above (a range, a type), the same error each time
@pytest.mark.parametrize("change, message", [
    ({"num_hidden_layers": 0}, "num_hidden_layers = 0 is outside 1..4096"),
    ({"hidden_size": "128"}, "Field 'hidden_size' expected int, got str"),
])
def test_an_impossible_size_is_one_line_from_the_command(tmp_path, change, message):
    (tmp_path / "config.json").write_text(json.dumps({**shipped_config("tiny-llama"), **change}))
    proc = run_here("floor", "--model", tmp_path, "--gpu", "l4", "--ctx", "64")
    assert proc.returncode == 2 and message.split(" is ")[0] in proc.stderr.replace("\n", " ")
    assert str(tmp_path / "config.json") in proc.stderr and "Traceback" not in proc.stderr


def test_shipped_models_resolve_in_any_case_and_by_their_hub_id(tmp_path):
    assert resolve_model("Qwen/Qwen2.5-7B").name == "qwen2.5-7b"
    assert resolve_model("meta-llama/llama-3.1-8b").name == "llama-3.1-8b"
    assert resolve_model("Mistral-7B-v0.3").name == "mistral-7b-v0.3"
    with pytest.raises(FloorlineError, match="did you mean 'qwen2.5-7b'"):
        resolve_model("qwen2.5-7")
    with pytest.raises(FloorlineError, match="nor a directory$"):
        resolve_model("no-such-model-anywhere")
    proc = run_here("floor", "--model", "Qwen/Qwen2.5-7B", "--gpu", "h200", "--ctx", "2048",
                    "--json", check=True)
    assert json.loads(proc.stdout)[0]["model"] == "qwen2.5-7b"


# --- counted from the config, no model built ------------------------------------------------------

def arithmetic_and_built(model_spec):
    text = model_spec.text
    return counts_from_sizes(text, FAMILIES[text.model_type]), counts_from_model(model_spec)


@pytest.mark.parametrize("name", shipped_models())
def test_shipped_parameters_counted_from_the_config_are_the_built_models(name):
    counted, built = arithmetic_and_built(resolve_model(name))
    assert counted == built  # every linear's shape, in the model's order, and every total


@pytest.mark.parametrize("name", FAMILY_CONFIGS)
def test_family_parameters_counted_from_the_config_are_the_built_models(name):
    counted, built = arithmetic_and_built(family_spec(name))
    assert counted == built


@pytest.mark.parametrize("name, data", [
    ("llama-biases", {**shipped_config("tiny-llama"), "attention_bias": True, "mlp_bias": True}),
    ("qwen3-bias", {**FAMILY_CONFIGS["qwen3"], "attention_bias": True}),
    ("gemma3-bias", {**FAMILY_CONFIGS["gemma3"], "attention_bias": True}),
])
def test_biases_a_config_asks_for_are_counted_as_built(name, data):
    counted, built = arithmetic_and_built(ModelSpec(name, _config_from_dict(data, name)))
    assert counted.linear_bias > 0 and counted == built


@pytest.mark.parametrize("name", shipped_models())
def test_floor_bytes_are_those_of_transformers_config_and_the_built_model(name, monkeypatch):
    # before: transformers' config and the model built on the meta device; now: the shipped
    # config's fields and arithmetic, with no transformers import
    shipped = resolve_model(name)
    built = ModelSpec(name, shipped.config)
    assert isinstance(shipped.text, ShippedConfig) and not isinstance(built.text, ShippedConfig)
    gpu = lookup("h200")

    def floor_bytes(model_spec):
        return [(f.weight_format, f.weight_bytes, f.kv_bytes, f.total_bytes,
                 f.total_bytes_all_params)
                for weights in WEIGHT_FORMATS for kv in KV_FORMATS for ctx in (1, 777, 4096, 131072)
                for f in [floor(model_spec, gpu, ctx, weights, kv)]]

    now = floor_bytes(shipped)
    monkeypatch.setattr(traffic, "count_parameters", functools.cache(counts_from_model))
    assert floor_bytes(built) == now
    fields = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads")
    assert [getattr(shipped.text, f) for f in fields] == [getattr(built.text, f) for f in fields]
    assert kv_layout(shipped.text) == kv_layout(built.text)
    assert kv_heads_and_dim(shipped.text) == kv_heads_and_dim(built.text)
    assert shipped.max_context == built.max_context


# --- names ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant, shipped", [
    ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b"),
    ("Qwen/Qwen2.5-1.5B-Instruct", "qwen2.5-1.5b"),
    ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b"),
    ("meta-llama/Llama-3.2-1B-Instruct", "llama-3.2-1b"),
    ("mistralai/Mistral-7B-Instruct-v0.3", "mistral-7b-v0.3"),
    ("gemma-3-4b-it", "gemma-3-4b"),
    ("phi-4-mini-instruct", "phi-4-mini"),
    ("qwen3-8b-chat", "qwen3-8b"),
])
def test_instruct_and_chat_ids_run_as_their_shipped_config(variant, shipped):
    assert resolve_model(variant).name == shipped and stand_in(variant) == shipped


def test_stand_in_is_only_for_a_tuned_variant():
    for name in ("qwen2.5-7b", "Qwen/Qwen2.5-7B", "google/gemma-3-4b-it", "no-such-model"):
        assert stand_in(name) is None, name
    # another release under the same name is another config: refused, its base suggested first
    with pytest.raises(FloorlineError, match=r"unknown model .*did you mean 'qwen3-4b' or"):
        resolve_model("Qwen/Qwen3-4B-Instruct-2507")


def test_unknown_model_suggests_every_close_name_closest_first():
    with pytest.raises(FloorlineError,
                       match=r"did you mean 'llama-3.1-8b' or 'llama-3.2-1b'\?$"):
        resolve_model("llama3-8b")
    # a whole word of a name or id (here the Hugging Face organisation) makes it close
    with pytest.raises(FloorlineError) as refused:
        resolve_model("qwen")
    suggested = re.findall(r"'([^']+)'", str(refused.value).split("did you mean")[1])
    assert sorted(suggested) == sorted(n for n, s in SOURCES.items() if s.startswith("Qwen/"))

