"""Quality beside speed: the metrics against hand arithmetic, a float32 path against the reference
it equals, the engine's logits at every position, random weights left unmeasured, a failed
measurement kept with its cause, and the quality and show commands on a tiny real checkpoint
written here (no download)."""

import math
import sys

import numpy as np
import pytest
import torch
from tests.test_generate import EOS, WORDS, word_tokenizer

from conftest import run_here
from floorline.engine import Engine
from floorline.hardware import lookup
from floorline.measure import quality, runner
from floorline.measure.quality import (
    NEW_TOKENS,
    RANDOM_WEIGHTS,
    Reference,
    measure_quality,
    quality_key,
    score_window,
    summarise_quality,
)
from floorline.measure.sweep import Grid, Sweep
from floorline.measure.texts import evaluation_text
from floorline.models import resolve_model
from floorline.paths import REGISTRY
from floorline.paths.base import PathFacts
from floorline.records import CellKey, CellResult
from floorline.store import Store, quality_by_cell

GPU = lookup("l4")  # any catalogued device: quality does not read its bandwidth
TOKENS, WINDOW = 64, 32


def text_tokenizer():
    """test_generate's word tokenizer, over the 200 commonest words of the evaluation text as
    well, so that its windows differ."""
    from collections import Counter

    common = [w for w, _ in Counter(evaluation_text().split()).most_common(200)]
    return word_tokenizer(WORDS + [w for w in common if w not in WORDS])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A 2-layer Llama with seeded float32 weights, a word tokenizer and a chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("quality-checkpoint")
    tokenizer = text_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=None, eos_token_id=EOS,
                         initializer_range=0.1)
    torch.manual_seed(0)
    LlamaForCausalLM(config).float().save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def test_window_metrics_match_hand_arithmetic():
    rng = np.random.default_rng(0)
    ref, path = rng.normal(size=(5, 7)), rng.normal(size=(5, 7))
    ids = np.array([3, 1, 6, 0, 2])

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    # positions 0..3 predict tokens 1..4; the last position predicts nothing in the window
    lr, lp = log_softmax(ref[:-1]), log_softmax(path[:-1])
    nll_ref = -np.mean([lr[i, ids[i + 1]] for i in range(4)])
    nll_path = -np.mean([lp[i, ids[i + 1]] for i in range(4)])
    kl = np.mean([(np.exp(lr[i]) * (lr[i] - lp[i])).sum() for i in range(4)])
    got = score_window(torch.tensor(ref, dtype=torch.float32),
                       torch.tensor(path, dtype=torch.float32), torch.tensor(ids))
    assert got == pytest.approx((nll_ref, nll_path, kl), rel=1e-5)

    s = summarise_quality([1.0, 2.0, 3.0], [1.5, 2.0, 3.4], [0.1, 0.2, 0.3],
                          [{"first_divergence": NEW_TOKENS},
                           {"first_divergence": 3, "reference_margin": 0.1},
                           {"first_divergence": 10, "reference_margin": 4.0}])
    assert s["ppl"] == pytest.approx(math.exp(6.9 / 3))
    assert s["reference_ppl"] == pytest.approx(math.exp(2.0))
    assert s["ppl_increase"] == pytest.approx(math.exp(0.9 / 3) - 1)
    assert s["ppl_low"] < s["ppl"] < s["ppl_high"]
    assert s["kl"] == pytest.approx(0.2) and s["kl_low"] < 0.2 < s["kl_high"]
    assert (s["prompts"], s["prompts_agreeing"], s["near_tie_divergences"]) == (3, 1, 1)
    assert s["mean_first_divergence"] == pytest.approx((NEW_TOKENS + 13) / 3)


def test_a_float32_path_equal_to_the_reference_costs_nothing(checkpoint, monkeypatch):
    # hf-eager in float32 runs the reference's own forward: KL 0, the same perplexity, and
    # every greedy continuation followed to its end
    monkeypatch.setattr(REGISTRY["hf-eager"], "facts", PathFacts("hf-eager", dtype="float32"))
    result, _ = measure_quality(quality_key(str(checkpoint), "hf-eager", TOKENS, WINDOW), "cpu",
                                GPU)
    assert result.status == "valid", result.reason
    s = result.summary
    assert s["kl"] == 0 and s["ppl_increase"] == 0
    assert s["ppl"] == pytest.approx(s["reference_ppl"], rel=1e-12)
    assert s["prompts_agreeing"] == s["prompts"] == len(result.greedy) > 0
    assert len(result.details["windows"]["kl"]) == TOKENS // WINDOW


def test_the_engine_costs_a_little(checkpoint):
    result, _ = measure_quality(quality_key(str(checkpoint), "engine-fp8", TOKENS, WINDOW),
                                "cpu", GPU)
    assert result.status == "valid", result.reason
    s = result.summary
    assert s["kl"] > 0 and s["kl_low"] <= s["kl"] <= s["kl_high"]
    assert abs(s["ppl_increase"]) < 0.5
    assert all(0 <= g["first_divergence"] <= NEW_TOKENS for g in result.greedy)


@pytest.mark.parametrize("head, kv", [("bf16", "bf16"), ("fp8", "fp8")])
def test_engine_logits_at_every_position_are_its_last_position_and_step_logits(head, kv):
    spec = resolve_model("tiny-qwen2")
    engine = Engine(spec, "cpu", 32, dtype=torch.float32, head=head, kv=kv)
    tokens = torch.randint(engine.config.vocab, (12,), generator=torch.Generator().manual_seed(1))
    every = engine.decoder.prefill(tokens, chunk=5, all_logits=True)
    assert every.shape == (12, engine.config.vocab) and every.device.type == "cpu"
    for n in (1, 7, 12):  # the last position of a prefill of the first n tokens
        last = engine.decoder.prefill(tokens[:n])
        assert torch.allclose(every[n - 1], last, rtol=1e-5, atol=1e-5)
    # the decode step (the reference ops on the CPU), fed the same tokens one by one
    engine.decoder.prefill(tokens[:1])
    for i in range(1, 12):
        engine.decoder.token.fill_(tokens[i])
        engine.decoder.step()
        assert torch.allclose(every[i], engine.decoder.logits, rtol=1e-4, atol=1e-4)


def test_a_later_path_takes_the_reference_continuations_an_earlier_one_decoded(checkpoint,
                                                                              monkeypatch):
    first, decoded = measure_quality(quality_key(str(checkpoint), "hf-eager", TOKENS, WINDOW),
                                     "cpu", GPU)
    assert first.status == "valid" and len(decoded) == len(first.greedy)
    quality.reference.cache_clear()  # as in the next path's own process
    monkeypatch.setattr(Reference, "_continue_all", lambda self: pytest.fail("decoded again"))
    second, again = measure_quality(quality_key(str(checkpoint), "engine", TOKENS, WINDOW),
                                    "cpu", GPU, continuations=decoded)
    assert second.status == "valid" and again == decoded
    assert [g["reference_tokens"] for g in second.greedy] == \
        [g["reference_tokens"] for g in first.greedy]


def test_a_command_hands_the_continuations_to_its_next_path_of_the_model(monkeypatch):
    asked = []

    def child(target, args, timeout_s):
        asked.append(args["continuations"])
        key = quality_key(args["key"]["model"], args["key"]["path"])
        return {"quality": runner.QualityResult(key, GPU.name, "invalid").as_dict(),
                "continuations": [{"model": args["key"]["model"]}]}

    monkeypatch.setattr(runner, "run_in_child", child)
    monkeypatch.setattr(runner, "_continuations", {})
    monkeypatch.setattr(runner, "prepare_quality", lambda key, *a: (None, True))
    monkeypatch.setattr(runner, "resolve_model", lambda *a: None)
    for model, path in (("a", "hf-eager"), ("a", "engine"), ("b", "engine")):
        runner.run_quality_in_child(quality_key(model, path), "cpu", GPU)
    assert asked == [None, [{"model": "a"}], None]


def test_random_weights_are_not_measured(monkeypatch):
    def no_child(*args, **kwargs):
        raise AssertionError("no process is started for random weights")

    monkeypatch.setattr(runner, "run_in_child", no_child)
    result = runner.run_quality_in_child(quality_key("tiny-llama", "engine"), "cpu", GPU)
    assert (result.status, result.reason, result.summary) == ("invalid", RANDOM_WEIGHTS, None)


def test_a_measurement_whose_process_dies_stays_invalid_with_its_cause(checkpoint, tmp_path,
                                                                       monkeypatch):
    worker = tmp_path / "worker.py"
    worker.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    monkeypatch.setattr(runner, "CHILD", [sys.executable, str(worker)])
    store = Store(tmp_path / "q.db")
    sweep = Sweep(store, "cpu", GPU)
    key = quality_key(str(checkpoint), "engine", TOKENS, WINDOW)
    assert sweep.run_quality(key).status == "invalid"
    [row] = store.quality_rows()
    assert row.status == "invalid" and row.ppl is None
    assert row.reason == ("the measurement's process failed: killed by SIGKILL (perhaps out of "
                          "memory)")
    assert not store.has_valid_quality(key, GPU.name, sweep.env_key)
    assert sweep.run_quality(key) is not None  # tried again, not skipped


def test_the_quality_and_show_commands(checkpoint, tmp_path):
    db = tmp_path / "q.db"
    args = ("--tokens", TOKENS, "--window", WINDOW, "--db", db, "--device", "cpu")
    run = run_here("quality", "--models", checkpoint, "--paths", "engine", *args, check=True)
    assert "1 measured" in run.stdout and "agree" in run.stdout and "%" in run.stdout
    run_here("quality", "--models", f"{checkpoint},tiny-llama", "--paths", "engine", *args,
             check=True)
    rows = Store(db).quality_rows()
    assert [(q.model, q.status, q.reason) for q in rows] == [
        (str(checkpoint), "valid", None), ("tiny-llama", "invalid", RANDOM_WEIGHTS)]
    # the sweep's own quality, in windows of 512, does not fit this model's 256 positions
    run_here("sweep", "--models", checkpoint, "--ctx", 16, "--paths", "engine", "--steps", 3,
             "--warmup", 1, "--db", db, "--device", "cpu", "--quality-tokens", 512, check=True)
    assert Store(db).quality_rows()[-1].reason == ("not measured: windows of 512 tokens do not "
                                                   "fit below the model's 256 positions")
    # in the quality command's windows, the sweep finds its row already measured
    run = run_here("sweep", "--models", checkpoint, "--ctx", 16, "--paths", "engine", "--steps",
                   3, "--warmup", 1, "--db", db, "--device", "cpu", "--quality-tokens", TOKENS,
                   "--quality-window", WINDOW, check=True)
    assert "1 model and path pair(s): 0 measured, 1 already valid" in " ".join(run.stdout.split())
    shown = run_here("show", "--db", db, check=True)  # the valid row is the cell's quality
    assert "ppl vs fp32" in shown.stdout and f"{rows[0].ppl_increase:+.2%}" in shown.stdout
    run_here("report", "--db", db, "--out", tmp_path / "report", check=True)
    assert (tmp_path / "report" / "fig8_quality.png").is_file()
    assert "Quality against float32" in (tmp_path / "report" / "report.md").read_text()


@pytest.mark.parametrize("args, message", [
    (("--tokens", "100", "--window", "64"), "--tokens must be a whole number of windows of 64"),
    (("--window", "1"), "--window must be at least 2 tokens"),
    (("--paths", "engine+graphs"), "measure the quality of engine"),
])
def test_bad_quality_options_are_one_line(tmp_path, args, message):
    base = {"--models": "tiny-llama", "--paths": "engine"}
    base.update(dict(zip(args[::2], args[1::2])))
    run = run_here("quality", *[v for kv in base.items() for v in kv], "--db", tmp_path / "q.db")
    assert run.returncode == 2 and message in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


def test_hf_static_shares_hf_eager_quality(checkpoint, tmp_path):
    """The same model and window forward: equal logits, so a sweep measures that quality once,
    as hf-eager's, and the cells of both show it (hf-static's own row first where one exists)."""
    spec = resolve_model(str(checkpoint))
    ids = torch.arange(2, 34)
    logits = []
    for path in ("hf-eager", "hf-static"):
        session = REGISTRY[path].open(spec, "cpu", 64, 0)
        logits.append(session.window_logits(ids))
        session.close()
    assert torch.equal(*logits)
    grid = Grid((str(checkpoint),), (16,), ("hf-eager", "hf-static", "hf-static+compile"))
    assert [k.path for k in grid.quality(TOKENS, WINDOW, False)] == ["hf-eager"]
    assert [k.path for k in Grid((str(checkpoint),), (16,), ("hf-static",)).quality(
        TOKENS, WINDOW, False)] == ["hf-eager"]
    store = Store(tmp_path / "s.db")
    for path in ("hf-eager", "hf-static", "hf-static+compile", "engine"):
        store.add(CellResult(CellKey(str(checkpoint), 16, path, 4, 1), GPU.name, "valid",
                             samples_ms=[1.0] * 4), {"device": "cpu"}, "env")
    eager, _ = measure_quality(quality_key(str(checkpoint), "hf-eager", TOKENS, WINDOW), "cpu",
                               GPU)
    store.add_quality(eager, {"device": "cpu"}, "env")

    def matched():
        cells, by_cell = store.rows(), quality_by_cell(store.rows(), store.quality_rows())
        return {c.path: by_cell[c.id].path for c in cells if c.id in by_cell}
    assert matched() == {"hf-eager": "hf-eager", "hf-static": "hf-eager",
                         "hf-static+compile": "hf-eager"}
    static, _ = measure_quality(quality_key(str(checkpoint), "hf-static", TOKENS, WINDOW),
                                "cpu", GPU)
    store.add_quality(static, {"device": "cpu"}, "env")
    assert matched()["hf-static"] == "hf-static"
