"""The trained model on this machine's GPU: greedy decode of SmolLM2-135M (fetched first, with
`floorline models fetch smollm2-135m`) by the engine in float32 and bf16 and by transformers in
float32 and bf16, all on the same converted weights, from prompts the test suite does not use.

Each decode's agreement is its tokens before its first difference from transformers-float32's.
The verdict passes where the engine in float32 gives transformers-float32's tokens, parting only
at a true tie (transformers' own top two within 1e-4 there), and the engine in bf16 agrees with
float32 for at least 0.8 times as many tokens as transformers in bf16 does (the suite's own rule
on the CPU).

    python bench/real_model_check.py [--tokens 48] [--json out.json]

Prints one line per prompt, then the verdict line; exits 1 where the verdict fails.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from floorline.engine import Engine
from floorline.engine.generate import encode, load_tokenizer
from floorline.models import resolve_model

MODEL = "smollm2-135m"
# Held out: none of these is in floorline.measure.texts.PROMPTS, which the suite decodes.
PROMPTS = (
    ("Why do leaves change colour in autumn?", True),
    ("Write a short email asking a colleague to review a report.", True),
    ("What is the boiling point of water at sea level in Fahrenheit?", True),
    ("Give two tips for sleeping better.", True),
    ("How many legs does a spider have?", True),
    ("Describe a bicycle to someone who has never seen one.", True),
    ("What should a delivery robot do when its path is blocked?", True),
    ("The largest ocean on Earth is", False),
    ("def is_even(n):\n", False),
    ("A good breakfast includes", False),
)
TIE = 1e-4  # transformers' own top-two margin under which a difference is a tie


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def engine_greedy(engine: Engine, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after `ids` through the captured step (no stop at EOS)."""
    engine.prefill(torch.tensor(ids))
    if engine.graph is None and engine.device.type == "cuda":
        engine.capture()  # once: the graph reads the token and position where prefill left them
    out = [engine.token.item()]
    while len(out) < n:
        engine.step()
        out.append(engine.token.item())
    return out


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after `ids` from transformers' model, one forward per token."""
    with torch.no_grad():
        out = model(torch.tensor([ids], device=model.device), use_cache=True)
        tokens = [out.logits[0, -1].argmax().item()]
        while len(tokens) < n:
            out = model(torch.tensor([[tokens[-1]]], device=model.device),
                        past_key_values=out.past_key_values, use_cache=True)
            tokens.append(out.logits[0, -1].argmax().item())
    return tokens


def margin_at(model, ids: list[int], tokens: list[int], at: int, other: int) -> float:
    """transformers' logit of its own choice over `other`'s at position `at` of `tokens`."""
    with torch.no_grad():
        logits = model(torch.tensor([ids + tokens[:at]], device=model.device)).logits[0, -1]
    return (logits[tokens[at]] - logits[other]).item()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    spec = resolve_model(MODEL)
    tokenizer = load_tokenizer(spec.weights_dir)
    prompts = [encode(tokenizer, text, chat, spec.weights_dir) for text, chat in PROMPTS]
    capacity = max(map(len, prompts)) + args.tokens + 1
    hf = {dtype: AutoModelForCausalLM.from_pretrained(spec.weights_dir, dtype=dtype)
          .to(args.device).eval() for dtype in (torch.float32, torch.bfloat16)}
    engines = {dtype: Engine(spec, args.device, capacity, dtype=dtype)
               for dtype in (torch.float32, torch.bfloat16)}
    rows, untied = [], []
    for (text, _), ids in zip(PROMPTS, prompts):
        truth = hf_greedy(hf[torch.float32], ids, args.tokens)
        row = {"prompt": text, "tokens": args.tokens}
        decoded = {"engine_fp32": engine_greedy(engines[torch.float32], ids, args.tokens),
                   "engine_bf16": engine_greedy(engines[torch.bfloat16], ids, args.tokens),
                   "hf_bf16": hf_greedy(hf[torch.bfloat16], ids, args.tokens)}
        row.update({name: first_difference(tokens, truth) for name, tokens in decoded.items()})
        if row["engine_fp32"] < args.tokens:  # a difference in float32: a tie, or a failure
            at = row["engine_fp32"]
            row["fp32_margin"] = margin_at(hf[torch.float32], ids, truth, at,
                                           decoded["engine_fp32"][at])
            if row["fp32_margin"] > TIE:
                untied.append(text)
        rows.append(row)
        print(f"{text[:48]!r:52} tokens to the first difference from transformers-float32: "
              f"engine float32 {row['engine_fp32']}, engine bf16 {row['engine_bf16']}, "
              f"transformers bf16 {row['hf_bf16']} (of {args.tokens})", flush=True)
    n = len(rows)
    same = sum(r["engine_fp32"] == args.tokens for r in rows)
    engine_bf16, hf_bf16 = (sum(r[k] for r in rows) for k in ("engine_bf16", "hf_bf16"))
    ok = not untied and engine_bf16 >= 0.8 * hf_bf16
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    verdict = (f"model: {'PASS' if ok else 'FAIL'} {MODEL} on {gpu}, {n} held-out prompts x "
               f"{args.tokens} greedy tokens: engine float32 gave transformers-float32's tokens "
               f"on {same}/{n}{' (the rest part at ties)' if same < n and not untied else ''}"
               f"{'; parts from it beyond a tie on: ' + '; '.join(untied) if untied else ''}; "
               f"tokens agreeing with float32 in bf16: engine {engine_bf16}, transformers "
               f"{hf_bf16} (the engine must keep at least 0.8x transformers')")
    print(verdict)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "rows": rows, "verdict": verdict, "pass": ok}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
