"""floorline's own batch-1 runtime: one readable decoder, Triton kernels, one CUDA graph per
step."""

from floorline.engine.runtime import Engine

__all__ = ["Engine"]
