"""How bench.fleet turns replies into throughput, latency and device utilisation."""

from __future__ import annotations

import pytest

from bench.fleet_load import Outcome, Run


def test_utilisation_is_simulated_busy_time_over_wall_time_per_worker():
    run = Run("open 10/s", 10, duration=2.0)
    # worker a: 4 requests sharing batches, 250 ms busy each -> 1 s of 2 s
    run.outcomes += [Outcome(100.0, 3, 250.0, "a", True) for _ in range(4)]
    # worker b: 1 request, 500 ms busy; and a failure that counts nowhere
    run.outcomes += [Outcome(300.0, 8, 500.0, "b", True), Outcome(5.0, 1, 0.0, "", False)]
    summary = run.summary(workers=3)  # worker c did nothing
    assert summary["requests"] == 5 and summary["errors"] == 1
    assert summary["req_per_s"] == 2.5 and summary["items_per_s"] == 10.0
    assert summary["utilisation_max"] == pytest.approx(0.5)
    assert summary["utilisation_min"] == 0.0
    assert summary["utilisation_mean"] == pytest.approx((0.5 + 0.25 + 0.0) / 3)
    assert summary["p50_ms"] == pytest.approx(100.0)


def test_under_overload_utilisation_is_over_the_time_the_requests_took():
    run = Run("open 50/s", 50, duration=2.0)
    # Sent inside the 2 s window, served until t=4 s: 3 s of device time over 4 s.
    run.outcomes += [Outcome(1000.0, 1, 1500.0, "a", True, sent=0.0, done=4.0),
                     Outcome(1000.0, 1, 1500.0, "a", True, sent=1.0, done=3.0)]
    assert run.summary(workers=1)["utilisation_mean"] == pytest.approx(0.75)
