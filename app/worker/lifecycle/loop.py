"""The loop handle: what the worker's collaborators may ask of the event loop they run on.

Kombu's hub runs everything of a request's life on one thread (its channels are not
thread-safe). A collaborator needs three things of it: run a callable on it soon (from
another thread: a batch's end, a load's end, a claim fetched, a stream's deltas), run one
later (the loop's timers), and the worker's name (stamped into results, into what is
republished). Celery's task events (Flower) are read through it too. `ConsumerLoop` is
that handle over Celery's consumer; the collaborators see only the `Loop` protocol, never
the consumer itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class Timer(Protocol):
    def cancel(self) -> None: ...


class Identity(Protocol):
    """Who answers: the worker's name and Celery's task-event dispatcher (None while
    Celery has none)."""

    @property
    def hostname(self) -> str: ...

    @property
    def event_dispatcher(self) -> Any: ...


class Loop(Identity, Protocol):
    """The event loop's handle (see the module)."""

    def call_soon(self, callback: Callable[..., Any], *args: Any) -> None: ...

    def call_later(self, seconds: float, callback: Callable[..., Any], *args: Any
                   ) -> Timer: ...


class ConsumerLoop:
    """The `Loop` of a Celery consumer: its hub, its hostname, its event dispatcher (read
    each time: Celery replaces the dispatcher on a reconnect)."""

    __slots__ = ("_consumer", "hostname")

    def __init__(self, consumer: Any) -> None:
        self._consumer = consumer
        self.hostname: str = consumer.hostname  # the node's name: set once, by Celery

    @property
    def event_dispatcher(self) -> Any:
        # Celery's Events step sets it (None until it starts, and while events are off).
        return self._consumer.event_dispatcher

    def call_soon(self, callback: Callable[..., Any], *args: Any) -> None:
        self._consumer.hub.call_soon(callback, *args)

    def call_later(self, seconds: float, callback: Callable[..., Any], *args: Any) -> Timer:
        timer: Timer = self._consumer.hub.call_later(seconds, callback, *args)
        return timer
