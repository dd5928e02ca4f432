"""`floorline serve`: the OpenAI chat and completions protocol over one model on the engine,
one stream at a time (Starlette on uvicorn).

One request holds the engine; up to `queue` more wait for it in order, and beyond them a
request is answered 429 with Retry-After. A streamed reply goes out as server-sent events, a
piece a token; a client that goes away is noticed at the next token, which ends its request
and frees the engine. Every refusal is the protocol's error object with a 4xx status.
"""

from __future__ import annotations

import json
import math
import secrets
import threading
import time
from collections.abc import Callable

import anyio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from floorline.serve.api import Model, RequestError

MAX_STOPS = 4  # as OpenAI's API allows
JSON_NAMES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
              dict: "object"}
DONE = object()


class BadRequest(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (
            status, message, kind, param, code)
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind,
                                       "param": self.param, "code": self.code}},
                            status_code=self.status, headers=self.headers)


def field(body: dict, name: str, kinds: tuple, default=None, check: Callable | None = None,
          what: str = ""):
    """`body[name]` if it is of `kinds` (bool is not a number) and passes `check`, else a 400
    naming the field."""
    if name not in body or body[name] is None:
        return default
    value = body[name]
    numeric = any(k in (int, float) for k in kinds)
    if not isinstance(value, kinds) or (numeric and isinstance(value, bool)):
        names = " or ".join(JSON_NAMES[k] for k in kinds)
        raise BadRequest(400, f"'{name}' must be {names}, not {json.dumps(value)[:40]}",
                         param=name)
    if isinstance(value, float) and not math.isfinite(value):
        raise BadRequest(400, f"'{name}' must be a finite number", param=name)
    if check is not None and not check(value):
        raise BadRequest(400, f"'{name}' {what}, got {json.dumps(value)[:40]}", param=name)
    return value


def options(body: dict, context: int) -> dict:
    """The sampling and stopping options of a request, checked."""
    limit = field(body, "max_completion_tokens", (int,)) or field(body, "max_tokens", (int,))
    if limit is not None and not 1 <= limit <= context:
        raise BadRequest(400, f"max_tokens must be between 1 and {context}, got {limit}",
                         param="max_tokens")
    stop = field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(400, f"'stop' must be a string or up to {MAX_STOPS} non-empty strings",
                         param="stop")
    if field(body, "n", (int,), 1) != 1:
        raise BadRequest(400, "'n' must be 1: one stream at a time", param="n")
    return {"max_tokens": limit,
            "temperature": field(body, "temperature", (int, float), 1.0,
                                 lambda v: 0 <= v <= 2, "must be between 0 and 2"),
            "top_p": field(body, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1,
                           "must be above 0 and at most 1"),
            "seed": field(body, "seed", (int,), 0, lambda v: 0 <= v < 2**63,
                          "must be a non-negative integer"),
            "stop": stop}


def messages_of(body: dict) -> list[dict]:
    messages = field(body, "messages", (list,))
    if not messages:
        raise BadRequest(400, "'messages' must be a non-empty array", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(400, f"messages[{i}] must be an object with a 'role'",
                             param=f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):  # content parts: the text ones, joined
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise BadRequest(400, f"messages[{i}].content: only text parts are served",
                                 param=f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(400, f"messages[{i}].content must be a string",
                             param=f"messages[{i}].content")
        out.append({"role": m["role"], "content": content})
    return out


def prompt_of(body: dict) -> str:
    prompt = field(body, "prompt", (str, list))
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise BadRequest(400, "'prompt' must be a string (or an array of one)", param="prompt")
        prompt = prompt[0]
    if not prompt:
        raise BadRequest(400, "'prompt' must be a non-empty string", param="prompt")
    return prompt


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("floorline_requests", "Requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.tokens = Counter("floorline_tokens", "Tokens, prompt and completion", ["kind"],
                              registry=r)
        self.reused = Counter("floorline_prompt_tokens_reused",
                              "Prompt tokens found in the cache from the turn before", registry=r)
        self.ttft = Histogram("floorline_time_to_first_token_seconds", "Time to first token",
                              registry=r, buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5,
                                                   10, 30))
        self.per_token = Histogram("floorline_time_per_output_token_seconds",
                                   "Decode time per token after the first", registry=r,
                                   buckets=(.001, .002, .003, .005, .0075, .01, .02, .05, .1,
                                            .25, .5, 1))
        self.floor = Gauge("floorline_fraction_of_floor",
                           "The memory floor over ms/token, of the last request that decoded",
                           registry=r)
        self.waiting = Gauge("floorline_requests_in_flight",
                             "Requests holding or waiting for the engine", registry=r)

    def record(self, report) -> None:
        self.tokens.labels("prompt").inc(report.prompt_tokens)
        self.tokens.labels("completion").inc(report.completion_tokens)
        self.reused.inc(report.reused_tokens)
        self.ttft.observe(report.ttft_ms / 1e3)
        if report.ms_per_token is not None:
            self.per_token.observe(report.ms_per_token / 1e3)
        if report.fraction_of_floor is not None:
            self.floor.set(report.fraction_of_floor)


def create_app(model: Model, *, name: str | None = None, api_key: str | None = None,
               queue: int = 4) -> Starlette:
    """The server's application over `model`, served as `name`; requests need `api_key` as a
    bearer token where one is given; `queue` requests may wait behind the one running."""
    served = name or model.name
    metrics = Metrics()
    state = {"in_flight": 0}

    def admit() -> None:
        if state["in_flight"] > queue:
            raise BadRequest(429, f"the engine serves one stream at a time and {queue} "
                             "request(s) already wait: try again shortly", kind="rate_limit_error",
                             headers={"Retry-After": "1"})
        state["in_flight"] += 1
        metrics.waiting.set(state["in_flight"])

    def leave() -> None:
        state["in_flight"] -= 1
        metrics.waiting.set(state["in_flight"])

    def authorise(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise BadRequest(401, "a valid API key is needed (Authorization: Bearer KEY)",
                             kind="authentication_error", code="invalid_api_key")

    async def body_of(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError):
            raise BadRequest(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise BadRequest(400, "the request body must be a JSON object")
        asked = field(body, "model", (str,))
        if asked is not None and asked != served:
            raise BadRequest(404, f"the model '{asked}' is not served here; this server serves "
                             f"'{served}'", param="model", code="model_not_found")
        return body

    def endpoint(kind: str):
        chat = kind == "chat"

        async def handle(request: Request) -> Response:
            path = request.url.path
            try:
                authorise(request)
                body = await body_of(request)
                prompt = messages_of(body) if chat else prompt_of(body)
                opts = options(body, model.context)
                stream = field(body, "stream", (bool,), False)
                usage_too = bool((field(body, "stream_options", (dict,), {}) or {})
                                 .get("include_usage"))
                if opts["max_tokens"] is None:  # all the room the prompt leaves, as OpenAI does
                    opts["max_tokens"] = max(1, model.context - len(model.encode(prompt)))
                cancel = threading.Event()  # read by the engine's thread
                pieces = model.stream(prompt, cancelled=cancel.is_set, **opts)
                admit()
            except RequestError as e:
                metrics.requests.labels(path, "400").inc()
                return BadRequest(400, str(e)).response()
            except BadRequest as e:
                metrics.requests.labels(path, str(e.status)).inc()
                return e.response()
            ident = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
            created = int(time.time())
            if not stream:
                try:
                    text = "".join(await anyio.to_thread.run_sync(list, pieces))
                finally:
                    leave()
                report = model.last_report
                metrics.record(report)
                metrics.requests.labels(path, "200").inc()
                return JSONResponse(reply(chat, ident, created, served, text, report))
            return StreamingResponse(events(chat, ident, created, pieces, cancel, usage_too, path),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

        return handle

    async def events(chat, ident, created, pieces, cancel, usage_too, path):
        """The reply as server-sent events; the engine is freed when the client goes away."""
        head = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": served}

        def chunk(piece, finish=None, first=False):
            if chat:
                delta = {"role": "assistant", "content": piece} if first else {"content": piece}
                choice = {"index": 0, "delta": delta if piece or first else {},
                          "finish_reason": finish}
            else:
                choice = {"index": 0, "text": piece, "finish_reason": finish, "logprobs": None}
            return f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"

        finished = False
        try:
            first = True
            while True:
                piece = await anyio.to_thread.run_sync(next, pieces, DONE)
                if piece is DONE:
                    break
                yield chunk(piece, first=first)
                first = False
            report = model.last_report
            if first:
                yield chunk("", first=True)
            yield chunk("", finish=report.finish_reason)
            if usage_too:
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage(report)})}\n\n"
            yield "data: [DONE]\n\n"
            metrics.record(report)
            finished = True
        finally:
            cancel.set()  # a client gone: the engine stops at its next token
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(pieces.close)
            leave()
            metrics.requests.labels(path, "200" if finished else "disconnected").inc()

    async def models(request: Request) -> Response:
        try:
            authorise(request)
        except BadRequest as e:
            return e.response()
        return JSONResponse({"object": "list", "data": [
            {"id": served, "object": "model", "created": 0, "owned_by": "floorline"}]})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": served})

    async def metrics_text(request: Request) -> Response:
        return Response(generate_latest(metrics.registry),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def not_found(request: Request, exc) -> Response:
        status = getattr(exc, "status_code", 404)
        return BadRequest(status, f"no route {request.method} {request.url.path}",
                          code="not_found" if status == 404 else None).response()

    return Starlette(routes=[
        Route("/v1/chat/completions", endpoint("chat"), methods=["POST"]),
        Route("/v1/completions", endpoint("completion"), methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_text, methods=["GET"]),
    ], exception_handlers={404: not_found, 405: not_found})


def usage(report) -> dict:
    return {"prompt_tokens": report.prompt_tokens, "completion_tokens": report.completion_tokens,
            "total_tokens": report.prompt_tokens + report.completion_tokens}


def reply(chat: bool, ident: str, created: int, served: str, text: str, report) -> dict:
    """A whole (not streamed) reply in the protocol's shape, with floorline's own report."""
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": report.finish_reason, "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": report.finish_reason,
                  "logprobs": None}
    return {"id": ident, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": served, "choices": [choice], "usage": usage(report),
            "floorline": report.as_dict()}
