"""The step's argmax and embedding kernels (floorline.engine.kernels.tokens) on the GPU: the
argmax against torch.argmax on 200 random vectors per vocabulary size (a third with a three-way
tie for the largest value), and each one's time per launch replayed from a CUDA graph of 100
launches (the median of 10 replays); then the embedding row against PyTorch's lookup, bit for bit.

    PYTHONPATH=src python bench/engine_tokens.py
"""

from functools import partial

import torch

from floorline.engine.kernels.tokens import argmax, argmax_scratch, embed, embed_reference
from floorline.engine.tuning import time_graph

VOCABS = (128256, 152064, 262144)  # Llama 3, Qwen2.5, Gemma 3


def per_launch_us(launch) -> float:
    """Median microseconds a launch, from replays of a graph of 100 launches timed by the
    project's step timer."""
    def hundred() -> None:
        for _ in range(100):
            launch()
    return time_graph(hundred) / 100


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for n in VOCABS:
        scratch = argmax_scratch(n, "cuda")
        token = torch.zeros(1, dtype=torch.long, device="cuda")
        differ = 0
        for i in range(200):
            x = torch.randn(n, device="cuda", generator=g)
            if i % 3 == 0:
                x[torch.randint(0, n, (3,), device="cuda", generator=g)] = 50.0
            argmax(x, token, scratch)
            differ += int(token.item() != torch.argmax(x).item())
        kernel = per_launch_us(partial(argmax, x, token, scratch))
        torch_us = per_launch_us(partial(torch.argmax, x, 0, keepdim=True,
                                                out=token))
        print(f"n {n} kernel: {kernel:.2f} us a launch")
        print(f"n {n} torch: {torch_us:.2f} us a launch")
        print(f"n {n}: {differ} of 200 differ from torch.argmax", flush=True)
    table = torch.randn(1000, 4096, device="cuda", dtype=torch.bfloat16)
    token = torch.tensor([7], device="cuda")
    mine, ref = torch.empty(4096, device="cuda"), torch.empty(4096, device="cuda")
    embed(table, token, mine, scale=62.0)
    embed_reference(table, token, ref, scale=62.0)
    print("embed equal:", torch.equal(mine, ref))


if __name__ == "__main__":
    main()
