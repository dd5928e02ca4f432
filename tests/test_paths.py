import pytest
import torch

from conftest import gpu_only
from floorline.errors import FloorlineError
from floorline.models import build_model, resolve_model
from floorline.paths import REGISTRY, PathUnavailable, open_session, parse_path, unavailable
from floorline.paths.base import GRAPH_WARMUP_STEPS, rewinding


def test_path_names_are_canonical():
    assert parse_path("hf-static+graphs+compile").name == "hf-static+compile+graphs"
    assert parse_path("hf-eager").name == "hf-eager"


@pytest.mark.parametrize("text, message", [
    ("vllm", "unknown path 'vllm'"),
    ("hf-static+turbo", r"unknown option '\+turbo'"),
    ("hf-static+graphs+graphs", "repeats an option"),
])
def test_bad_path_names(text, message):
    with pytest.raises(FloorlineError, match=message):
        parse_path(text)


def test_graphs_need_cuda():
    assert unavailable(parse_path("hf-static+graphs"), "cpu") == "+graphs needs a CUDA device"
    assert unavailable(parse_path("hf-static"), "cpu") is None


def decode(path: str, model: str, ctx: int, steps: int) -> list[int]:
    """Greedy tokens a path's session produces after a `ctx`-token prefill."""
    with torch.no_grad():
        session = open_session(parse_path(path), resolve_model(model), "cpu", ctx + steps, seed=5)
        session.prefill(ctx)
        tokens = [session.token.item()]
        for _ in range(steps):
            session.step()
            tokens.append(session.token.item())
        session.close()
    return tokens


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("path", ["hf-eager", "hf-static"])
def test_a_step_decodes_what_generate_decodes(model, path):
    # Reference: transformers' own greedy generate on the same weights and prompt.
    ctx, steps = 24, 6
    hf = build_model(resolve_model(model), "cpu", torch.bfloat16, seed=5)
    prompt = torch.randint(hf.config.vocab_size, (1, ctx),
                           generator=torch.Generator().manual_seed(5))
    expected = hf.generate(prompt, max_new_tokens=steps + 1, do_sample=False,
                           min_new_tokens=steps + 1)[0, ctx:].tolist()
    assert decode(path, model, ctx, steps) == expected


def test_compiled_static_step_decodes_the_same():
    compiled = decode("hf-static+compile", "tiny-llama", 16, 4)
    assert compiled == decode("hf-static", "tiny-llama", 16, 4)


@pytest.mark.parametrize("path, device", [
    ("hf-eager", "cpu"), ("hf-static", "cpu"), ("hf-static+compile", "cpu"), ("engine", "cpu"),
    pytest.param("hf-static+graphs", "cuda",
                 marks=gpu_only("a CUDA graph reads what the rewind moved")),
    pytest.param("engine", "cuda", marks=gpu_only("the engine's graph reads its position"))])
def test_a_rewound_session_decodes_its_positions_again(path, device):
    # A session with room for 5 positions past its prompt (and a graph's warm-up) runs 5 steps,
    # rewinds 5 and, fed the same token again, must decode the same 5 tokens at the same
    # positions: the cache kept the prompt, and the second lap fits in the room of the first.
    ctx, window = 16, 5
    spec, model = parse_path(path), resolve_model("tiny-llama")
    warmup = GRAPH_WARMUP_STEPS if spec.graphs else 0
    assert REGISTRY[spec.base].rewinds(model)
    with torch.no_grad():
        session = open_session(spec, model, device, ctx + warmup + window, seed=5)
        session.prefill(ctx)
        inner = session.inner if spec.graphs else session
        # the step's input token and position, where the session keeps them
        token, position = ((inner.engine.token, inner.engine.position) if spec.base == "engine"
                           else (inner.token, inner.position))
        first = token.clone()
        laps = []
        for _ in range(2):
            token.copy_(first)
            step = rewinding(session, window)
            tokens = []
            for _ in range(window):
                step()
                tokens.append(token.item())
            laps.append(tokens)
        assert position.item() == ctx + warmup
        session.close()
    assert laps[0] == laps[1]
    if path.startswith("hf") and device == "cpu":  # the steps of a session that never rewound
        assert laps[0] == decode(path, "tiny-llama", ctx, window)[1:]


def test_a_sliding_window_session_of_transformers_does_not_rewind():
    # past its window transformers' sliding-window layer has dropped the tokens a rewind would
    # go back to; the engine's cache keeps every position
    assert not REGISTRY["hf-static"].rewinds(resolve_model("tiny-mistral-swa"))
    assert REGISTRY["engine"].rewinds(resolve_model("tiny-mistral-swa"))


@pytest.mark.parametrize("path, model, message", [
    ("hf-eager+compile", "tiny-llama", "DynamicCache grows"),
    ("hf-static+compile", "tiny-mistral-swa", "sliding-window"),
])
def test_options_refused_where_the_step_is_not_static(path, model, message):
    with pytest.raises(PathUnavailable, match=message):
        open_session(parse_path(path), resolve_model(model), "cpu", 64, seed=0)
