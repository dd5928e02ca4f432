"""floorline's engine kept open for one stream: a trained model loaded once, then completions
of prompts or chats, one at a time, each with its own sampling, stops and a report of its
speed against the memory floor.

    from floorline.serve import Model
    model = Model("smollm2-135m")
    for text in model.stream([{"role": "user", "content": "Hello"}], max_tokens=32):
        print(text, end="")
    print(model.last_report)

A conversation's turns share their beginning: the cache keeps the tokens of the last request
(its prompt and reply), and a request whose prompt starts with them prefills only what is new
(`reuse_prefix`). The new tokens then go through the model in a smaller batch than they would
alone, whose rounding can differ in the last bits of the logits: where two tokens are nearly
tied, greedy or seeded sampling can choose differently than on a fresh cache. A seed reproduces
an answer from the same cache state; `reuse_prefix=False` makes every request start afresh.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch

from floorline.engine.generate import (
    DTYPES,
    TextStream,
    check_tokenizer,
    draft_engine,
    eos_ids,
    load_tokenizer,
)
from floorline.engine.kvcache import check_format
from floorline.engine.model import VERIFY_MAX
from floorline.engine.runtime import Engine
from floorline.engine.sampling import Sampler
from floorline.engine.speculate import (
    AUTO,
    Speculator,
    check_draft_tokens,
    common_prefix,
    drafter_for,
)
from floorline.errors import FloorlineError, one_line
from floorline.hardware import detect
from floorline.models import resolve_model
from floorline.models.zoo import shipped_name
from floorline.traffic import engine_kv_format, engine_weight_format, floor

DEFAULT_CONTEXT = 4096  # positions kept where the model allows more and --context is not given


class RequestError(FloorlineError):
    """A request that cannot be served as asked (too long, out of range): the caller's fault,
    the model stays loaded."""


@dataclass
class Report:
    """What one request took."""
    prompt_tokens: int
    reused_tokens: int  # of the prompt, found in the cache from the turn before
    completion_tokens: int
    finish_reason: str  # "stop" (end of sequence, a stop string or token) or "length"
    prefill_ms: float  # the new prompt tokens through the model
    ttft_ms: float  # from the request to its first token
    decode_ms: float  # the steps after the first token, each read back
    ms_per_token: float | None
    fraction_of_floor: float | None  # the floor at the final context over ms/token
    speculation: dict | None = None  # with a drafter: what it and the verify steps did

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    report: Report


class Model:
    """A trained model on the engine, loaded once (`model`: a fetched name or a checkpoint
    directory; the formats as `floorline generate` takes them). `context`: the positions kept,
    prompt and reply together (default the model's limit, at most DEFAULT_CONTEXT). `draft`
    ('lookup' or a draft model's directory) and `draft_tokens` turn on speculative decoding
    for every request, as `floorline generate` has them. One request at a time: a second
    caller waits for the first (a lock)."""

    def __init__(self, model: str, *, device: str | None = None, dtype: str = "bfloat16",
                 weights: str | None = None, head: str = "bf16", kv: str = "bf16",
                 group_size: int | None = None, context: int | None = None,
                 reuse_prefix: bool = True, draft: str | None = None,
                 draft_tokens: int | str = AUTO):
        if dtype not in DTYPES:
            raise FloorlineError(f"dtype must be one of {', '.join(DTYPES)}, got '{dtype}'")
        check_format(kv)
        self.spec = resolve_model(model)
        if not self.spec.has_real_weights:
            what = ("is a shipped config without weights" if shipped_name(model)
                    else "holds no .safetensors weights")
            raise FloorlineError(f"{model} {what}: serving needs a trained model "
                                 "(`floorline models fetch`, or a checkpoint directory)")
        self.name = model
        limit = self.spec.max_context
        self.context = context or min(limit or DEFAULT_CONTEXT, DEFAULT_CONTEXT)
        if self.context < 2 or (limit is not None and self.context > limit):
            raise FloorlineError(f"context must be between 2 and the model's {limit} positions, "
                                 f"got {self.context}")
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.cuda = torch.device(self.device).type == "cuda"
        self.tokenizer = load_tokenizer(self.spec.weights_dir)
        check_tokenizer(self.spec.weights_dir, self.tokenizer,
                        self.spec.config.get_text_config().vocab_size)
        self.eos = eos_ids(self.spec.weights_dir, self.spec.config, self.tokenizer)
        if self.cuda and torch.device(self.device).index is not None:
            torch.cuda.set_device(self.device)
        # one position more than a request may use: a prefill must leave room for a step (and
        # with speculation, room for a verify step's drafts)
        capacity = self.context + 1 + (VERIFY_MAX if draft is not None else 0)
        if limit is not None:
            capacity = min(capacity, limit)
        self.engine = Engine(self.spec, self.device, capacity, dtype=DTYPES[dtype][0],
                             weights=weights, head=head, kv=kv, group_size=group_size)
        self.draft_tokens = check_draft_tokens(draft_tokens)  # now, not at the first request
        self.drafter = None if draft is None else drafter_for(
            draft, lambda path: draft_engine(path, self.tokenizer, self.device, capacity,
                                             DTYPES[dtype][0]))
        e = self.engine
        self.weight_format = engine_weight_format(e.weights, e.head, DTYPES[dtype][1],
                                                  e.group_size)
        self.kv_format = engine_kv_format(kv, DTYPES[dtype][1])
        self.gpu = detect(self.device)
        self.reuse_prefix = reuse_prefix
        self.cached: list[int] = []  # the tokens whose keys and values the cache holds
        self.lock = threading.Lock()
        self.last_report: Report | None = None
        self.last_token_ids: list[int] = []  # the last request's new tokens
        if self.cuda:  # the greedy step (and verify steps) captured now: no request pays for it
            self.engine.prefill(torch.tensor([0, 0]))
            self.engine.capture()
            if self.drafter is not None:
                self.engine.capture_verify()

    def encode(self, prompt: str | list[dict]) -> list[int]:
        """A chat (a list of {"role", "content"} messages) through the model's chat template,
        the assistant's turn opened; a string as it is."""
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        if not self.tokenizer.chat_template:
            raise RequestError(f"{self.name} has no chat template: send a prompt, not messages")
        try:
            encoded = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True,
                                                         return_dict=True)
        except Exception as e:  # jinja2's errors, the template's own raises
            raise RequestError(f"the chat template cannot be applied to these messages "
                               f"({type(e).__name__}: {one_line(e)})") from None
        return list(encoded["input_ids"])

    def check(self, prompt_ids: list[int], max_tokens: int) -> None:
        if not prompt_ids:
            raise RequestError("the prompt encodes to no tokens")
        if max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {max_tokens}")
        if len(prompt_ids) + max_tokens > self.context:
            raise RequestError(f"{len(prompt_ids)} prompt tokens + {max_tokens} new tokens = "
                               f"{len(prompt_ids) + max_tokens}, above this server's context of "
                               f"{self.context} tokens")

    def stream(self, prompt: str | list[dict], *, max_tokens: int = 128,
               stop: list[str] | None = None, stop_token_ids: list[int] | None = None,
               temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
               cancelled: Callable[[], bool] | None = None) -> Iterator[str]:
        """The reply's text, piece by piece as tokens come; ends at an end-of-sequence token, a
        stop token, a stop string (left out of the text), `max_tokens`, or when `cancelled()`
        turns true (checked at each token). `last_report` then holds the request's report. The
        request is checked (RequestError) before this returns; the model is taken, waiting for
        any request before it, when the first piece is asked for."""
        started = time.perf_counter()
        try:
            sampler = Sampler(temperature, top_p)
        except ValueError as e:
            raise RequestError(str(e)) from None
        prompt_ids = self.encode(prompt)
        self.check(prompt_ids, max_tokens)
        return self._locked(prompt_ids, max_tokens, list(stop or []),
                            self.eos | set(stop_token_ids or []), sampler, seed,
                            cancelled or (lambda: False), started)

    def _locked(self, *args) -> Iterator[str]:
        with self.lock:
            yield from self._run(*args)

    def complete(self, prompt: str | list[dict], **options) -> Completion:
        """The whole reply (stream()'s options)."""
        text = "".join(self.stream(prompt, **options))
        return Completion(text, self.last_token_ids, self.last_report)

    def _run(self, prompt_ids, max_tokens, stops, stop_ids, sampler, seed, cancelled, started):
        e = self.engine
        # At least the last prompt token goes through again: its logits pick the first token.
        # (LongRoPE turns every position by the prompt's length: nothing is kept there)
        keep = 0 if not self.reuse_prefix or e.config.long_rope_from is not None else min(
            common_prefix(self.cached, prompt_ids), len(prompt_ids) - 1)
        e.use_sampler(sampler)
        torch.manual_seed(seed)
        self.cached = []  # until this request's tokens are in
        t0 = time.perf_counter()
        e.prefill(torch.tensor(prompt_ids), keep=keep)
        ids = [e.token.item()]
        prefill_ms = (time.perf_counter() - t0) * 1e3
        ttft_ms = (time.perf_counter() - started) * 1e3
        pieces: list[str] = []
        stream = TextStream(self.tokenizer, pieces.append)
        sent, finish, decode_s = 0, None, 0.0
        speculator = None
        if self.drafter is not None:
            speculator = Speculator(e, self.drafter, sampler, self.draft_tokens, seed)
            speculator.start(prompt_ids, ids[0])
        pending: list[int] = []  # a step's tokens not yet given to the reply
        emitted = 0
        while True:
            stream.push(ids[-1])
            text = "".join(pieces)
            cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=None)
            if cut is not None:
                finish, text = "stop", text[:cut]
            elif ids[-1] in stop_ids:
                finish = "stop"
            elif len(ids) == max_tokens:
                finish = "length"
            # a stop string may be growing at the end: hold back what could begin one
            hold = 0 if finish else max((k for s in stops for k in range(1, len(s))
                                         if text.endswith(s[:k])), default=0)
            if len(text) - hold > sent:
                yield text[sent:len(text) - hold]
                sent = len(text) - hold
            if finish or cancelled():
                break
            t0 = time.perf_counter()
            if not pending:
                pending = self._step(speculator, prompt_ids + ids, max_tokens - len(ids) - 1)
                emitted = len(pending)
            ids.append(pending.pop(0))
            if speculator is not None and not pending:  # the drafter back in step with ids
                speculator.kept(prompt_ids + ids, emitted, emitted, True)
            decode_s += time.perf_counter() - t0
        finish = finish or "cancelled"
        if speculator is not None and pending:
            speculator.kept(prompt_ids + ids, emitted, emitted - len(pending), False)
        # The cache holds the prompt and every new token but the last, which no step has read.
        self.cached = prompt_ids + ids[:-1]
        self.last_token_ids = ids
        steps = len(ids) - 1
        ms = decode_s * 1e3 / steps if steps else None
        fraction = None
        if ms:
            f = floor(self.spec, self.gpu, len(self.cached), self.weight_format, self.kv_format)
            fraction = f.floor_ms / ms
        self.last_report = Report(len(prompt_ids), keep, len(ids), finish, prefill_ms, ttft_ms,
                                  decode_s * 1e3, ms, fraction,
                                  speculator and speculator.stats.as_dict())

    def _step(self, speculator: Speculator | None, context: list[int], room: int) -> list[int]:
        """One step's new tokens: a plain step's one, or a verify step's (`room`: drafts that
        fit what the request may still take)."""
        if speculator is not None:
            return speculator.step(context, room)
        if self.cuda and self.engine.graph is None:
            self.engine.capture()
        self.engine.step()
        return [self.engine.token.item()]  # waits for the step

    def close(self) -> None:
        self.engine.close()
