"""runtimes.child_side.before_device: what a batch drops just before its device work."""

from __future__ import annotations

from runtimes.base import Request
from runtimes.child_side.before_device import FLOOR_HALF_LIFE_S, DeviceFloor, unwanted


def test_the_floor_falls_at_once_rises_slowly_and_halves_while_nothing_runs() -> None:
    floor = DeviceFloor()
    assert floor.seconds("m", now=0.0) == 0.0  # nothing measured: nothing is dropped for it
    floor.observe("m", 0.010, now=0.0)
    floor.observe("m", 0.002, now=0.0)
    assert floor.seconds("m", now=0.0) == 0.002
    floor.observe("m", 0.102, now=0.0)  # one slow batch moves it a tenth of the way
    assert abs(floor.seconds("m", now=0.0) - 0.012) < 1e-9
    assert floor.seconds("other", now=0.0) == 0.0
    # Nothing ran for two half-lives: a quarter of it, so a batch runs and measures again.
    assert abs(floor.seconds("m", now=2 * FLOOR_HALF_LIFE_S) - 0.003) < 1e-9


def test_revoked_and_late_requests_are_dropped_and_the_rest_kept() -> None:
    now_ms = 1_000_000.0
    runnable = [(Request("gone", "encode", {}, deadline_ms=now_ms + 60_000), None),
                (Request("past", "encode", {}, deadline_ms=now_ms - 1), None),
                (Request("too-close", "encode", {}, deadline_ms=now_ms + 5), None),
                (Request("in-time", "encode", {}, deadline_ms=now_ms + 50), None),
                (Request("no-deadline", "encode", {}), None)]
    dropped = unwanted(runnable, {"gone"}, done_by_ms=now_ms + 10)
    assert {i: o.error_code for i, o in dropped.items()} == {
        "gone": "CANCELLED", "past": "DEADLINE_EXCEEDED", "too-close": "DEADLINE_EXCEEDED"}
