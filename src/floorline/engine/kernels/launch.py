"""Programmatic dependent launch (PDL, compute capability 9.0+): a kernel's programs may start
while the previous kernel's last ones finish, and wait (griddepcontrol.wait) only where they
first touch what it wrote. Every engine kernel waits before its first read of an activation or
cache and before any write, so ordering is the stream's; what overlaps is launch and ramp-up.
FLOORLINE_PDL=0 turns it off (for A/B runs)."""

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

