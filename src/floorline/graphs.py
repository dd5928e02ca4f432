"""Recording a step in a CUDA graph: the one way floorline captures (the engine's step and
verify step, and any path's `+graphs`)."""

from __future__ import annotations

from collections.abc import Callable


def capture(run: Callable[[], None], warmup: int = 1,
            reset: Callable[[], None] | None = None):
    """`run` recorded in a CUDA graph on the current device, after `warmup` eager runs on a
    side stream: they compile kernels, tune launch shapes and allocate workspaces, none of which
    may happen inside a capture. `reset()`, called between them and the capture, undoes their
    effect on what the graph reads."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            run()
    torch.cuda.current_stream().wait_stream(side)
    if reset is not None:
        reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph
