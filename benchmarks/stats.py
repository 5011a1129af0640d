"""Shared by the benchmarks that report a median with a bootstrap interval."""

from __future__ import annotations

import random
import statistics


def median_interval(values: list[float], rounds: int = 2000) -> tuple[float, float]:
    """A bootstrap 90 % interval of the median of ``values`` (seeded: the same data, the same interval)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(rounds))
    return medians[int(0.05 * rounds)], medians[int(0.95 * rounds) - 1]
