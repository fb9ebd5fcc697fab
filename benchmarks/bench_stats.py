"""Statistics the benchmark scripts share."""

from __future__ import annotations

import random
import statistics


def bootstrap_ratio(
    base: list[float], other: list[float], draws: int = 4000, seed: int = 0
) -> tuple[float, float, float]:
    """mean(base) / mean(other) and the 2.5 % and 97.5 % quantiles of that ratio over `draws`
    bootstrap resamples (each list resampled with replacement, independently)."""
    rng = random.Random(seed)
    ratios = sorted(
        statistics.fmean(rng.choices(base, k=len(base)))
        / statistics.fmean(rng.choices(other, k=len(other)))
        for _ in range(draws)
    )
    low, high = ratios[int(0.025 * draws)], ratios[min(int(0.975 * draws), draws - 1)]
    return statistics.fmean(base) / statistics.fmean(other), low, high
