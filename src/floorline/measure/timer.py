"""Times decode steps: warm-up, then every step bracketed on its own."""

from __future__ import annotations

import time


def time_steps(step, device: str, steps: int, warmup: int) -> list[float]:
    """Milliseconds of each of `steps` calls of `step` (one decode step), after `warmup`
    untimed ones.

    On CUDA each step sits between two events on the current stream, so a step's time is what
    the GPU saw, idle gaps from a slow host included; the host synchronises once at the end.
    On the CPU the work is synchronous and a host clock brackets each step.
    """
    import torch

    for _ in range(warmup):
        step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                 for _ in range(steps)]
        for start, end in marks:
            start.record()
            step()
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in marks]
    samples = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        samples.append((time.perf_counter() - t0) * 1e3)
    return samples
