"""The engine's int4 against the awq-marlin path on the same AWQ checkpoint. A random AutoAWQ
(GEMM layout) checkpoint of a real config is written; the engine loads it as it runs any AWQ
directory (repacked once into its own layout, bf16 activations, one CUDA graph) and the
awq-marlin path loads it (vLLM's Marlin kernels, fp16); both are fed the same tokens (a prompt,
then teacher-forced steps) beside transformers in float32 on the matrices the packed tensors
stand for. Per model: each runtime's relative error of the logits against that reference, the
engine's against Marlin's, and at how many positions their greedy tokens agree.

    FLOORLINE_MARLIN_LIB=/path/floorline_marlin.so python bench/awq_marlin_check.py \
        --models qwen2.5-7b,llama-3.1-8b [--json out.json]

Marlin needs a CUDA GPU and its library (third_party/marlin/build.sh); without them its side says
why it did not run, and the engine's side still runs (on a CPU through its reference kernels,
in float32), which checks this script on a tiny config: --models tiny-llama.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from floorline.engine import Engine
from floorline.engine.check import relative_error
from floorline.layouts.checkpoint import write_packed_checkpoint
from floorline.localcache import cache_dir
from floorline.models import resolve_model
from floorline.paths import REGISTRY


def hf_logits(hf_model, tokens: torch.Tensor, prompt: int) -> torch.Tensor:
    """Logits at the prompt's last position and every later one, in one forward."""
    with torch.no_grad():
        return hf_model(input_ids=tokens[None]).logits[0, prompt - 1:].float()


def engine_logits(engine: Engine, tokens: torch.Tensor, prompt: int, graph: bool) -> torch.Tensor:
    with torch.no_grad():
        out = [engine.prefill(tokens[:prompt]).float()]
        if graph:
            engine.capture()
        for t in tokens[prompt:]:
            engine.token.copy_(t.view(1))
            engine.step()
            out.append(engine.logits.float().clone())
    return torch.stack(out)


def errors(a: torch.Tensor, b: torch.Tensor) -> dict:
    e = [relative_error(x, y) for x, y in zip(a, b)]
    return {"median": statistics.median(e), "max": max(e)}


def agree(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.argmax(-1) == b.argmax(-1)).sum())


def check(model: str, device: str, prompt: int, steps: int, seed: int) -> dict:
    spec = resolve_model(model)
    cuda = device.startswith("cuda")
    cache_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as d:
        directory = Path(d)
        reference = write_packed_checkpoint(spec, directory, "awq", seed=seed, device=device)
        checkpoint = resolve_model(str(directory))
        tokens = torch.randint(spec.config.vocab_size, (prompt + steps,),
                               generator=torch.Generator().manual_seed(seed)).to(device)
        truth = hf_logits(reference, tokens, prompt)
        del reference
        engine = Engine(checkpoint, device, prompt + steps + 1,
                        dtype=torch.bfloat16 if cuda else torch.float32)
        mine = engine_logits(engine, tokens, prompt, graph=cuda)
        engine.close()
        result = {"model": model, "device": device, "positions": len(truth),
                  "engine_vs_fp32": errors(mine, truth),
                  "engine_agrees_with_fp32": agree(mine, truth)}
        path = REGISTRY["awq-marlin"]
        reason = path.unavailable(device)
        if reason:
            result["awq_marlin"] = f"not run: {reason}"
            return result
        marlin = hf_logits(path.build(checkpoint, device, seed), tokens, prompt)
    result.update(awq_marlin="ran", marlin_vs_fp32=errors(marlin, truth),
                  marlin_agrees_with_fp32=agree(marlin, truth),
                  engine_vs_marlin=errors(mine, marlin),
                  engine_agrees_with_marlin=agree(mine, marlin))
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="qwen2.5-7b,llama-3.1-8b")
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for model in args.models.split(","):
        rows.append(check(model, device, args.prompt, args.steps, args.seed))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
