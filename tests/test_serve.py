"""The engine as a service, used as its users use it: the Python API against `floorline
generate`, and the OpenAI-compatible server on a loopback port through the official `openai`
client and raw HTTP, on the trained model of the package index (on the CPU)."""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
import uvicorn

from floorline.engine.generate import generate
from floorline.serve import Model, RequestError
from floorline.serve.server import create_app

QUESTION = "What is the capital of France?"
CHAT = [{"role": "user", "content": QUESTION}]
CONTEXT = 512


@pytest.fixture(scope="module")
def model(smollm2):
    loaded = Model(str(smollm2.weights_dir), device="cpu", context=CONTEXT)
    yield loaded
    loaded.close()


class Server:
    """The server in a thread of this process, on a free loopback port."""

    def __init__(self, app):
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        give_up = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < give_up, "the server did not start"
            time.sleep(0.05)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"),
                             max_retries=0, timeout=120, **kw)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def server(model):
    """Over the module's model, each request prefilled afresh: what the server answers is then
    what the API answers for the same seed, whatever ran before."""
    model.reuse_prefix = False
    s = Server(create_app(model, name="smollm2", queue=1))
    yield s
    s.stop()
    model.reuse_prefix = True


def test_the_api_answers_as_generate_does(model, smollm2):
    once = generate(smollm2.weights_dir, QUESTION, max_new_tokens=24, dtype="bfloat16")
    done = model.complete(CHAT, max_tokens=24, temperature=0)
    assert done.token_ids == once.ids and done.text == once.text
    r = done.report
    assert r.prompt_tokens == len(once.prompt_ids) and r.completion_tokens == len(once.ids)
    assert r.finish_reason == ("stop" if once.stopped_at_eos else "length")
    assert r.ttft_ms >= r.prefill_ms > 0 and r.ms_per_token > 0 and 0 < r.fraction_of_floor < 1


def test_a_conversations_next_turn_prefills_only_what_is_new(model):
    first = model.complete(CHAT, max_tokens=16, temperature=0)
    turn = CHAT + [{"role": "assistant", "content": first.text},
                   {"role": "user", "content": "And of Italy?"}]
    again = model.complete(turn, max_tokens=16, temperature=0)
    assert again.report.reused_tokens > first.report.prompt_tokens // 2
    # the kept keys and values are the ones a whole prefill writes: the logits after the turn
    # differ only in rounding from those of the turn prefilled afresh
    ids = model.encode(turn)
    kept = model.engine.prefill(torch.tensor(ids), keep=again.report.reused_tokens).clone()
    fresh = model.engine.prefill(torch.tensor(ids)).clone()
    assert (kept - fresh).abs().max() < 0.5 and fresh.abs().max() > 5
    model.reuse_prefix = False
    try:
        assert model.complete(turn, max_tokens=4, temperature=0).report.reused_tokens == 0
    finally:
        model.reuse_prefix = True


def test_stop_strings_cut_the_reply_and_sampling_follows_the_seed(model):
    whole = model.complete("The capital of France is", max_tokens=24, temperature=0)
    word = whole.text.split()[2]
    cut = model.complete("The capital of France is", max_tokens=24, temperature=0, stop=[word])
    assert cut.text == whole.text[:whole.text.index(word)] and cut.report.finish_reason == "stop"
    model.reuse_prefix = False  # each request from a fresh cache: the seed alone decides
    try:
        a, b, c = (model.complete(CHAT, max_tokens=12, temperature=1.0, seed=s).token_ids
                   for s in (7, 7, 8))
    finally:
        model.reuse_prefix = True
    assert a == b and a != c


def test_the_api_refuses_requests_it_cannot_serve(model):
    with pytest.raises(RequestError, match="above this server's context of 512"):
        model.stream("word " * 600, max_tokens=8)
    with pytest.raises(RequestError, match="max_tokens must be at least 1"):
        model.stream("hi", max_tokens=0)
    with pytest.raises(RequestError, match="temperature"):
        model.stream("hi", temperature=-1)


def test_the_openai_client_streamed_and_not_gets_the_apis_answer(server, model):
    expected = model.complete(CHAT, max_tokens=20, temperature=0.8, seed=3)
    client = server.client()
    done = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=20,
                                          temperature=0.8, seed=3)
    assert done.choices[0].message.content == expected.text
    assert done.choices[0].finish_reason == expected.report.finish_reason
    assert done.usage.prompt_tokens == expected.report.prompt_tokens
    assert done.usage.completion_tokens == len(expected.token_ids)
    chunks = list(client.chat.completions.create(
        model="smollm2", messages=CHAT, max_tokens=20, temperature=0.8, seed=3, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length" or (
        expected.report.finish_reason == "stop")
    plain = client.completions.create(model="smollm2", prompt="The capital of France is",
                                      max_tokens=12, temperature=0)
    assert plain.choices[0].text == model.complete("The capital of France is", max_tokens=12,
                                                   temperature=0).text
    assert [m.id for m in client.models.list().data] == ["smollm2"]


def test_concurrent_clients_get_whole_answers_or_a_clean_429(server, model):
    expected = model.complete(CHAT, max_tokens=24, temperature=0).text

    def ask(_):
        with httpx.Client(timeout=120) as http:
            r = http.post(server.url + "/v1/chat/completions",
                          json={"model": "smollm2", "messages": CHAT, "max_tokens": 24,
                                "temperature": 0, "stream": True})
            if r.status_code == 429:
                assert r.headers["retry-after"] == "1"
                assert r.json()["error"]["type"] == "rate_limit_error"
                return None
            assert r.status_code == 200
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            return "".join(json.loads(e)["choices"][0]["delta"].get("content", "")
                           for e in events[:-1] if json.loads(e)["choices"])

    with ThreadPoolExecutor(5) as pool:
        answers = list(pool.map(ask, range(5)))
    served = [a for a in answers if a is not None]
    assert served and all(a == expected for a in served)  # none garbled, none lost
    assert len(served) >= 2  # one running and one waiting (queue=1) are always admitted


def test_a_client_gone_mid_stream_frees_the_engine(server, model):
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", server.url + "/v1/completions",
                         json={"model": "smollm2", "prompt": "Once upon a time",
                               "max_tokens": 400, "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # the reply has begun; then the client goes
        started = time.monotonic()
        r = http.post(server.url + "/v1/completions",
                      json={"model": "smollm2", "prompt": "Hi", "max_tokens": 4,
                            "temperature": 0})
        assert r.status_code == 200
        # the 400-token reply was not finished first (a step takes tens of ms here)
        assert time.monotonic() - started < 10
        metrics = http.get(server.url + "/metrics").text
    assert 'floorline_requests_total{endpoint="/v1/completions",status="disconnected"}' in metrics
    assert "floorline_fraction_of_floor" in metrics
    assert "floorline_time_to_first_token_seconds_bucket" in metrics


@pytest.mark.parametrize("body, status, says", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "must be a JSON object"),
    ({"model": "gpt-4", "messages": CHAT}, 404, "'gpt-4' is not served here"),
    ({"model": "smollm2", "messages": CHAT, "temperature": "hot"}, 400, "'temperature' must be"),
    ({"model": "smollm2", "messages": CHAT, "temperature": 3}, 400, "between 0 and 2"),
    ({"model": "smollm2", "messages": CHAT, "max_tokens": 0}, 400, "max_tokens must be"),
    ({"model": "smollm2", "messages": CHAT, "max_tokens": True}, 400, "must be integer"),
    ({"model": "smollm2", "messages": []}, 400, "'messages' must be a non-empty array"),
    ({"model": "smollm2", "messages": [{"role": "user", "content": 5}]}, 400, "content"),
    ({"model": "smollm2", "messages": CHAT, "n": 2}, 400, "'n' must be 1"),
    ({"model": "smollm2", "messages": CHAT, "stop": ["a"] * 5}, 400, "'stop'"),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "word " * 600}]}, 400,
     "above this server's context"),
])
def test_bad_requests_get_the_protocols_error_and_the_server_lives(server, body, status, says):
    with httpx.Client(timeout=60) as http:
        r = http.post(server.url + "/v1/chat/completions",
                      **({"content": body} if isinstance(body, bytes) else {"json": body}))
        assert r.status_code == status
        error = r.json()["error"]
        assert says in error["message"] and error["type"]
        assert http.get(server.url + "/health").json()["status"] == "ok"


def test_an_api_key_is_required_where_one_is_set(model):
    s = Server(create_app(model, name="smollm2", api_key="sesame"))
    try:
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").models.list()
        assert [m.id for m in s.client(api_key="sesame").models.list().data] == ["smollm2"]
        with httpx.Client() as http:
            assert http.get(s.url + "/nowhere").json()["error"]["code"] == "not_found"
    finally:
        s.stop()


def test_serve_refuses_to_listen_beyond_loopback_without_a_key(cli):
    done = cli("serve", "--model", "smollm2-135m", "--host", "0.0.0.0")
    assert done.returncode == 2 and "give --api-key" in done.stderr
    assert "Traceback" not in done.stderr
