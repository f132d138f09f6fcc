"""app.tuning.stats and app.tuning.markdown: the one percentile, median, ratio and markdown
table every benchmark and `shoal bench` report with."""

from __future__ import annotations

import numpy as np
import pytest

from app.tuning.markdown import dash, fmt, row, table
from app.tuning.stats import median, percentile, ratio


def test_percentile_is_numpy_linear_by_default_and_none_when_empty() -> None:
    values = [7.0, 1.0, 4.0, 9.0, 3.0, 3.5]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(np.array([1.0, 2.0, 3.0]), 50) == 2.0
    assert percentile([], 50) is None and percentile(None, 50) is None
    assert percentile([5.0], 99) == 5.0


def test_percentile_methods_nearest_rank_closest_rank_rank_above() -> None:
    hundred = [float(v) for v in range(1, 101)]
    assert percentile(hundred, 99) == pytest.approx(99.01)
    # Nearest rank: the smallest value with at least q% of the values at or below it.
    assert percentile(hundred, 99, method="inverted_cdf") == 99.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50, method="inverted_cdf") == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 60, method="nearest") == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50, method="higher") == 3.0


def test_median_skips_missing_values_and_ratio_needs_both() -> None:
    assert median([3.0, None, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 2.0, 3.0]) == 2.5
    assert median(v for v in (None, 5.0)) == 5.0
    assert median([None]) is None and median([]) is None
    assert ratio(30.0, 20.0) == 1.5
    assert ratio(None, 20.0) is None and ratio(30.0, None) is None and ratio(30.0, 0.0) is None


def test_markdown_table_rows_rule_and_alignment() -> None:
    assert table(["load", "req/s"], [[1, "2.0"], ["**4** (knee)", 3.5]], align="lr") == [
        "| load | req/s |", "|---|---:|", "| 1 | 2.0 |", "| **4** (knee) | 3.5 |"]
    assert table(["a", "b", "c"]) == ["| a | b | c |", "|---:|---:|---:|"]
    assert row(["", 1, None]) == "|  | 1 | None |"
    with pytest.raises(ValueError):
        table(["a", "b"], align="l")
    with pytest.raises(ValueError):
        table(["a"], align="x")


def test_fmt_says_na_for_missing_values() -> None:
    assert fmt(1.234) == "1.2" and fmt(3, "g") == "3" and fmt(2.0, ".2f") == "2.00"
    assert fmt(None) == "n/a" and fmt(float("nan")) == "n/a" and fmt(None, missing="-") == "-"
    assert dash(None) == "-" and dash(2.345, ".2f") == "2.35" and dash(7) == "7.0"
