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
make its deadline even then. Unknown (no batch of the model measured yet): 0.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any

from runtimes.base import Outcome, Request, failed
from tasks.errors import ErrorCode

# How far the floor moves towards a slower batch's time, per batch.
FLOOR_RISE = 0.1


class DeviceFloor:
    """Per model, about the fastest device time of its recent batches (seconds)."""

    def __init__(self) -> None:
        self._floor: dict[str, float] = {}

    def seconds(self, model: str) -> float:
        return self._floor.get(model, 0.0)

    def observe(self, model: str, seconds: float) -> None:
        floor = self._floor.get(model)
        self._floor[model] = seconds if floor is None or seconds <= floor \
            else floor + (seconds - floor) * FLOOR_RISE


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
