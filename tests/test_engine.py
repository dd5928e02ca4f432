"""floorline's engine against transformers, its path under the measurement contract, its
sampler and its checkpoint loading."""

import json
import math
import re

import pytest
import torch
from tests.conftest import KERNEL_DEVICE, run_here, shipped_config

from floorline.engine import Engine, tuning
from floorline.engine.check import compare_with_transformers
from floorline.engine.kernels.gemv import GemvConfig
from floorline.engine.model import DecoderConfig, EngineUnsupported, inverse_frequencies
from floorline.engine.sampling import Sampler
from floorline.engine.weights import from_named, load_checkpoint
from floorline.errors import FloorlineError
from floorline.models import build_model, resolve_model
from floorline.models.zoo import ModelSpec, _config_from_dict


def spec_from(data: dict, name="test-config") -> ModelSpec:
    return ModelSpec(name, _config_from_dict(data, name))


def llama3_scaled() -> ModelSpec:
    """tiny-llama with Llama 3.1's rope scaling, at an original length the test crosses."""
    data = shipped_config("tiny-llama")
    data["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    data["rope_theta"] = 500000.0
    return spec_from(data, "tiny-llama3-rope")


@pytest.mark.parametrize("spec", [
    resolve_model("tiny-llama"), resolve_model("tiny-qwen2"), llama3_scaled(),
], ids=lambda s: s.name)
def test_float32_greedy_tokens_equal_transformers_for_64_steps(spec):
    result = compare_with_transformers(spec, "cpu", torch.float32, prompt_len=16, steps=64)
    assert result.positions == 65
    assert result.argmax_agree == 65
    assert max(result.errors) < 1e-5


def test_sliding_window_past_the_window():
    # tiny-mistral-swa's window is 256 tokens: a 250-token prompt and 20 steps cross it
    spec = resolve_model("tiny-mistral-swa")
    assert set(DecoderConfig.from_hf(spec.config).windows) == {256}
    result = compare_with_transformers(spec, "cpu", torch.float32, prompt_len=250, steps=20)
    assert result.argmax_agree == result.positions == 21
    assert max(result.errors) < 1e-5


def test_the_comparison_gives_transformers_a_long_prompt_in_pieces(monkeypatch):
    from floorline.engine import check

    monkeypatch.setattr(check, "HF_CHUNK", 5)  # 16 prompt tokens: pieces of 5, 5, 5 and 1
    result = compare_with_transformers(resolve_model("tiny-llama"), "cpu", torch.float32,
                                       prompt_len=16, steps=4)
    assert result.argmax_agree == result.positions == 5
    assert max(result.errors) < 1e-5


def test_bf16_logits_stay_in_transformers_own_band():
    result = compare_with_transformers(resolve_model("tiny-qwen2"), "cpu", torch.bfloat16,
                                       prompt_len=8, steps=8)
    # against transformers in float32, the engine's bf16 error is of the order of transformers'
    # own bf16 error (the engine keeps its residual stream in fp32)
    summary = result.summary()
    engine, hf = summary["engine_vs_fp32_median"], summary["hf_vs_fp32_median"]
    assert 0 < engine < 2 * hf < 5e-2


def test_the_kernels_decode_like_transformers():
    # the Triton backend (the interpreter on the CPU): few steps, it is slow there
    result = compare_with_transformers(resolve_model("tiny-qwen2"), KERNEL_DEVICE, torch.float32,
                                       prompt_len=6, steps=3, backend="triton")
    assert result.backend == "triton"
    assert result.argmax_agree == result.positions == 4
    assert max(result.errors) < 1e-5


def test_the_kernels_decode_like_transformers_with_every_product_split(monkeypatch):
    # every GEMV split along K in two, so q/k/v, gate/up and the head meet in partials shared by
    # the layers' launches of one shape: the step still decodes as transformers does. Tiles of
    # 128 x 64 (the interpreter's cost is per program): K = 96 splits into a whole tile and a
    # masked half, K = 256 into two whole tiles each
    monkeypatch.setattr(tuning.GemvTuner, "config",
                        lambda self, w, out, **flags: GemvConfig(128, 64, split_k=2))
    result = compare_with_transformers(resolve_model("tiny-qwen2"), KERNEL_DEVICE, torch.float32,
                                       prompt_len=6, steps=2, backend="triton")
    assert result.argmax_agree == result.positions == 3
    assert max(result.errors) < 1e-5


def test_llama3_inverse_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    spec = resolve_model("llama-3.1-8b")
    mine = inverse_frequencies(DecoderConfig.from_hf(spec.config))
    theirs, scaling = ROPE_INIT_FUNCTIONS["llama3"](spec.config, "cpu")
    assert scaling == 1.0
    assert torch.allclose(mine.float(), theirs.float(), rtol=1e-6)
    # the scaling changes the long wavelengths only: the first frequency is 1, the last / 8
    assert mine[0] == 1.0 and math.isclose(mine[-1] * 8, 500000 ** (-126 / 128), rel_tol=1e-9)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gpt2"}, "not 'gpt2'"),
    ({"hidden_act": "gelu"}, "SwiGLU"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
    ({"head_dim": 24}, "head_dim 24"),
])
def test_unsupported_architectures_are_one_line(change, message):
    data = {**shipped_config("tiny-llama"), **change}
    if change.get("model_type") == "gpt2":
        data = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 100}
    with pytest.raises(EngineUnsupported, match=message):
        DecoderConfig.from_hf(spec_from(data).config)


@pytest.fixture(scope="module")
def engine_cells(tmp_path_factory):
    """One sweep of the engine's paths on the CPU, two models and one whose architecture the
    engine does not run: the sweep's process and its rows by (model, path), and that model."""
    root = tmp_path_factory.mktemp("engine-sweep")
    gelu = root / "gelu"
    gelu.mkdir()
    (gelu / "config.json").write_text(json.dumps({**shipped_config("tiny-llama"),
                                                   "hidden_act": "gelu"}))
    db = root / "e.db"
    proc = run_here("sweep", "--db", db, "--models", f"tiny-llama,tiny-qwen2,{gelu}", "--ctx",
                    "16", "--paths", "engine,engine+graphs,engine+compile", "--steps", "4",
                    "--warmup", "1", "--device", "cpu", check=True)
    rows = json.loads(run_here("show", "--db", db, "--json", check=True).stdout)
    return proc, {(r["model"], r["path"]): r for r in rows}, str(gelu)


def test_the_engine_path_runs_the_contract_and_refuses_options(engine_cells):
    proc, rows, _ = engine_cells
    assert "Traceback" not in proc.stderr
    for model in ("tiny-llama", "tiny-qwen2"):
        assert rows[model, "engine"]["status"] == "valid"
        assert len(rows[model, "engine"]["samples_ms"]) == 4
        # the routes the CPU step chose for its bf16 products, and the trials behind them
        details = rows[model, "engine"]["details"]
        assert re.fullmatch(r"1-2 rows: bf16 (as stored|widened to fp32|by floorline's AVX2 "
                            r"kernel); more rows: bf16 (as stored|widened to fp32)"
                            r"(; floorline's AVX2 kernel: .+)?", details["cpu_products"])
        assert set(details["cpu_product_trials"]) == {"few", "many"}
        for option, why in (("engine+graphs", "+graphs needs a CUDA device"),
                            ("engine+compile", "captures its own step")):
            assert rows[model, option]["status"] == "invalid"
            assert why in rows[model, option]["reason"]
    table = " ".join(proc.stdout.split())
    assert "engine's products on this CPU: 1-2 rows: bf16" in table


def test_an_unsupported_model_is_an_invalid_engine_cell(engine_cells):
    _, rows, gelu = engine_cells
    row = rows[gelu, "engine"]
    assert row["status"] == "invalid" and "SwiGLU" in row["reason"]


def test_greedy_and_nucleus_sampling():
    logits = torch.tensor([1.0, 3.0, 2.5, -1.0])
    token = torch.zeros(1, dtype=torch.long)
    Sampler()(logits, token)
    assert token.item() == 1
    # top_p below the top token's probability: always that token
    torch.manual_seed(0)
    narrow = Sampler(temperature=1.0, top_p=0.3)
    assert {(narrow(logits, token), token.item())[1] for _ in range(50)} == {1}
    # full nucleus at temperature 1: frequencies follow the softmax
    wide, draws = Sampler(temperature=1.0, top_p=1.0), 4000
    counts = torch.zeros(4)
    for _ in range(draws):
        wide(logits, token)
        counts[token.item()] += 1
    expected = torch.softmax(logits, 0) * draws
    assert ((counts - expected).abs() < 5 * expected.sqrt() + 5).all()
    # top_p = 0.8 keeps tokens 1 and 2 (0.57 + 0.34 of the mass): never 0 or 3
    torch.manual_seed(1)
    top = Sampler(temperature=1.0, top_p=0.8)
    seen = set()
    for _ in range(300):
        top(logits, token)
        seen.add(token.item())
    assert seen == {1, 2}
    with pytest.raises(ValueError):
        Sampler(temperature=-1.0)


def test_sampling_through_the_engines_argmax_kernel():
    # the step hands the sampler its argmax kernel (Triton's interpreter without a GPU)
    from functools import partial

    from floorline.engine.kernels.tokens import argmax, argmax_scratch

    logits = torch.tensor([1.0, 3.0, 2.5, -1.0], device=KERNEL_DEVICE)
    token = torch.zeros(1, dtype=torch.long, device=KERNEL_DEVICE)
    kernel = partial(argmax, scratch=argmax_scratch(4, KERNEL_DEVICE))
    Sampler()(logits, token, kernel)
    assert token.item() == 1
    torch.manual_seed(1)
    top, seen = Sampler(temperature=1.0, top_p=0.8), set()
    for _ in range(100):
        top(logits, token, kernel)
        seen.add(token.item())
    assert seen == {1, 2}


def test_a_checkpoint_loads_as_the_model_holds_it(tmp_path):
    spec = resolve_model("tiny-qwen2")
    model = build_model(spec, "cpu", torch.float32, seed=3)
    model.save_pretrained(tmp_path, safe_serialization=True)
    config = DecoderConfig.from_hf(spec.config)
    loaded = load_checkpoint(tmp_path, config, "cpu", torch.float32)
    params = dict(model.named_parameters())
    direct = from_named(config, params.__getitem__, "cpu", torch.float32)
    assert torch.equal(loaded.layers[1].wqkv, direct.layers[1].wqkv)
    assert torch.equal(loaded.layers[0].bqkv, direct.layers[0].bqkv)
    assert loaded.head is loaded.embed  # tied
    # a shard missing a tensor is one clear line
    from safetensors.torch import load_file, save_file

    (shard,) = tmp_path.glob("*.safetensors")
    tensors = load_file(shard)
    del tensors["model.norm.weight"]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(FloorlineError, match="no tensor 'model.norm.weight'"):
        load_checkpoint(tmp_path, config, "cpu", torch.float32)


def test_the_cache_is_allocated_once_for_the_capacity():
    engine = Engine(resolve_model("tiny-llama"), "cpu", 40, dtype=torch.float32)
    cache = engine.decoder.k_cache
    engine.prefill(torch.arange(10))
    assert engine.position.item() == 10
    for _ in range(5):
        engine.step()
    assert engine.decoder.k_cache is cache and cache.shape[2] == 40
    assert engine.position.item() == 15
    with pytest.raises(FloorlineError, match="prefill of 40 tokens"):
        engine.prefill(torch.arange(40))
    engine.prefill(torch.arange(38))
    engine.step(), engine.step()
    with pytest.raises(FloorlineError, match="cache of 40 tokens is full"):
        engine.step()
    with pytest.raises(FloorlineError, match="backend must be"):
        Engine(resolve_model("tiny-llama"), "cpu", 8, backend="cuda")


@pytest.mark.parametrize("text", ["[1, 2]", "{\"k\": {\"block_n\": 4}}", "{oops"])
def test_a_broken_tuning_table_is_one_line(tmp_path, monkeypatch, text):
    from floorline.engine.tuning import GemvTuner

    monkeypatch.setenv("FLOORLINE_CACHE", str(tmp_path))
    (tmp_path / "engine-gemv.json").write_text(text)
    with pytest.raises(FloorlineError, match="delete it to tune again"):
        GemvTuner("cpu")


def test_a_configuration_saved_to_the_local_table_is_used_over_the_shipped_one(tmp_path,
                                                                                monkeypatch):
    from floorline.engine.kernels.gemv import GemvConfig
    from floorline.engine.tuning import SHIPPED, GemvTuner

    monkeypatch.setenv("FLOORLINE_CACHE", str(tmp_path))
    shipped = {f: f.read_bytes() for f in SHIPPED.glob("*.json")}
    tuner = GemvTuner("cpu")
    key = next(iter(tuner.table))  # a shipped key
    mine = GemvConfig(4, 256, num_warps=2, split_k=3)
    assert tuner.current(key) != mine
    tuner.use(key, mine, step_ratio=0.99)
    tuner.save(key)
    again = GemvTuner("cpu")
    assert again.current(key) == mine and again.table[key]["step_ratio"] == 0.99
    assert {f: f.read_bytes() for f in SHIPPED.glob("*.json")} == shipped


@pytest.mark.parametrize("name, n, chunk", [("tiny-llama", 40, 7), ("tiny-qwen2", 33, 16),
                                            ("tiny-mistral-swa", 300, 64)])
def test_chunked_prefill_equals_one_pass(name, n, chunk):
    # the window of tiny-mistral-swa (256) is crossed inside a chunk and by whole chunks
    spec = resolve_model(name)
    whole = Engine(spec, "cpu", n + 4, dtype=torch.float32)
    tokens = torch.randint(whole.config.vocab, (n,), generator=torch.Generator().manual_seed(n))
    chunked = Engine(spec, "cpu", n + 4, dtype=torch.float32)
    a, b = whole.prefill(tokens), None
    b = chunked.decoder.prefill(tokens, chunk=chunk)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    for cache in ("k_cache", "v_cache"):
        mine, theirs = getattr(chunked.decoder, cache), getattr(whole.decoder, cache)
        assert torch.allclose(mine[:, :, :n], theirs[:, :, :n], rtol=1e-5, atol=1e-5)
    assert chunked.position.item() == n and chunked.token.item() == whole.token.item()
    # and the steps after it decode alike
    for engine in (whole, chunked):
        engine.filled = n
        engine.step()
    assert torch.allclose(whole.logits, chunked.logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(FloorlineError, match="chunk must be at least 1"):
        chunked.decoder.prefill(tokens, chunk=0)
