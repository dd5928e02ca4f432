"""Robust summaries of per-step samples."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Summary:
    n: int
    median_ms: float
    p10_ms: float
    p90_ms: float
    mean_ms: float


def summarise(samples_ms) -> Summary:
    x = np.asarray(samples_ms, dtype=float)
    if x.size == 0:
        raise ValueError("no samples")
    p10, median, p90 = np.percentile(x, [10, 50, 90])
    return Summary(int(x.size), float(median), float(p10), float(p90), float(x.mean()))
