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


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float | None
    high: float | None
    n: int


def _bootstrap(x, statistic, method: str, seed: int, confidence: float, resamples: int):
    """scipy.stats.bootstrap's interval; scipy 1.15 renamed random_state to rng, and the GPU
    image's scipy may be older or newer."""
    import inspect

    from scipy.stats import bootstrap

    seed_arg = "rng" if "rng" in inspect.signature(bootstrap).parameters else "random_state"
    res = bootstrap((x,), statistic, confidence_level=confidence, n_resamples=resamples,
                    method=method, batch=500, **{seed_arg: np.random.default_rng(seed)})
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def mean_interval(values, seed: int, confidence: float = 0.95,
                  resamples: int = 10_000) -> Interval:
    """The mean with a BCa bootstrap interval; no interval under two values, or where every
    value is the same."""
    x = np.asarray(values, dtype=float)
    if x.size < 2 or np.ptp(x) == 0:
        return Interval(float(x.mean()) if x.size else float("nan"), None, None, int(x.size))
    low, high = _bootstrap(x, np.mean, "BCa", seed, confidence, resamples)
    return Interval(float(x.mean()), low, high, int(x.size))


def block_length(n: int) -> int:
    """Consecutive steps resampled together by block_median_interval: about n^(1/3) (the rate
    Politis and White's optimal length grows at), 4 for 64 steps, 13 for 2048."""
    return max(1, round(n ** (1 / 3)))


def block_median_interval(values, seed: int = 0, confidence: float = 0.95,
                          resamples: int = 2_000) -> Interval:
    """The median with a circular block bootstrap's percentile interval: resamples made of runs
    of block_length(n) consecutive values, so that a host's slow swings (a step is slow for a
    while, then fast) widen the interval as they widen the median's real uncertainty, where
    resampling single values would treat neighbours as independent."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        raise ValueError("no samples")
    median = float(np.median(x))
    if x.size < 2 or np.ptp(x) == 0:
        return Interval(median, median, median, int(x.size))
    n, block = x.size, block_length(x.size)
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, n, size=(resamples, -(-n // block)))
    index = (starts[:, :, None] + np.arange(block)).reshape(resamples, -1)[:, :n] % n
    medians = np.median(x[index], axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(medians, [tail, 100 - tail])
    return Interval(median, float(low), float(high), n)


def percent(fraction: float) -> str:
    """0.056 -> '5.6%'; below 0.1%, two significant digits ('0.033%') rather than '0.0%'."""
    return f"{fraction:.1%}" if fraction >= 0.001 else f"{fraction * 100:.2g}%"
