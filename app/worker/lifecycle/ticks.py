"""When the loop's tick runs: soon after the frames at hand, or when a decider asked to be
woken (`Actions.wake_in`, the feed's, a parked request's deadline).

One timer at a time: a wake-up within `TIMER_SLACK_S` of the one set needs no new timer,
an earlier or later one replaces it. The tick itself is the loop's
(`app.worker.lifecycle.dispatcher`); it says `ticking` as it begins.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from app.worker.lifecycle.loop import Loop, Timer

# A wake-up this close to the one already set needs no new timer.
TIMER_SLACK_S = 0.001


class Ticks:
    """The loop's tick, queued and timed (loop thread)."""

    def __init__(self, loop: Loop, tick: Callable[[], None]) -> None:
        self.loop = loop
        self.tick = tick  # the loop's
        self.queued = False
        self._timer: Timer | None = None
        self._timer_at = 0.0

    def queue(self) -> None:
        """Tick once the loop has read the frames at hand, so messages delivered together
        land in one batch."""
        # A timer due now, not `call_soon`: kombu's loop runs what `call_soon` adds from
        # its own thread only after its next poll returns, so from a callback that itself
        # came by `call_soon` (a load's end) the tick waited for the next frame or timer
        # (0.03-1.2 s measured after loads, bench.coldstart); due timers fire before that
        # poll.
        if not self.queued:
            self.queued = True
            self.loop.call_later(0, self.tick)

    def ticking(self) -> None:
        """The tick runs now: a later `queue` queues another."""
        self.queued = False

    def wake_in(self, seconds: float | None) -> None:
        """Tick in `seconds` (None: no wake-up asked)."""
        if seconds is None:
            return
        at = time.monotonic() + seconds
        if self._timer is not None:
            if abs(at - self._timer_at) <= TIMER_SLACK_S:
                return
            self._timer.cancel()
        self._timer_at = at
        self._timer = self.loop.call_later(seconds, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.tick()

    def cancel(self) -> None:
        """No wake-up (the connection was lost: nothing is held any more)."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
