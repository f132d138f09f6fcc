"""The tuner's pure parts: comparing knees, the coordinate search, the cost fit, the write."""

from __future__ import annotations

import pytest

from app.tuning.knee import Knee, Point
from app.tuning.tune import better, coordinate_search, fit_cost, write_profile


def knee_at(throughput: float, p99_ms: float, load: float) -> Knee:
    """A knee (app.tuning.knee) at `load` clients; the tuner reads only its point."""
    point = Point(load, throughput, p99_ms / 2, p99_ms)
    return Knee(point, 0, p99_ms, 2 * p99_ms, True, "synthetic")


def test_more_throughput_wins_and_near_ties_go_to_the_lower_p99():
    assert better(knee_at(110, 90, 8), knee_at(100, 50, 8))
    assert not better(knee_at(101, 90, 8), knee_at(100, 50, 8))  # within 2%: p99 decides
    assert better(knee_at(99, 40, 8), knee_at(100, 50, 8))
    assert better(knee_at(1, 1, 1), None) and not better(None, knee_at(1, 1, 1))


def test_coordinate_search_finds_the_peak_of_a_synthetic_landscape():
    # Throughput peaks at max_items=32 and max_tokens=8192; delay only adds latency.
    def measure(s: dict[str, float]) -> Knee:
        throughput = 100 - abs(s["max_items"] - 32) / 2 - abs(s["max_tokens"] - 8192) / 512
        return knee_at(throughput, 50 + s["max_delay_ms"] * 10, 8)

    grid = {"max_tokens": (2048, 8192, 16384), "max_items": (16, 32, 64),
            "max_delay_ms": (0.0, 5.0)}
    start = {"max_tokens": 16384, "max_items": 64, "max_delay_ms": 5.0}
    best, knee, history = coordinate_search(start, grid, measure)
    assert best == {"max_tokens": 8192, "max_items": 32, "max_delay_ms": 0.0}
    assert knee == knee_at(100, 50, 8)
    settings = [tuple(sorted(s.items())) for s, _ in history]
    assert len(settings) == len(set(settings))  # nothing measured twice


def test_a_setting_without_a_knee_never_wins():
    best, knee, _ = coordinate_search({"max_items": 64}, {"max_items": (16, 32)},
                                      lambda s: None if s["max_items"] != 32 else knee_at(5, 5, 1))
    assert best == {"max_items": 32} and knee == knee_at(5, 5, 1)


def test_cost_fit_recovers_known_constants_and_never_goes_negative():
    samples = [(t, 10, 0.004 + 25e-6 * t) for t in (16, 64, 256, 1024, 4096)]
    a_ms, b_us, c_ns = fit_cost(samples)
    assert a_ms == pytest.approx(4.0, rel=1e-6) and b_us == pytest.approx(25.0, rel=1e-6)
    assert c_ns == 0
    # Time falling with size would need a negative slope: dropped, not reported.
    a_ms, b_us, _ = fit_cost([(10, 5, 0.010), (1000, 5, 0.008)])
    assert b_us == 0 and a_ms > 0
    with pytest.raises(ValueError):
        fit_cost([])


def test_write_profile_keeps_comments_and_other_keys(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("# why this model\nid: a/b  # the hub id\nadapter: dense\ndims: 8\n"
                    "source: {hub: a/b}\nprofiles:\n  l4: {max_items: 128}\n")
    write_profile(path, "cpu", {"max_items": 32, "measured": "shoal tune ... on today"})
    text = path.read_text()
    assert "# why this model" in text and "# the hub id" in text
    from tasks.catalog import load_entry

    entry = load_entry(path)
    assert entry.profile("cpu").max_items == 32 and entry.profile("l4").max_items == 128
    assert entry.profile("cpu").measured.startswith("shoal tune")


def test_repeated_sweeps_count_by_their_median_knee():
    from app.tuning.tune import median_knee

    knees = [knee_at(90, 100, 8), knee_at(140, 90, 16), knee_at(100, 95, 8)]
    assert median_knee(knees) == knee_at(100, 95, 8)
    assert median_knee([None, None, knee_at(1, 1, 1)]) is None
    assert median_knee([knee_at(5, 5, 1), None]) == knee_at(5, 5, 1)
