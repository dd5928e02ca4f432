"""Speculative decoding: the drafters, the verification rules (greedy exact, sampling by the
rejection rule with its distribution checked statistically) and generation with speculation
on the trained model against generation without it."""

import json

import pytest
import torch
from scipy.stats import chisquare

from conftest import run_here
from floorline.engine.speculate import (
    AUTO,
    DraftLength,
    PromptLookup,
    verify_greedy,
    verify_sampled,
)
from floorline.errors import FloorlineError


def test_prompt_lookup_continues_the_latest_occurrence_of_the_longest_ngram():
    lookup = PromptLookup(max_ngram=3)
    lookup.start_prompt([])
    context = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # "1 2 3" occurred at the start (then 4 5 9); "2 3" later (then 7 8): the 3-gram wins
    assert lookup.draft(context, 4) == [4, 5, 9, 2]
    context += [4, 5, 6]
    # "4 5 6" is new; "5 6" too; "6" too: nothing to draft
    assert lookup.draft(context, 4) == []
    context += [1, 2, 3]  # "1 2 3" now last seen before 4 5 6
    assert lookup.draft(context, 2) == [4, 5]
    assert lookup.draft([7], 3) == []


def test_greedy_verification_keeps_drafts_up_to_the_first_disagreement():
    # predicted[j] is the target's token after input j (input 0: the current token)
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all kept, then the bonus
    assert verify_greedy([5, 6, 9, 8], [5, 6, 7]) == [5, 6, 9]
    assert verify_greedy([4, 6, 7, 8], [5, 6, 7]) == [4]
    assert verify_greedy([4], []) == [4]


def test_sampled_verification_keeps_the_target_distribution():
    # two positions over a vocabulary of 5: p0 after the current token, p1 after the draft d1
    p0 = torch.tensor([0.1, 0.4, 0.2, 0.25, 0.05])
    p1 = torch.tensor([0.3, 0.1, 0.1, 0.2, 0.3])
    probs = torch.stack([p0, p1])
    d1 = 1
    g = torch.Generator().manual_seed(0)
    trials = 20000
    first = torch.zeros(5)
    second = torch.zeros(5)  # the second token where the first was the draft
    for _ in range(trials):
        out = verify_sampled(probs, [d1], g)
        first[out[0]] += 1
        if len(out) == 2:
            assert out[0] == d1
            second[out[1]] += 1
    # each emitted token is drawn as the target would draw it
    assert chisquare(first, p0 * trials).pvalue > 1e-3
    assert chisquare(second, p1 * second.sum()).pvalue > 1e-3
    assert abs(second.sum() / trials - p0[d1]) < 0.02  # the draft kept with probability p0(d1)


def test_a_draft_the_target_cannot_produce_is_always_rejected():
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.5, 0.0]])
    g = torch.Generator().manual_seed(1)
    assert all(verify_sampled(probs, [0], g) == [1] for _ in range(50))


def test_the_draft_length_adapts_to_the_kept_runs():
    assert DraftLength(3).next() == 3
    auto = DraftLength(AUTO)
    assert auto.next() == 4
    for _ in range(8):
        auto.kept(0)
    assert auto.next() == 1
    for _ in range(16):
        auto.kept(7)
    assert auto.next() == 15
    for bad in (0, 16, "many"):
        with pytest.raises(FloorlineError, match="draft tokens"):
            DraftLength(bad)


def test_speculation_changes_no_greedy_token_of_the_trained_model(smollm2):
    from floorline.engine.generate import generate
    from floorline.measure.texts import PROMPTS

    model = smollm2.weights_dir
    # two prompts whose lookups keep some drafts and reject others; test_speculation_store
    # checks the replies of its workloads' prompts, with and without prompt lookup, too
    for prompt in PROMPTS[:2]:
        options = dict(max_new_tokens=24, dtype="float32", chat=prompt.chat)
        plain = generate(model, prompt.text, **options)
        lookup = generate(model, prompt.text, draft="lookup", **options)
        assert lookup.ids == plain.ids, prompt.text
        s = lookup.speculation
        assert s.tokens == len(plain.ids) - 1 and s.accepted <= s.drafted
        # the model as its own draft: every draft is the target's token, if the draft engine
        # is kept in step with what the target accepts
        itself = generate(model, prompt.text, draft=str(model), draft_tokens=5, **options)
        assert itself.ids == plain.ids and itself.speculation.acceptance > 0.9


def test_sampling_with_speculation_runs_and_is_repeatable(smollm2):
    from floorline.engine.generate import generate

    options = dict(max_new_tokens=16, dtype="float32", temperature=0.8, top_p=0.9, seed=3,
                   draft="lookup", draft_tokens=4)
    a = generate(smollm2.weights_dir, "List the days of the week.", **options)
    b = generate(smollm2.weights_dir, "List the days of the week.", **options)
    assert a.ids == b.ids and a.speculation.verify_steps > 0


def test_a_draft_model_with_another_tokenizer_is_refused(smollm2, tmp_path):
    from floorline.engine.generate import generate

    # the model's files linked, not copied (600 MB), but for a tokenizer of its own
    other = tmp_path / "other"
    other.mkdir()
    for f in smollm2.weights_dir.iterdir():
        if f.name != "tokenizer.json":
            (other / f.name).symlink_to(f)
    data = json.loads((smollm2.weights_dir / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    vocab["Hello"], vocab["world"] = vocab["world"], vocab["Hello"]  # two ids swapped
    (other / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(FloorlineError, match="its tokenizer is not the model's"):
        generate(smollm2.weights_dir, "Hi", max_new_tokens=4, draft=str(other))


def test_the_server_model_speculates_with_the_same_reply(smollm2):
    from floorline.serve.api import Model

    messages = [{"role": "user", "content": "Repeat exactly: the red cube is on the left."}]
    plain = Model(str(smollm2.weights_dir), dtype="float32").complete(messages, max_tokens=20)
    model = Model(str(smollm2.weights_dir), dtype="float32", draft="lookup", draft_tokens=6)
    spec = model.complete(messages, max_tokens=20)
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    s = spec.report.speculation
    assert s["tokens"] == len(spec.token_ids) - 1 and s["verify_steps"] >= 1
    assert plain.report.speculation is None
    # the next turn reuses the cache after a speculative reply
    again = model.complete(messages + [{"role": "assistant", "content": spec.text},
                                       {"role": "user", "content": "Again."}], max_tokens=8)
    assert again.report.reused_tokens > 0


def test_a_bad_draft_length_is_refused_before_the_model_loads(tmp_path):
    # a directory with no checkpoint at all: the option is refused before it is looked at
    proc = run_here("generate", "--model", tmp_path, "--prompt", "hi", "--draft", "lookup",
                    "--draft-tokens", "16", "--device", "cpu")
    assert proc.returncode == 2 and "must be 1 to 15 or 'auto', not 16" in proc.stderr
