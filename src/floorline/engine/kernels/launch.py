"""Programmatic dependent launch (PDL, compute capability 9.0+): a kernel's programs may start
while the previous kernel's last ones finish, and wait (griddepcontrol.wait) only where they
first touch what it wrote. Every engine kernel waits before its first read of an activation or
cache and before any write, so ordering is the stream's; what overlaps is launch and ramp-up.
With PDL on, a GEMV's programs first ask for their first weight tiles (prefetch into L2, up to
PREFETCH_BYTES each), which need nothing from the kernel before.
FLOORLINE_PDL=0 turns both off, FLOORLINE_PREFETCH_BYTES=0 the prefetch alone (for A/B runs)."""

from __future__ import annotations

import os
from functools import cache

import torch


@cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_options(t: torch.Tensor) -> dict:
    """The kernel's PDL constexpr and, where on, the launch option."""
    on = t.is_cuda and os.environ.get("FLOORLINE_PDL", "1") != "0" and _capable(t.device.index or 0)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


def prefetch_tiles(config, k: int, element_size: int) -> int:
    """Weight tiles a GEMV program prefetches before waiting: a few KB per program, so that the
    programs resident at once ask for a few MB, well inside L2 (one address per 128-byte line)."""
    if config.block_k * element_size < 128:
        return 0
    budget = int(os.environ.get("FLOORLINE_PREFETCH_BYTES", "8192"))
    tile = config.block_n * config.block_k * element_size
    tiles_in_split = k // (config.split_k * config.block_k)
    return max(0, min(budget // tile, tiles_in_split))
