"""`floorline generate` on a tiny real checkpoint written here (no download): the engine's greedy
tokens against transformers', EOS, seeded sampling, streaming, the CLI and its errors."""

import json
import re
import shutil

import pytest
import torch

from conftest import run_here
from floorline.engine.generate import TextStream, generate
from floorline.errors import FloorlineError

SPECIALS = ["[UNK]", "</s>", "<user>", "<assistant>"]
EOS = SPECIALS.index("</s>")
WORDS = SPECIALS + [f"w{i}" for i in range(60)]
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
PROMPT = "w1 w2 w3 w4"
NEW = 16


def word_tokenizer(words=WORDS):
    """A whitespace tokenizer of `words` (the specials first), with the chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="</s>",
                                   chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A 2-layer Llama (GQA) with seeded weights, its tokenizer and chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("checkpoint")
    config = LlamaConfig(vocab_size=len(WORDS), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=None, eos_token_id=EOS,
                         initializer_range=0.1)  # wider than the default: clear argmax margins
    torch.manual_seed(0)
    LlamaForCausalLM(config).float().save_pretrained(directory, safe_serialization=True)
    word_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def greedy(checkpoint):
    return generate(checkpoint, PROMPT, max_new_tokens=NEW, device="cpu", dtype="float32")


def test_greedy_matches_transformers(checkpoint, greedy):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    messages = [{"role": "user", "content": PROMPT}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                           return_dict=True)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(prompt) == ["<user>", *PROMPT.split(), "<assistant>"]
    assert greedy.prompt_ids == prompt
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    ids = torch.tensor([prompt])
    theirs = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                            max_new_tokens=NEW, pad_token_id=EOS)[0, len(prompt):].tolist()
    assert len(greedy.ids) == NEW and not greedy.stopped_at_eos  # the comparison spans every step
    assert greedy.ids == theirs
    assert greedy.text == tokenizer.decode(theirs)
    assert greedy.steps == NEW - 1 and greedy.ms_per_token > 0 and greedy.device_ms is None


def test_no_chat_encodes_the_prompt_as_it_is(checkpoint):
    result = generate(checkpoint, PROMPT, max_new_tokens=1, dtype="float32", chat=False)
    assert result.prompt_ids == [WORDS.index(w) for w in PROMPT.split()]
    assert len(result.ids) == 1 and result.steps == 0 and result.ms_per_token is None


@pytest.mark.parametrize("where", ["config.json", "generation_config.json"])
def test_eos_stops_generation(checkpoint, greedy, tmp_path, where):
    # A token that greedy decoding first produces at step k becomes an EOS too (in a list, as
    # some checkpoints have it), so the same decoding must stop right after it.
    k = next(i for i in range(1, NEW) if greedy.ids[i] not in greedy.ids[:i])
    assert k < NEW - 1
    shutil.copytree(checkpoint, tmp_path, dirs_exist_ok=True)
    path = tmp_path / where
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "eos_token_id": [EOS, greedy.ids[k]]}))
    result = generate(tmp_path, PROMPT, max_new_tokens=NEW, dtype="float32")
    assert result.ids == greedy.ids[:k + 1] and result.stopped_at_eos


def test_sampling_is_seeded(checkpoint, greedy):
    def sample(seed, top_p=1.0):
        return generate(checkpoint, PROMPT, max_new_tokens=NEW, temperature=1.0, top_p=top_p,
                        seed=seed, dtype="float32").ids

    assert sample(1) == sample(1)
    assert any(sample(seed) != greedy.ids for seed in range(4))
    # A nucleus this small keeps only the most likely token: greedy again.
    assert sample(2, top_p=1e-6) == greedy.ids


def test_stream_holds_back_split_characters():
    """Byte-level tokens: 'é' and each CJK character span several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    text = "café 日本"
    pieces = []
    stream = TextStream(tokenizer, pieces.append)
    for token in tokenizer(text)["input_ids"]:
        stream.push(token)
    assert stream.finish() == text
    assert "".join(pieces) == text and len(pieces) > 1
    assert not any("\ufffd" in p for p in pieces)


def test_cli_streams_text_and_summarises(cli, checkpoint, greedy):
    proc = cli("generate", "--model", checkpoint, "--prompt", PROMPT, "--max-new-tokens", NEW,
               "--device", "cpu", "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == greedy.text + "\n"
    ctx = len(greedy.prompt_ids) + NEW - 2  # the last step reads the cache up to here
    summary = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"{NEW} new tokens, prefill [\d.]+ ms \([\d]+ tokens/s\), "
                        rf"decode [\d.]+ ms/token, [\d.]+% of the floor \([\d.]+ ms at ctx {ctx}, "
                        r"weights fp32, KV fp32, on cpu at [\d.]+ GB/s\)", summary), summary


@pytest.mark.parametrize("case, message", [
    ("shipped", "tiny-llama is a shipped config without weights"),
    ("no-tokenizer", "transformers cannot load a tokenizer"),
    ("too-long", "above the model's 256 positions"),
])
def test_cli_errors(cli, checkpoint, tmp_path, case, message):
    model, new = str(checkpoint), 8
    if case == "shipped":
        model = "tiny-llama"
    elif case == "no-tokenizer":
        for name in ("config.json", "model.safetensors"):
            shutil.copy(checkpoint / name, tmp_path)
        model = tmp_path
    else:
        new = 256
    proc = cli("generate", "--model", model, "--prompt", PROMPT, "--max-new-tokens", new,
               "--device", "cpu")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("floorline: error:") and message in proc.stderr


def test_bad_arguments_are_one_line_errors(checkpoint):
    with pytest.raises(FloorlineError, match="dtype must be one of"):
        generate(checkpoint, PROMPT, dtype="float16")
    with pytest.raises(FloorlineError, match="top_p"):
        generate(checkpoint, PROMPT, temperature=1.0, top_p=0.0)
    for value in (float("nan"), float("inf")):  # nan passes every comparison
        with pytest.raises(FloorlineError, match="temperature must be a finite number"):
            generate(checkpoint, PROMPT, temperature=value)


def test_int4_and_fp8_generate_from_a_16bit_checkpoint(checkpoint):
    # hidden 64 is not a whole number of 128-groups: int4 runs in groups of 64, or of 32 asked
    for weights, head, group, summary in (("int4", "bf16", None, "engine-int4-g64"),
                                          ("int4", "bf16", 32, "engine-int4-g32"),
                                          ("fp8", "fp8", None, "engine-fp8-fp8head")):
        proc = run_here("generate", "--model", checkpoint, "--prompt", PROMPT,
                        "--max-new-tokens", 4, "--device", "cpu", "--dtype", "float32",
                        "--weights", weights, "--head", head,
                        *(("--group-size", group) if group else ()))
        assert proc.returncode == 0, proc.stderr
        assert f"weights {summary}," in proc.stderr
    # the fp8 head on the default, 16-bit, linears (in float32 the engine's logits with it are
    # checked against transformers: tests/test_engine_quant.py)
    proc = run_here("generate", "--model", checkpoint, "--prompt", PROMPT, "--max-new-tokens", 4,
                    "--device", "cpu", "--dtype", "bfloat16", "--head", "fp8")
    assert proc.returncode == 0 and "fp8head," in proc.stderr, proc.stderr
    # the 16-bit linears' routes on this CPU, each with the trial that chose it
    assert re.search(r"\nthe CPU's products: 1-2 rows: bf16 (as stored|widened to fp32|by "
                     r"floorline's AVX2 kernel) \([\d.]+ ms bf16, [\d.]+ ms widened"
                     r"(, [\d.]+ ms kernel)? in its trial\); more rows: ", proc.stderr), proc.stderr
    proc = run_here("generate", "--model", checkpoint, "--prompt", PROMPT, "--device", "cpu",
                    "--weights", "int4", "--group-size", 128)
    assert proc.returncode == 2 and "int4 group 128 needs every matrix width (64, 128)" in \
        proc.stderr and "Traceback" not in proc.stderr
    proc = run_here("generate", "--model", checkpoint, "--prompt", PROMPT, "--device", "cpu",
                    "--weights", "nf4")
    assert proc.returncode == 2 and "engine weights must be one of" in proc.stderr


def test_generate_with_an_fp8_kv_cache(checkpoint, greedy):
    proc = run_here("generate", "--model", checkpoint, "--prompt", PROMPT, "--max-new-tokens", 6,
                    "--device", "cpu", "--dtype", "float32", "--kv-dtype", "fp8")
    assert proc.returncode == 0, proc.stderr
    # the floor is the fp8 cache's, scales included; the 16-bit run names its dtype's
    assert "KV engine-fp8" in proc.stderr and "tokens/s" in proc.stderr
    assert greedy.kv_format == "fp32"
    result = generate(checkpoint, PROMPT, max_new_tokens=6, device="cpu", dtype="float32",
                      kv="fp8")
    assert result.kv_format == "engine-fp8" and len(result.ids) == 6
