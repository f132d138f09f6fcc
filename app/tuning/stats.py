"""The figures every benchmark and `shoal bench` report: percentiles of latencies, medians
over rounds, ratios of two medians. One definition each, so two tables that both say
"p99" or "median" mean the same thing.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

import numpy as np


def percentile(values: Sequence[float] | np.ndarray | None, q: float,
               method: str = "linear") -> float | None:
    """The `q`-th percentile (0-100) of `values`; None when there are none.

    `method` is numpy's: "linear" (the default, interpolating between the closest ranks),
    "inverted_cdf" (nearest rank: the smallest value with at least q% of the values at or
    below it), "nearest" (the closest rank), "higher" (the rank above)."""
    if values is None or len(values) == 0:
        return None
    return float(np.percentile(values, q, method=method))  # type: ignore[call-overload]


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values present (None skipped: a round that measured nothing);
    None when none is."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b; None when either is missing or b is 0."""
    return a / b if a is not None and b else None

