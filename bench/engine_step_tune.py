"""The engine's GEMV launch configurations tuned again inside its step, on a GPU.

    PYTHONPATH=src python bench/engine_step_tune.py --model llama-3.1-8b --ctx 2048 \
        [--weights int4] [--head bf16] [--kv bf16] [--replays 200] [--save] [--json out.json]

Builds the engine on seeded random weights from the model's config, prefills `ctx` tokens and
captures the step. A step's time is the median of `replays` replays, each from the same position
(the position is put back before every timing, so the cache's live length stays `ctx`). Then
floorline.engine.tuning.tune_in_step goes through the step's GEMV shapes in the order the step
launches them, trying every configuration the stand-alone tuner tries. Prints, per shape, the
configuration in force and the one chosen, with the confirming ratio of step times; --save
writes the changed ones into the local table (FLOORLINE_CACHE/engine-gemv.json), which the
engine reads over the shipped tables in floorline/engine/tuned/.

Compare step times only within one pairing. On the H200 the step took 0.6-2.4% longer after
its first recapture whatever the configuration (Qwen2.5-7B int4 1.848 -> 1.892 ms with no
product changed), so the printed before and after differ by that too: a change rests on its
alternate confirmations, and a sweep in fresh processes with the local table and without it
judges it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch

from floorline.engine import Engine
from floorline.engine.kvcache import KV_FORMATS
from floorline.engine.quant import FORMATS, HEAD_FORMATS
from floorline.engine.tuning import candidates, tune_in_step
from floorline.models import resolve_model
from floorline.timing import time_steps

WARMUP = 10  # untimed replays before each timing


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--weights", default="int4", choices=FORMATS)
    parser.add_argument("--head", default="bf16", choices=HEAD_FORMATS)
    parser.add_argument("--kv", default="bf16", choices=KV_FORMATS)
    parser.add_argument("--replays", type=int, default=200, help="timed replays per step time")
    parser.add_argument("--min-gain", type=float, default=0.003,
                        help="the least fraction of the step a change must save to be taken")
    parser.add_argument("--save", action="store_true",
                        help="write the changed configurations into the local table")
    parser.add_argument("--json")
    args = parser.parse_args()
    engine = Engine(resolve_model(args.model), "cuda", args.ctx + WARMUP + args.replays + 1,
                    weights=args.weights, head=args.head, kv=args.kv)
    prompt = torch.randint(0, engine.config.vocab, (args.ctx,),
                           generator=torch.Generator().manual_seed(0))
    engine.prefill(prompt)
    engine.capture()
    d, tuner = engine.decoder, engine.ops.tuner
    pos, token = d.pos.clone(), d.token.clone()

    def time_step() -> float:
        d.pos.copy_(pos)
        d.token.copy_(token)
        return statistics.median(time_steps(engine.graph.replay, "cuda", args.replays, WARMUP))

    def apply(key, config) -> None:
        if config != tuner.current(key):
            tuner.use(key, config)
            engine.capture()

    shipped = {key: dict(tuner.table[key]) for key in tuner.seen}
    before = time_step()
    print(f"{args.model} ctx {args.ctx}, weights {args.weights}, head {args.head}, kv {args.kv} "
          f"on {torch.cuda.get_device_name()}: step {before:.4f} ms", flush=True)
    chosen = tune_in_step(list(tuner.seen), lambda key: candidates(*tuner.seen[key]),
                          tuner.current, apply, time_step, min_gain=args.min_gain)
    after = time_step()
    rows = []
    for c in chosen:
        changed = c["chosen"] != c["incumbent"]
        ratio = "" if c["ratio"] is None else f", confirmed at {c['ratio']:.4f} of the step"
        print(f"{c['key']}: {'->' if changed else 'kept'} {c['chosen']}{ratio}", flush=True)
        if changed and args.save:
            tuner.use(c["key"], c["chosen"], tuned_in_step=f"{args.model} ctx {args.ctx}",
                      step_ratio=round(c["ratio"], 4))
            tuner.save(c["key"])
        rows.append(dict(key=c["key"], incumbent=dataclasses.asdict(c["incumbent"]),
                         chosen=dataclasses.asdict(c["chosen"]), ratio=c["ratio"],
                         screened=[dict(config=dataclasses.asdict(k), ms=ms)
                                   for k, ms in c["screened_ms"].items()]))
    print(f"step {before:.4f} -> {after:.4f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "ctx": args.ctx, "weights": args.weights,
                       "head": args.head, "kv": args.kv, "gpu": torch.cuda.get_device_name(),
                       "replays": args.replays, "min_gain": args.min_gain,
                       "step_ms_before": before, "step_ms_after": after, "shipped": shipped,
                       "shapes": rows}, f, indent=1)


if __name__ == "__main__":
    main()
