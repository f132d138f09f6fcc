"""Fakes of what the worker talks to, shared by its unit tests: a delivered kombu message
and kombu's event loop (the hub)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from tasks.envelope import H_REPLY_BATCH
from tests.stack import wait_for


class Message:
    """What the worker reads of a delivered kombu message (headers, body, reply_to), and
    what it does to it (acks, requeues, dead-letters), counted."""

    def __init__(self, reply_to: str | None = "gw-1", batch: bool = True,
                 headers: dict[str, Any] | None = None, body: bytes = b"") -> None:
        self.properties = {"reply_to": reply_to}
        self.headers: dict[str, Any] = {H_REPLY_BATCH: 1} if batch else {}
        self.headers.update(headers or {})
        self.body = body
        self.acks = self.requeues = self.dead = 0

    def ack(self) -> None:
        self.acks += 1

    def reject(self, requeue: bool) -> None:
        if requeue:
            self.requeues += 1
        else:
            self.dead += 1


class Timer:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Hub:
    """What the worker uses of kombu's hub: callbacks are run by the test. `call_soon` may
    come from any thread (a batch's end comes from the runtime's)."""

    def __init__(self) -> None:
        self.soon: list[tuple[Callable[..., None], tuple]] = []
        self.later: list[tuple[float, Callable[..., None], tuple]] = []
        self.timers: list[Timer] = []  # of `later`, index by index
        self.repeating: list[tuple[float, Callable[..., None], Timer]] = []
        self.lock = threading.Lock()

    def call_soon(self, callback: Callable[..., None], *args: Any) -> None:
        with self.lock:
            self.soon.append((callback, args))

    def call_later(self, delay: float, callback: Callable[..., None], *args: Any) -> Timer:
        timer = Timer()
        with self.lock:
            self.later.append((delay, callback, args))
            self.timers.append(timer)
        return timer

    def call_repeatedly(self, seconds: float, callback: Callable[..., None]) -> Timer:
        """Recorded in `repeating` (seconds, callback, timer); the test runs it."""
        timer = Timer()
        with self.lock:
            self.repeating.append((seconds, callback, timer))
        return timer

    def run_soon(self) -> None:
        """Wait for a `call_soon` callback (5 s at most) and run those queued."""
        wait_for(lambda: self.soon, 5, "a callback on the loop")
        with self.lock:
            callbacks, self.soon = self.soon, []
        for callback, args in callbacks:
            callback(*args)

    def run_timers(self, upto_s: float = 0.0) -> int:
        """Run the timers due within `upto_s` (not cancelled), as the loop would when that
        much time passed, and the `call_soon` callbacks queued; how many ran."""
        ran = 0
        while True:
            with self.lock:
                due = [i for i, (delay, _, _) in enumerate(self.later)
                       if delay <= upto_s and not self.timers[i].cancelled]
                if not due and not self.soon:
                    return ran
                calls = [self.later[i][1:] for i in due]
                for i in due:
                    self.timers[i].cancelled = True  # fired: runs once
                calls += self.soon
                self.soon = []
            for callback, args in calls:
                callback(*args)
                ran += 1
