"""app.tuning.knee on synthetic load curves: the knee, its reason, and when a sweep stops."""

from __future__ import annotations

import math

import pytest

from app.tuning.knee import Point, SweepPolicy, find_knee, grow, next_load


def curve(*rows: tuple[float, float, float | None]) -> list[Point]:
    """(load, throughput, p99) rows; p50 is half the p99."""
    return [Point(load, tput, None if p99 is None else p99 / 2, p99) for load, tput, p99 in rows]


def test_clear_knee_is_the_best_throughput_before_p99_takes_off() -> None:
    points = curve((1, 50, 20), (2, 95, 22), (4, 180, 30), (8, 200, 38), (16, 205, 90),
                   (32, 206, 200))
    knee = find_knee(points)
    assert knee is not None
    assert knee.point.load == 8
    assert knee.index == 3
    assert knee.baseline_p99_ms == 20
    assert knee.limit_p99_ms == 40
    assert knee.confirmed
    assert "load 16" in knee.reason and "90.0 ms > 40.0 ms" in knee.reason


def test_never_degrading_curve_gives_the_last_point_and_says_so() -> None:
    points = curve((1, 10, 20), (2, 20, 21), (4, 40, 22), (8, 80, 23))
    knee = find_knee(points)
    assert knee is not None
    assert knee.point.load == 8
    assert not knee.confirmed
    assert "at or beyond the highest load" in knee.reason
    assert "raise the load" in knee.reason


def test_an_isolated_p99_spike_is_noise() -> None:
    points = curve((1, 50, 20), (2, 95, 55), (4, 180, 30), (8, 200, 38), (16, 205, 90),
                   (32, 206, 200))
    knee = find_knee(points)
    assert knee is not None
    assert knee.point.load == 8
    assert "isolated noise" in knee.reason and "load 2" in knee.reason


def test_two_violations_in_a_row_break_the_curve_even_if_p99_comes_back() -> None:
    points = curve((1, 50, 20), (2, 95, 30), (4, 180, 50), (8, 190, 60), (16, 400, 25))
    knee = find_knee(points)
    assert knee is not None
    assert knee.point.load == 2


def test_a_violating_last_point_breaks_the_curve() -> None:
    knee = find_knee(curve((1, 50, 20), (2, 95, 30), (4, 180, 50)))
    assert knee is not None
    assert knee.point.load == 2
    assert knee.confirmed


def test_input_order_does_not_matter_and_index_points_into_the_input() -> None:
    points = curve((8, 200, 38), (1, 50, 20), (32, 206, 200), (4, 180, 30), (16, 205, 90))
    knee = find_knee(points)
    assert knee is not None
    assert knee.point.load == 8 and knee.index == 0


def test_single_point() -> None:
    knee = find_knee(curve((4, 100, 25)))
    assert knee is not None
    assert knee.point.load == 4 and knee.index == 0
    assert not knee.confirmed


def test_no_knee_without_points_or_a_usable_baseline() -> None:
    assert find_knee([]) is None
    assert find_knee(curve((1, 0, None), (2, 10, 30))) is None
    assert find_knee([Point(1, 10, 5, 10, error_rate=0.5), Point(2, 20, 5, 10)]) is None
    assert find_knee(curve((1, 10, 0.0))) is None


def test_throughput_falling_after_saturation_keeps_the_peak() -> None:
    points = curve((1, 50, 20), (2, 100, 22), (4, 150, 25), (8, 120, 30), (16, 90, 35))
    knee = find_knee(points)
    assert knee is not None
    assert knee.point.load == 4
    assert knee.confirmed
    assert "peaked at load 4" in knee.reason


def test_ties_go_to_the_lowest_load() -> None:
    knee = find_knee(curve((1, 50, 20), (2, 100, 22), (4, 100, 30), (8, 100, 35)))
    assert knee is not None
    assert knee.point.load == 2


def test_repeated_lowest_load_uses_the_median_p99() -> None:
    points = curve((1, 50, 10), (1, 50, 30), (1, 50, 20), (2, 90, 39), (4, 120, 41))
    knee = find_knee(points)
    assert knee is not None
    assert knee.baseline_p99_ms == 20
    assert knee.point.load == 2


def test_errors_make_a_point_violate_even_with_low_latency() -> None:
    points = [Point(1, 50, 10, 20), Point(2, 95, 10, 22), Point(4, 400, 1, 2, error_rate=0.4),
              Point(8, 500, 1, 2, error_rate=0.6)]
    knee = find_knee(points)
    assert knee is not None
    assert knee.point.load == 2
    assert "error rate 40.0%" in knee.reason
    lenient = find_knee(points, max_error_rate=1.0)
    assert lenient is not None and lenient.point.load == 8


def test_factor_edge_cases() -> None:
    points = curve((1, 50, 20), (2, 95, 40), (4, 180, 40.001), (8, 190, 80))
    # The limit itself is within.
    knee = find_knee(points, p99_factor=2.0)
    assert knee is not None and knee.point.load == 2
    # Factor 1: only p99 <= the baseline qualifies.
    strict = find_knee(points, p99_factor=1.0)
    assert strict is not None and strict.point.load == 1
    # A huge factor never degrades.
    loose = find_knee(points, p99_factor=100)
    assert loose is not None and loose.point.load == 8 and not loose.confirmed
    for bad in (0.5, 0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="p99_factor"):
            find_knee(points, p99_factor=bad)


# --------------------------------------------------------------------------- the sweep


def run_sweep(measure, policy: SweepPolicy) -> tuple[list[Point], str]:
    """Drive next_load with a synthetic server: measure(load) -> Point."""
    points: list[Point] = []
    for _ in range(100):
        step = next_load(points, policy)
        if step.load is None:
            return points, step.reason
        points.append(measure(step.load))
    raise AssertionError("the sweep never stopped")


def saturating(load: float) -> Point:
    """Throughput 50/s per client up to 180/s; p99 = max(20, 10 x load) ms."""
    p99 = max(20.0, 10 * load)
    return Point(load, min(50 * load, 180), p99 / 2, p99)


def test_sweep_doubles_until_p99_passes_the_factor() -> None:
    # 1, 2, 4 are within 2 x 20 ms; 8 gives 80 ms (and no more throughput than 4).
    points, reason = run_sweep(saturating, SweepPolicy(start=1, growth=2, min_gain=-1))
    assert [p.load for p in points] == [1, 2, 4, 8]
    assert "p99 80.0 ms > 40.0 ms" in reason
    knee = find_knee(points)
    assert knee is not None and knee.point.load == 4


def test_sweep_stops_when_throughput_stops_growing_twice() -> None:
    # Throughput flat from load 4 on, latency within a lenient factor.
    def measure(load: float) -> Point:
        return Point(load, min(load, 4) * 10 * (1.01 if load == 16 else 1), 10, 20)

    points, reason = run_sweep(measure, SweepPolicy(start=1, growth=2))
    assert [p.load for p in points] == [1, 2, 4, 8, 16]
    assert "gained < 3%" in reason and "2 times" in reason


def test_a_single_flat_step_does_not_stop_the_sweep() -> None:
    table = {1: 10, 2: 20, 4: 20.2, 8: 40, 16: 40.1, 32: 40.2}

    def measure(load: float) -> Point:
        return Point(load, table[int(load)], 10, 20)

    points, reason = run_sweep(measure, SweepPolicy(start=1, growth=2, max_load=32))
    assert [p.load for p in points] == [1, 2, 4, 8, 16, 32]
    assert "gained" in reason


def test_sweep_stops_at_the_maximum() -> None:
    points, reason = run_sweep(lambda load: Point(load, load * 10, 10, 20),
                               SweepPolicy(start=1, growth=1.5, max_load=10))
    assert [p.load for p in points] == [1, 2, 3, 5, 8, 10]
    assert "maximum load 10" in reason


def test_confirm_two_rides_over_an_isolated_spike() -> None:
    spikes = {2: 100.0}

    def measure(load: float) -> Point:
        p99 = spikes.get(int(load), 20.0)
        return Point(load, load * 10, 10, p99)

    points, _ = run_sweep(measure, SweepPolicy(max_load=8, confirm=2))
    assert [p.load for p in points] == [1, 2, 4, 8]
    points, reason = run_sweep(measure, SweepPolicy(max_load=8, confirm=1))
    assert [p.load for p in points] == [1, 2]
    assert "100.0 ms" in reason


def test_sweep_without_a_baseline_stops_at_once() -> None:
    step = next_load([Point(1, 0, None, None, error_rate=1.0)])
    assert step.load is None and "baseline" in step.reason


def test_growth_in_open_loop_is_not_rounded() -> None:
    policy = SweepPolicy(start=5, growth=1.5, max_load=100, integer=False)
    assert grow(5, policy) == 7.5
    assert grow(80, policy) == 100
    assert next_load([], policy).load == 5


def test_bad_policies() -> None:
    with pytest.raises(ValueError, match="growth"):
        SweepPolicy(growth=1.0)
    with pytest.raises(ValueError, match="start"):
        SweepPolicy(start=10, max_load=5)
    with pytest.raises(ValueError, match="integer"):
        SweepPolicy(start=1.5)
