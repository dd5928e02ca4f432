"""Which of K and V carries the fp8 KV cache's cost in quality on SmolLM2: engine-kvfp8's
quality measurement with one of the two read back exactly (its fp8 copy written as usual, the
exact values kept beside it and read in its place), against both in fp8.

    FLOORLINE_CACHE=... PYTHONPATH=src python3 notebook/2026-12-06-kvfp8-8k/k_or_v.py TOKENS WINDOW
"""

import sys

import torch

from floorline.engine.kvcache import KVCache
from floorline.hardware import detect
from floorline.measure.quality import measure_quality, quality_key

write, read = KVCache.write, KVCache.read


def exact(which: str):
    """KVCache's write and read with `which` ("k" or "v") read back as written."""
    kept = {}

    def write_keeping(self, layer, start, k, v):
        write(self, layer, start, k, v)
        values = (k if which == "k" else v).float()
        held = kept.setdefault((id(self), layer), torch.zeros(
            values.shape[0], self.k.shape[2], values.shape[2]))
        held[:, start:start + values.shape[1]] = values

    def read_exact(self, layer, end, dtype):
        k, v = read(self, layer, end, dtype)
        held = kept[(id(self), layer)][:, :end].to(dtype)
        return (held, v) if which == "k" else (k, held)
    return write_keeping, read_exact


def run(label, tokens, window):
    r = measure_quality(quality_key("smollm2-135m", "engine-kvfp8", tokens, window), "cpu",
                        detect("cpu"))
    s = r.summary
    print(f"{label}: vs fp32 {s['ppl_increase']:+.2%} ({s['ppl_increase_low']:+.2%} to "
          f"{s['ppl_increase_high']:+.2%}), KL {s['kl']:.5f}, greedy {s['prompts_agreeing']}/"
          f"{s['prompts']}", flush=True)


if __name__ == "__main__":
    tokens, window = int(sys.argv[1]), int(sys.argv[2])
    run("K and V in fp8", tokens, window)
    for which in ("k", "v"):
        KVCache.write, KVCache.read = exact("v" if which == "k" else "k")
        run(f"{which.upper()} alone in fp8", tokens, window)
