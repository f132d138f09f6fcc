"""A worker's warm shutdown that wastes nothing: drain, then let Celery stop.

Celery's own SIGTERM handler only sets a flag that its event loop turns into
`WorkerShutdown` on its next turn: the loop stops there, so the results of the
running batch could no longer be confirmed by the broker nor their messages
acked, and every message the worker held was redelivered and computed again.

While the model queues are consumed, `GracefulShutdown` takes SIGTERM and
SIGINT instead. The first one starts a drain on the event loop (the worker's
`ModelQueueConsumer` stops consuming, hands back what has not started, lets
what runs finish, publish and ack); when the drain is over it calls Celery's
own handler, and Celery's warm shutdown runs as it always did (task consumer,
pidbox, events, the runtime closed by the step's `shutdown`). A second signal,
or SHOAL_SHUTDOWN_GRACE_S running out, forces the end: nothing more is
published or acked, and Celery's cold shutdown closes the connection, so the
broker redelivers what was unacked (recomputed, never lost). A watchdog thread
kills the child processes and exits if even that does not end the process in
time. SIGQUIT stays Celery's (cold shutdown at once).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from celery.worker import state as worker_state

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# After a forced end, how long Celery's cold shutdown and closing the runtime may take
# before the watchdog kills the children and exits: a runtime child is stopped within
# ~2 s (1 s polite, 1 s after SIGTERM, then SIGKILL).
FORCED_EXIT_S = 4.0
EX_FAILURE = 1


def child_pids() -> list[int]:
    """This process's children (its model runtime processes), from /proc."""
    pids: list[int] = []
    for task in Path(f"/proc/{os.getpid()}/task").glob("*"):
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return pids


def kill_children_and_exit() -> None:
    """The last resort: what a crash does (the broker redelivers what was unacked)."""
    for pid in child_pids():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    os._exit(EX_FAILURE)


class GracefulShutdown:
    """Signals in, loop callbacks out: `on_drain()` once, `on_force(why)` at most once.

    The step calls `finish()` when the drain is over, `attach(hub)` whenever it
    consumes (signals then start a drain) and `detach()` when it stops (a signal
    then goes to Celery's handler: nothing is held to drain)."""

    def __init__(self, grace_s: float, on_drain: Callable[[], None],
                 on_force: Callable[[str], None]) -> None:
        self.grace_s = grace_s
        self.on_drain = on_drain
        self.on_force = on_force
        self.hub: Any = None
        self.requested_at: float | None = None  # monotonic, at the first signal
        self.finished = False
        self.forced = False
        self._celery: dict[int, Any] = {}  # the handlers Celery installed
        self._grace_timer: Any = None

    @property
    def draining(self) -> bool:
        return self.requested_at is not None and not self.finished and not self.forced

    def attach(self, hub: Any) -> None:
        """Take SIGTERM and SIGINT from Celery (main thread only: where Celery's loop runs)."""
        self.hub = hub
        if threading.current_thread() is not threading.main_thread():
            log.warning("not on the main thread: SIGTERM stays Celery's (no drain)")
            return
        for sig in SIGNALS:
            current = signal.getsignal(sig)
            if current != self._on_signal:
                self._celery[sig] = current
                signal.signal(sig, self._on_signal)

    def detach(self) -> None:
        self.hub = None

    def elapsed(self) -> float:
        return 0.0 if self.requested_at is None else time.monotonic() - self.requested_at

    # --- signal handler (main thread, between two bytecodes of whatever ran) ------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.finished or (self.requested_at is None and self.hub is None):
            self._celery_handler(signum, frame)  # nothing to drain: Celery's warm shutdown
            return
        if self.requested_at is None:
            self.requested_at = time.monotonic()
            self._watchdog(self.grace_s + FORCED_EXIT_S)
            self._on_loop(lambda: self._begin(name))
            return
        self._watchdog(FORCED_EXIT_S)
        self._on_loop(lambda: self.force(f"a second signal ({name})"))

    def _on_loop(self, callback: Callable[[], None]) -> None:
        # Not `hub.call_soon` here: the handler may have interrupted the loop thread
        # inside call_soon's own (non-reentrant) lock, and a call_soon from the loop's
        # thread does not wake its poll. From another thread it does both safely.
        hub = self.hub
        if hub is None:  # the connection was lost meanwhile: nothing is held any more
            self._celery_handler(signal.SIGTERM, None)
            return
        threading.Thread(target=hub.call_soon, args=(callback,), name="shoal-shutdown",
                         daemon=True).start()

    def _watchdog(self, seconds: float) -> None:
        timer = threading.Timer(seconds, self._hard_exit)
        timer.daemon = True
        timer.start()

    def _hard_exit(self) -> None:
        log.critical("the worker did not exit %.1fs after the shutdown signal: killing its "
                     "runtime and exiting now (unacked messages are redelivered)",
                     self.elapsed())
        kill_children_and_exit()

    def _celery_handler(self, signum: int, frame: FrameType | None) -> None:
        handler = self._celery.get(signal.SIGTERM if signum != signal.SIGINT else signum)
        if callable(handler):
            handler(signum, frame)
        else:  # Celery installed none: its flag is what its loop reads
            worker_state.should_stop = 0

    # --- on the loop ----------------------------------------------------------------------

    def _begin(self, name: str) -> None:
        if self.finished or self.forced:
            return
        if self.hub is not None:
            self._grace_timer = self.hub.call_later(
                max(0.0, self.grace_s - self.elapsed()), self.force,
                f"SHOAL_SHUTDOWN_GRACE_S={self.grace_s:g} ran out")
        log.info("%s: draining for shutdown (grace %gs)", name, self.grace_s)
        self.on_drain()

    def finish(self) -> None:
        """The drain is over (or moot): Celery's warm shutdown takes it from here."""
        if self.finished or self.forced:
            return
        self.finished = True
        if self._grace_timer is not None:
            self._grace_timer.cancel()
        self._celery_handler(signal.SIGTERM, None)

    def force(self, why: str) -> None:
        """End now, as a crash would; Celery's cold shutdown closes the connection."""
        if self.finished or self.forced:
            return
        self.forced = True
        if self._grace_timer is not None:
            self._grace_timer.cancel()
        try:
            self.on_force(why)
        finally:
            worker_state.should_terminate = EX_FAILURE
