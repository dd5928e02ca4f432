"""Text generation with the engine: a local checkpoint and its tokenizer, a prompt, new tokens
streamed as they come, and the decode's speed against the memory floor."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from floorline.engine.kvcache import check_format
from floorline.engine.model import VERIFY_MAX
from floorline.engine.runtime import Engine
from floorline.engine.sampling import Sampler
from floorline.engine.speculate import AUTO, Speculator, Stats, check_draft_tokens, drafter_for
from floorline.errors import FloorlineError, one_line
from floorline.models import resolve_model
from floorline.models.zoo import shipped_name
from floorline.traffic import engine_kv_format, engine_weight_format, floor

# --dtype -> the engine's dtype and the floor's name for it (weights and KV cache alike).
DTYPES = {"bfloat16": (torch.bfloat16, "bf16"), "float32": (torch.float32, "fp32")}


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    ids: list[int]  # the new tokens, the EOS that ended them included
    text: str  # the new tokens decoded, special tokens left out
    stopped_at_eos: bool
    dtype: str
    weight_format: str  # the floor's name for the weights that ran (quantised or 16-bit)
    kv_format: str  # the floor's name for the KV cache's format
    prefill_ms: float  # the prompt's forward pass and the first new token read back
    decode_ms: float  # wall clock over the decode steps, each token read back included
    device_ms: float | None  # CUDA events around each step (with speculation, its drafting
    # and verify step together); None on the CPU
    model_spec: object = field(repr=False)  # the floorline ModelSpec, for the floor
    speculation: Stats | None = None  # what the drafter and the verify steps did
    products: str | None = None  # the CPU step's routes (Engine.products)

    @property
    def decode_steps(self) -> int:
        """Steps the decode ran: one a token, or with speculation one a verify step."""
        if self.speculation is None:
            return self.steps
        return self.speculation.verify_steps + self.speculation.plain_steps

    @property
    def steps(self) -> int:
        return len(self.ids) - 1  # the first new token comes from the prefill

    @property
    def ms_per_token(self) -> float | None:
        return self.decode_ms / self.steps if self.steps else None

    @property
    def device_ms_per_step(self) -> float | None:
        steps = self.decode_steps
        return self.device_ms / steps if steps and self.device_ms is not None else None

    @property
    def final_context(self) -> int:
        """Tokens in the cache that the last step read (the floor's ctx)."""
        return len(self.prompt_ids) + self.steps - 1

    def summary(self, gpu) -> str:
        """One line: tokens, prefill, decode speed, and the fraction of the floor on `gpu` (a
        floorline DeviceSpec) at the final context."""
        n = len(self.ids)
        parts = [f"{n} new token{'s' if n > 1 else ''}"
                 + (" (stopped at EOS)" if self.stopped_at_eos else ""),
                 f"prefill {self.prefill_ms:.1f} ms "
                 f"({len(self.prompt_ids) / self.prefill_ms * 1e3:.0f} tokens/s)"]
        if self.steps:
            parts.append(f"decode {self.ms_per_token:.3f} ms/token")
            if self.device_ms is not None:
                parts.append(f"device {self.device_ms_per_step:.3f} ms/step")
            kv = self.kv_format
            f = floor(self.model_spec, gpu, self.final_context, self.weight_format, kv)
            parts.append(f"{f.floor_ms / self.ms_per_token:.1%} of the "
                         f"{'one-step ' if self.speculation else ''}floor ({f.floor_ms:.3f} ms "
                         f"at ctx {f.ctx}, weights {self.weight_format}, KV {kv}, on {gpu.name} "
                         f"at {gpu.peak_gbps:g} GB/s)")
        if self.speculation is not None:
            parts.append(self.speculation.summary())
        products = f"\nthe CPU's products: {self.products}" if self.products else ""
        return ", ".join(parts) + products


class TextStream:
    """The new tokens' text as they come: the whole sequence is decoded each time and the new
    suffix passed on, held back while it ends in U+FFFD (a character whose bytes are still
    split across tokens)."""

    def __init__(self, tokenizer, write: Callable[[str], None] | None):
        self.tokenizer, self.write = tokenizer, write
        self.ids: list[int] = []
        self.sent = 0

    def push(self, token: int) -> None:
        self.ids.append(token)
        if self.write is not None:
            text = self.text()
            if not text.endswith("\ufffd"):
                self._send(text)

    def finish(self) -> str:
        text = self.text()
        if self.write is not None:
            self._send(text)
        return text

    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def _send(self, text: str) -> None:
        if len(text) > self.sent:
            self.write(text[self.sent:])
            self.sent = len(text)


def load_tokenizer(directory: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as e:  # transformers raises many kinds, with messages over several lines
        said = one_line(e)
        raise FloorlineError(f"{directory}: transformers cannot load a tokenizer from it "
                             f"({type(e).__name__}{': ' + said if said else ''})") from None


def check_tokenizer(directory: Path, tokenizer, vocab: int) -> None:
    """A tokenizer whose ids run past the model's embedding table would index outside it: its
    largest id is checked, which a vocabulary with gaps puts above its length."""
    largest = max(tokenizer.get_vocab().values(), default=-1)
    if largest >= vocab:
        raise FloorlineError(f"{directory}: the tokenizer's ids run to {largest}, past the "
                             f"model's vocab_size of {vocab} (ids 0-{vocab - 1}): they would "
                             "index outside the embedding table")


def encode(tokenizer, prompt: str, chat: bool, directory: Path | None = None) -> list[int]:
    """The prompt as one user message in the chat template (with the assistant's turn opened)
    where the tokenizer has one and `chat` is on; otherwise the prompt as it is."""
    if chat and tokenizer.chat_template:
        messages = [{"role": "user", "content": prompt}]
        try:
            encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                    return_dict=True)
        except Exception as e:  # jinja2's syntax and runtime errors, the template's own raises
            raise FloorlineError(f"{directory or 'the tokenizer'}: its chat template cannot be "
                                 f"applied ({type(e).__name__}: {one_line(e)}); --no-chat "
                                 "encodes the prompt without it") from None
        return list(encoded["input_ids"])
    return list(tokenizer(prompt)["input_ids"])


def _token_ids(value, where: str) -> list[int]:
    """eos_token_id as configs hold it: an int, a list of ints, or absent."""
    values = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise FloorlineError(f"{where}: eos_token_id must be a token id or a list of them, "
                             f"not {value!r}")
    return values


def eos_ids(directory: Path, config, tokenizer) -> set[int]:
    """Every token that ends the reply: the model config's, the generation config's (each an
    int or a list) and the tokenizer's."""
    ids = set(_token_ids(getattr(config.get_text_config(), "eos_token_id", None),
                         str(directory / "config.json")))
    ids.update(_token_ids(tokenizer.eos_token_id, f"{directory}: the tokenizer"))
    path = directory / "generation_config.json"
    if path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise FloorlineError(f"{path} is not valid JSON: {e.msg} at line {e.lineno}") from None
        except UnicodeDecodeError as e:
            raise FloorlineError(f"{path} is not UTF-8 text (byte {e.start})") from None
        if not isinstance(data, dict):
            raise FloorlineError(f"{path} must hold a JSON object, not {type(data).__name__}")
        ids.update(_token_ids(data.get("eos_token_id"), str(path)))
    return ids


def generate(model: str | Path, prompt: str, *, max_new_tokens: int = 128,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, device: str = "cpu",
             dtype: str = "bfloat16", chat: bool = True, weights: str | None = None,
             head: str = "bf16", kv: str = "bf16", group_size: int | None = None,
             draft: str | None = None, draft_tokens: int | str = AUTO,
             on_text: Callable[[str], None] | None = None) -> GenerationResult:
    """Up to `max_new_tokens` new tokens from the checkpoint directory `model`, stopping at EOS;
    `on_text` receives the decoded text piece by piece as it comes. `weights` (int4, fp8, bf16;
    None: the checkpoint's own format), `head` (bf16, fp8) and `kv` (the KV cache: bf16, the
    16-bit dtype, or fp8) choose the engine's formats; a 16-bit checkpoint is quantised at
    load, int4 in groups of `group_size` (32, 64, 128; None: a packed checkpoint's own, else
    the largest that divides every matrix width). `draft` turns on speculative decoding:
    'lookup' (prompt lookup) or a draft model's checkpoint directory (its tokenizer must be the
    model's); `draft_tokens` drafted a verify step, 1-15 or 'auto' (floorline.engine.speculate).
    Greedy output is the same with or without it; sampled output has the same distribution."""
    if dtype not in DTYPES:
        raise FloorlineError(f"dtype must be one of {', '.join(DTYPES)}, got '{dtype}'")
    check_format(kv)
    if max_new_tokens < 1:
        raise FloorlineError(f"max-new-tokens must be at least 1, got {max_new_tokens}")
    try:
        sampler = Sampler(temperature, top_p)
    except ValueError as e:
        raise FloorlineError(str(e)) from None
    if draft is not None:
        check_draft_tokens(draft_tokens)  # before anything loads
    model_spec = resolve_model(str(model))
    if not model_spec.has_real_weights:
        what = ("is a shipped config without weights" if shipped_name(str(model))
                else "holds no .safetensors weights")
        raise FloorlineError(f"{model} {what}: generate needs a checkpoint directory with "
                             "config.json, *.safetensors and a tokenizer")
    tokenizer = load_tokenizer(model_spec.weights_dir)
    vocab = model_spec.config.get_text_config().vocab_size
    check_tokenizer(model_spec.weights_dir, tokenizer, vocab)
    prompt_ids = encode(tokenizer, prompt, chat, model_spec.weights_dir)
    if not prompt_ids:
        raise FloorlineError("the prompt encodes to no tokens")
    capacity = len(prompt_ids) + max_new_tokens
    if model_spec.max_context is not None and capacity > model_spec.max_context:
        raise FloorlineError(f"{len(prompt_ids)} prompt tokens + {max_new_tokens} new tokens = "
                             f"{capacity}, above the model's {model_spec.max_context} positions")
    if draft is not None:  # room for a verify step's drafts past the last token kept
        capacity = min(capacity + VERIFY_MAX, model_spec.max_context or capacity + VERIFY_MAX)
    stop = eos_ids(model_spec.weights_dir, model_spec.config, tokenizer)
    cuda = torch.device(device).type == "cuda"
    if cuda and torch.device(device).index is not None:
        torch.cuda.set_device(device)  # the kernels, the graph and the events use the current GPU
    engine = Engine(model_spec, device, capacity, dtype=DTYPES[dtype][0], sampler=sampler,
                    weights=weights, head=head, kv=kv, group_size=group_size)
    weight_format = engine_weight_format(engine.weights, engine.head, DTYPES[dtype][1],
                                         engine.group_size)
    kv_format = engine_kv_format(kv, DTYPES[dtype][1])
    stream = TextStream(tokenizer, on_text)

    speculator = None
    if draft is not None:
        drafter = drafter_for(draft, lambda path: draft_engine(path, tokenizer, device, capacity,
                                                               DTYPES[dtype][0]))
        speculator = Speculator(engine, drafter, sampler, draft_tokens, seed)

    torch.manual_seed(seed)
    t0 = time.perf_counter()
    engine.prefill(torch.tensor(prompt_ids))
    ids = [engine.token.item()]
    prefill_ms = (time.perf_counter() - t0) * 1e3
    stream.push(ids[0])
    if speculator is not None:
        speculator.start(prompt_ids, ids[0])

    def finished() -> bool:
        return ids[-1] in stop or len(ids) == max_new_tokens

    decode_s = 0.0
    device_ms = 0.0 if cuda else None
    if cuda and not finished():
        engine.capture()
        if speculator is not None:  # every verify step's graph, before the decode is timed
            engine.capture_verify()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    long_from = engine.config.long_rope_from
    while not finished():
        t0 = time.perf_counter()
        if cuda:
            start.record()
        if engine.filled == long_from:
            # The step that crosses LongRoPE's original length: as transformers generates,
            # the whole sequence again, every position turned with the long factors.
            engine.prefill(torch.tensor(prompt_ids + ids))
            emitted = None
        elif speculator is not None:
            # drafts that fit the reply's remaining tokens and (LongRoPE) stop before the
            # original length, which the prefill above crosses
            room = max_new_tokens - len(ids) - 1
            if long_from is not None and engine.filled < long_from:
                room = min(room, long_from - engine.filled - 1)
            emitted = speculator.step(prompt_ids + ids, room)
        else:
            engine.step()
            emitted = None
        if cuda:
            end.record()
            end.synchronize()  # a speculative step's tokens came back before its last kernels
        emitted = emitted or [engine.token.item()]
        decode_s += time.perf_counter() - t0
        if cuda:
            device_ms += start.elapsed_time(end)
        before = len(ids)
        for token in emitted:
            ids.append(token)
            stream.push(token)
            if finished():
                break
        if speculator is not None:
            t0 = time.perf_counter()  # a draft model catching up is part of the decode
            speculator.kept(prompt_ids + ids, len(emitted), len(ids) - before, not finished())
            decode_s += time.perf_counter() - t0
    products = engine.products()
    engine.close()
    return GenerationResult(prompt_ids, ids, stream.finish(), ids[-1] in stop, dtype,
                            weight_format, kv_format, prefill_ms, decode_s * 1e3, device_ms,
                            model_spec, speculator and speculator.stats, products)


def draft_engine(path: str, tokenizer, device: str, capacity: int, dtype) -> Engine:
    """A draft model's engine (greedy, its checkpoint's own format): refused unless its
    tokenizer is the target's, token for token."""
    spec = resolve_model(path)
    if not spec.has_real_weights:
        raise FloorlineError(f"--draft {path}: a draft model is a checkpoint directory with "
                             "weights and a tokenizer (or 'lookup' for prompt lookup)")
    if load_tokenizer(spec.weights_dir).get_vocab() != tokenizer.get_vocab():
        raise FloorlineError(f"--draft {path}: its tokenizer is not the model's, so its tokens "
                             "cannot be checked against the model's")
    return Engine(spec, device, capacity, dtype=dtype)
