"""What a batch drops just before its device work: requests nobody will read.

The last point where not computing a request saves the device its work. A request is
dropped (answered, and taken out of its batch, which is planned again without it) when:

- its caller left (revoked: `ModelHost.cancel`), answered CANCELLED;
- its deadline has passed (its batch waited in the runtime process behind the batches
  ahead: the worker's prediction when it formed the batch did not hold), or passes before
  the device could finish even the fastest batch of its model measured lately, answered
  DEADLINE_EXCEEDED: its answer would reach nobody (the gateway has answered 504).

`DeviceFloor` keeps, per model, that fastest recent device time: it drops at once to a
faster batch and rises slowly (a tenth of the way per batch) towards slower ones, so it
stays a lower bound of what the next batch takes; a request is dropped only if it cannot
make its deadline even then. Unknown (no batch of the model measured yet): 0. While no
batch of the model runs it halves every FLOOR_HALF_LIFE_S: a floor measured on a busy
device cannot keep refusing every request after the device got faster, since a batch then
runs and measures it again.
"""

from __future__ import annotations

import time
from collections.abc import Container
from typing import Any

from runtimes.base import Outcome, Request, failed
from tasks.errors import ErrorCode

# How far the floor moves towards a slower batch's time, per batch.
FLOOR_RISE = 0.1
# While nothing of a model runs, its floor halves this often: long enough that requests
# which cannot make their deadline are not let through to measure it every moment (each
# such batch is computed for nobody), short enough to recover within seconds.
FLOOR_HALF_LIFE_S = 5.0


class DeviceFloor:
    """Per model, about the fastest device time of its recent batches (seconds)."""

    def __init__(self) -> None:
        self._floor: dict[str, tuple[float, float]] = {}  # model -> (seconds, measured at)

    def seconds(self, model: str, now: float | None = None) -> float:
        floor, at = self._floor.get(model, (0.0, 0.0))
        idle = (time.monotonic() if now is None else now) - at
        return floor * 0.5 ** (idle / FLOOR_HALF_LIFE_S) if idle > 0 else floor

    def observe(self, model: str, seconds: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        floor = self._floor[model][0] if model in self._floor else None
        self._floor[model] = (seconds if floor is None or seconds <= floor
                              else floor + (seconds - floor) * FLOOR_RISE, now)


def unwanted(runnable: list[tuple[Request, Any]], cancelled: Container[str],
             done_by_ms: float) -> dict[str, Outcome]:
    """The outcomes of the requests of `runnable` to drop: cancelled, or with a deadline
    before `done_by_ms` (epoch ms: now plus the device floor)."""
    dropped: dict[str, Outcome] = {}
    for request, _ in runnable:
        if request.id in cancelled:
            dropped[request.id] = failed(request.id, ErrorCode.CANCELLED, "the request was "
                                         "revoked by its caller before its batch reached "
                                         "the device")
        elif request.deadline_ms is not None and request.deadline_ms <= done_by_ms:
            dropped[request.id] = failed(request.id, ErrorCode.DEADLINE_EXCEEDED, "the "
                                         "request's deadline passed before its batch reached "
                                         "the device (or would before the device could "
                                         "finish it)")
    return dropped
