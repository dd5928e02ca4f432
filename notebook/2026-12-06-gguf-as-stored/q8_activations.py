"""Why llama.cpp's Q4_1 perplexity on SmolLM2's own file is above the engine's: its CPU backend
multiplies a Q4_1 (or Q8_0) matrix by x rounded to 8 bits per block of 32 (ggml-cpu's
vec_dot_type for Q4_1 is Q8_1, for Q8_0 Q8_0: d = max|x| / 127, q = round(x / d)). This runs the
engine's gguf weights through the quality measurement with every product's x rounded that way
(in float32 otherwise), against the same run without the rounding.

    FLOORLINE_CACHE=... PYTHONPATH=src python3 notebook/2026-12-06-gguf-as-stored/q8_activations.py
"""

import torch

from floorline.engine import model
from floorline.engine.quant import dense
from floorline.hardware import detect
from floorline.measure.quality import measure_quality, quality_key


def q8(x):
    """x rounded as ggml's quantize_row_q8_1 rounds it, per block of 32 along the last axis."""
    shape = x.shape
    blocks = x.float().reshape(*shape[:-1], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(blocks / torch.where(d > 0, d, 1)), 0)
    return (q * d).reshape(shape)


def linear(x, weight, bias, dtype):
    y = torch.nn.functional.linear(q8(x), dense(weight, torch.float32),
                                   None if bias is None else bias.float())
    return y.to(dtype)


def head(x, w, out, *, norm=None, eps=0.0, **_):
    xf = x.float()
    if norm is not None:
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * norm.float()
    out.copy_(q8(xf) @ dense(w).T)


def run(label):
    key = quality_key("smollm2-135m", "engine-gguf", 8192, 1024)
    r = measure_quality(key, "cpu", detect("cpu"))
    s = r.summary
    print(f"{label}: ppl {s['ppl']:.4f} vs fp32 {s['ppl_increase']:+.2%} "
          f"({s['ppl_increase_low']:+.2%} to {s['ppl_increase_high']:+.2%}), KL {s['kl']:.5f}, "
          f"greedy {s['prompts_agreeing']}/{s['prompts']}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(2)
    run("engine-gguf as it runs")
    model._linear = linear
    model._Chunk.head_product = staticmethod(head)
    run("engine-gguf, x rounded to 8 bits per 32 as ggml's CPU rounds it")
