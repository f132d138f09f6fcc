"""The device-busy fraction a worker's pool state carries (app/worker/pool_states.py)."""

from __future__ import annotations

from app.worker import pool_states
from app.worker.pool_states import PoolStates


def test_each_state_says_the_busy_fraction_since_the_last(monkeypatch):
    clock = iter([100.0, 102.0, 106.0])
    monkeypatch.setattr(pool_states.time, "monotonic", lambda: next(clock))
    busy = iter([3.0, 4.0, 7.0])
    states = PoolStates("q", 5.0)
    assert states._device_busy() is None  # no running total given
    states.busy_seconds = lambda: next(busy)
    assert states._device_busy() is None  # the first reading
    assert states._device_busy() == 0.5  # 1 s busy of 2
    assert states._device_busy() == 0.75  # 3 s busy of 4
