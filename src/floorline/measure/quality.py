"""What a path's formats cost in quality: one model with real weights and one path on a device,
against transformers' own model of the same weights in float32 (the reference), built in the
same process.

- Perplexity on the evaluation text (texts.evaluation_text(), the model's tokenizer, no special
  tokens added): its first `tokens` tokens in non-overlapping windows of `window`, each window
  scored from its second position. The path's, with a 95% bootstrap interval over windows; the
  reference's on the same windows; the path's relative increase over it, with an interval of
  its own over the windows' paired differences.
- The mean KL divergence KL(reference || path) per scored position (log-softmax in float64),
  with its interval over windows.
- Greedy agreement over texts.PROMPTS (chat prompts through the tokenizer's chat template with
  the assistant's turn opened; the others as they are): the reference's greedy continuation of
  NEW_TOKENS tokens (fewer where it ends at EOS, the EOS included), then the path's logits over
  prompt and continuation. Per prompt, the first new token where the path's argmax differs from
  the reference's token (NEW_TOKENS where it never does) and the reference's top-2 margin there:
  a divergence where the reference itself nearly tied (margin below NEAR_TIE) is no real
  disagreement, and is counted apart.

Every figure is per window or per prompt, so memory stays bounded: the text is scored one
window at a time, by the reference and the path, and no window's logits are kept. The
reference's continuations are computed once per command: a path's measurement decodes them,
and the command hands them to its next path's of the same model (measure/runner.py). A model
with random weights has no quality to measure: its row says so and holds no number.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from functools import cache

from floorline.errors import FloorlineError
from floorline.hardware import DeviceSpec
from floorline.measure.cell import failure_reason, release
from floorline.measure.texts import PROMPTS, evaluation_text, text_digest
from floorline.models import resolve_model
from floorline.paths import REGISTRY, PathSpec, parse_path, unavailable
from floorline.records import INVALID, VALID, QualityKey, QualityResult
from floorline.stats import mean_interval

NEW_TOKENS = 32  # the reference's greedy continuation of each prompt
NEAR_TIE = 0.5  # nats: the reference's top token less than e^0.5 = 1.65 times its second's odds
TOKENS = 8192  # `floorline quality`'s default: tokens of the evaluation text scored
SWEEP_TOKENS = 2048  # a sweep's default, a few seconds a path for a 135M model on a CPU
WINDOW = 512
ROWS = 256  # positions whose log-softmax is taken at once (float64: bounded memory)
RANDOM_WEIGHTS = "not measured: random weights"


@cache
def evaluation_digest() -> str:
    return text_digest(evaluation_text())


def quality_path(text: str) -> str:
    """The base path a quality measurement takes; a path with options is refused, since
    +compile and +graphs run the same arithmetic as the path without them."""
    spec = parse_path(text)
    if spec.name != spec.base:
        raise FloorlineError(f"{spec.name} computes what {spec.base} computes (+compile and "
                             f"+graphs change no arithmetic): measure the quality of "
                             f"{spec.base}")
    return spec.base


def check_windows(tokens: int, window: int, tokens_option: str = "--tokens",
                  window_option: str = "--window") -> None:
    """Tokens of the text in whole windows of at least two tokens (options named as given)."""
    if window < 2:
        raise FloorlineError(f"{window_option} must be at least 2 tokens, got {window}")
    if tokens < window or tokens % window:
        raise FloorlineError(f"{tokens_option} must be a whole number of windows of {window} "
                             f"tokens, got {tokens}")


def quality_key(model: str, path: str, tokens: int = TOKENS, window: int = WINDOW) -> QualityKey:
    """The key of (model, path) on the evaluation text; `tokens` must be whole windows."""
    check_windows(tokens, window)
    return QualityKey(model, quality_path(path), evaluation_digest(), tokens, window)


def prepare_quality(key: QualityKey, model_spec, device: str,
                    gpu: DeviceSpec) -> tuple[QualityResult, bool]:
    """The measurement before it runs, invalid, and whether it can run: not for random weights,
    a path that cannot run here, or windows longer than the model's positions. Cheap: no model
    is built, and the key's path, a base path (quality_key), is not parsed again."""
    path = REGISTRY[key.path]
    result = QualityResult(key, gpu.name, INVALID)
    result.details = {"device": device, "weight_format": path.weight_format,
                      "kv_dtype": path.kv_dtype, "new_tokens": NEW_TOKENS}
    limit = model_spec.max_context
    if not model_spec.has_real_weights:
        result.reason = RANDOM_WEIGHTS
    elif (reason := unavailable(PathSpec(key.path), device)) is not None:
        result.reason = f"not measured: path unavailable: {reason}"
    elif not path.real_weights(model_spec):
        result.reason = (f"not measured: {key.path} does not run the weights of "
                         f"{model_spec.weights_dir} (its file format is not there)")
    elif limit is not None and key.window >= limit:
        result.reason = (f"not measured: windows of {key.window} tokens do not fit below the "
                         f"model's {limit} positions")
    return result, result.reason is None


@dataclass(frozen=True)
class Continuation:
    """The reference's greedy continuation of one prompt (its EOS included), and its top-2 margin
    (nats) at each new token."""
    prompt: list[int]
    new: list[int]
    margins: list[float]
    chat: bool


class Reference:
    """transformers' own model of the checkpoint in float32, its tokenizer, and what it
    generates (computed once)."""

    def __init__(self, model_spec, device: str):
        import torch

        from floorline.engine.generate import check_tokenizer, eos_ids, load_tokenizer
        from floorline.models import build_model

        self.model_spec, self.device = model_spec, device
        self.model = build_model(model_spec, device, torch.float32)
        directory = model_spec.weights_dir
        self.tokenizer = load_tokenizer(directory)
        check_tokenizer(directory, self.tokenizer, model_spec.config.get_text_config().vocab_size)
        self.stop = eos_ids(directory, model_spec.config, self.tokenizer)
        self._continuations = None

    def logits(self, ids):
        """[n, vocab] float32 logits of every position of `ids`, on the host."""
        out = self.model(input_ids=ids.view(1, -1).to(self.device), use_cache=False)
        return out.logits[0].float().cpu()

    def windows(self, tokens: int, window: int) -> tuple[list, int]:
        """The evaluation text's first `tokens` tokens in windows of `window`, and how many
        tokens the whole text has."""
        import torch

        ids = self.tokenizer(evaluation_text(), add_special_tokens=False)["input_ids"]
        if len(ids) < tokens:
            raise FloorlineError(f"the evaluation text has {len(ids)} tokens in this model's "
                                 f"tokenizer, fewer than the {tokens} asked for (--tokens)")
        text = torch.tensor(ids[:tokens])
        return list(text.split(window)), len(ids)

    def continuations(self, decoded: list[dict] | None = None) -> list[Continuation]:
        """The reference's greedy continuation of every prompt, decoded as one batch (prompts
        padded on the left, masked) and cut after the first EOS; the margins are those of the
        logits each token was chosen from. `decoded`: this reference's continuations as an
        earlier measurement of the same command returned them (asdict), taken as they are."""
        if self._continuations is None:
            self._continuations = ([Continuation(**c) for c in decoded] if decoded is not None
                                   else self._continue_all())
        return self._continuations

    def _continue_all(self) -> list[Continuation]:
        import torch
        from transformers import DynamicCache

        from floorline.engine.generate import encode
        from floorline.models import cache_keyword

        prompts = [encode(self.tokenizer, p.text, p.chat, self.model_spec.weights_dir)
                   for p in PROMPTS]
        width = max(map(len, prompts))
        pad = min(self.stop, default=0)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                            device=self.device)
        cache, keyword = DynamicCache(config=self.model.config), cache_keyword(self.model)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        chosen, margins = [], []
        while len(chosen) < NEW_TOKENS:
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                             **{keyword: cache}, use_cache=True, logits_to_keep=1)
            logits = out.logits[:, -1].float()
            top2 = logits.topk(2, dim=-1).values
            chosen.append(logits.argmax(-1))
            margins.append(top2[:, 0] - top2[:, 1])
            if all(any(t in self.stop for t in row) for row in torch.stack(chosen, 1).tolist()):
                break
            ids, positions = chosen[-1][:, None], positions[:, -1:] + 1
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        chosen, margins = torch.stack(chosen, 1).tolist(), torch.stack(margins, 1).tolist()
        continuations = []
        for i, (prompt, p) in enumerate(zip(prompts, PROMPTS)):
            new = chosen[i]
            end = next((j + 1 for j, t in enumerate(new) if t in self.stop), len(new))
            continuations.append(Continuation(prompt, new[:end], margins[i][:end], p.chat))
        return continuations


@cache
def reference(model_spec, device: str) -> Reference:
    """The reference of `model_spec` on `device`, built once per process."""
    return Reference(model_spec, device)


def score_window(reference_logits, path_logits, ids) -> tuple[float, float, float]:
    """One window's mean negative log-likelihood under the reference and the path, and the mean
    KL(reference || path), over the positions that predict its 2nd token onwards (float64)."""
    import torch

    if not torch.isfinite(path_logits).all():
        raise FloorlineError("the path's logits hold NaN or infinity")
    n = ids.numel() - 1
    sums = [0.0, 0.0, 0.0]
    for start in range(0, n, ROWS):
        rows = slice(start, min(start + ROWS, n))
        target = ids[start + 1:rows.stop + 1].view(-1, 1)
        ref = torch.log_softmax(reference_logits[rows].double(), dim=-1)
        path = torch.log_softmax(path_logits[rows].double(), dim=-1)
        sums[0] -= ref.gather(1, target).sum().item()
        sums[1] -= path.gather(1, target).sum().item()
        sums[2] += (ref.exp() * (ref - path)).sum().item()
    return sums[0] / n, sums[1] / n, sums[2] / n


def agreement(session, c: Continuation) -> dict:
    """Where the path's greedy choice first leaves the reference's continuation `c`."""
    import torch

    logits = session.window_logits(torch.tensor(c.prompt + c.new))
    picks = logits[len(c.prompt) - 1:len(c.prompt) - 1 + len(c.new)].argmax(-1).tolist()
    first = next((i for i, (a, b) in enumerate(zip(picks, c.new)) if a != b), None)
    entry = {"chat": c.chat, "prompt_tokens": len(c.prompt), "reference_tokens": len(c.new),
             "first_divergence": NEW_TOKENS if first is None else first}
    if first is not None:
        entry.update(reference_margin=c.margins[first], reference_token=c.new[first],
                     path_token=picks[first])
    return entry


def _exp_interval(interval, minus: float = 0.0) -> tuple:
    """An interval of a mean log-ratio as one of the ratio (minus `minus`)."""
    return tuple(None if v is None else math.exp(v) - minus
                 for v in (interval.estimate, interval.low, interval.high))


def summarise_quality(reference_nll: list[float], path_nll: list[float], kl: list[float],
                      greedy: list[dict], seed: int = 0) -> dict:
    """The figures (records.QUALITY_FIGURES) from the per-window and per-prompt ones."""
    ppl = _exp_interval(mean_interval(path_nll, seed))
    increase = _exp_interval(mean_interval([p - r for p, r in zip(path_nll, reference_nll)],
                                           seed), minus=1.0)
    kl_interval = mean_interval(kl, seed)
    firsts = [g["first_divergence"] for g in greedy]
    return {
        "ppl": ppl[0], "ppl_low": ppl[1], "ppl_high": ppl[2],
        "reference_ppl": math.exp(sum(reference_nll) / len(reference_nll)),
        "ppl_increase": increase[0], "ppl_increase_low": increase[1],
        "ppl_increase_high": increase[2],
        "kl": kl_interval.estimate, "kl_low": kl_interval.low, "kl_high": kl_interval.high,
        "prompts": len(greedy), "prompts_agreeing": firsts.count(NEW_TOKENS),
        "mean_first_divergence": sum(firsts) / len(firsts) if firsts else None,
        "near_tie_divergences": sum(1 for g in greedy
                                    if g.get("reference_margin", math.inf) < NEAR_TIE),
    }


def measure_quality(key: QualityKey, device: str, gpu: DeviceSpec, seed: int = 0,
                    trust_remote_code: bool = False,
                    continuations: list[dict] | None = None
                    ) -> tuple[QualityResult, list[dict] | None]:
    """Measure one path's quality (in the runner's child process); every failure a user can
    meet comes back as an invalid row with its reason. With it, the reference's continuations
    (asdict; None where it never reached them) for the next path's measurement to take as
    `continuations` (Reference.continuations)."""
    import torch

    model_spec = resolve_model(key.model, trust_remote_code)
    result, runnable = prepare_quality(key, model_spec, device, gpu)
    if not runnable:
        return result, None
    session, decoded, seconds, t0 = None, None, {}, time.perf_counter()

    def lap(name: str) -> None:
        nonlocal t0
        seconds[name] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()

    try:
        if evaluation_digest() != key.text:
            raise FloorlineError("this Python's evaluation text differs from the one asked for "
                                 "(its SHA-256): measure it with the Python that asked")
        with torch.no_grad():
            ref = reference(model_spec, device)
            windows, text_tokens = ref.windows(key.tokens, key.window)
            continuations = ref.continuations(continuations)
            decoded = [asdict(c) for c in continuations]
            lap("reference")
            longest = max(len(c.prompt) + len(c.new) for c in continuations)
            session = REGISTRY[key.path].open(model_spec, device,
                                              max(key.window, longest) + 1, seed)
            lap("open_path")
            per_window = [score_window(ref.logits(ids), session.window_logits(ids), ids)
                          for ids in windows]
            lap("text")
            result.greedy = [agreement(session, c) for c in continuations]
            lap("prompts")
        reference_nll, path_nll, kl = (list(v) for v in zip(*per_window))
        result.summary = summarise_quality(reference_nll, path_nll, kl, result.greedy, seed)
        result.details.update(seed=seed, text_tokens=text_tokens, seconds=seconds,
                              windows={"reference_nll": reference_nll, "path_nll": path_nll,
                                       "kl": kl})
        result.status = VALID
    except Exception as e:  # the row is lost, not the command: record why
        result.reason = failure_reason(e, "not measured")
    finally:
        release(session)
    return result, decoded


def describe(row) -> dict[str, str]:
    """A quality row's figures as text (store.QualityRow; "-" where it has none): perplexity,
    the float32 reference's, the increase over it and KL with their 95% intervals, and greedy
    agreement."""
    if row.ppl is None:
        return dict.fromkeys(("ppl", "reference_ppl", "vs_fp32", "kl", "greedy"), "-")
    interval = lambda low, high, f: "" if low is None else f" ({low:{f}} to {high:{f}})"  # noqa: E731
    near = (f" ({row.near_tie_divergences} of the divergences at near-ties)"
            if row.near_tie_divergences else "")
    return {
        "ppl": f"{row.ppl:.3f}" + interval(row.ppl_low, row.ppl_high, ".3f"),
        "reference_ppl": f"{row.reference_ppl:.3f}",
        "vs_fp32": f"{row.ppl_increase:+.2%}" + interval(row.ppl_increase_low,
                                                         row.ppl_increase_high, "+.2%"),
        "kl": f"{row.kl:.3g}" + interval(row.kl_low, row.kl_high, ".3g"),
        "greedy": (f"{row.prompts_agreeing}/{row.prompts} agree; mean first divergence "
                   f"{row.mean_first_divergence:.1f}{near}"),
    }
