"""The gateway's drain on SIGTERM: say so on /readyz, then let uvicorn stop accepting.

uvicorn's own shutdown (on SIGTERM) closes the listening socket, closes idle
keep-alive connections, waits for the requests in flight (answers that wait on a
worker's reply, streams) up to `timeout_graceful_shutdown`, and only then runs the
app's lifespan shutdown, which closes the broker connection: replies still on their
way arrive first. `shoal gateway` sets that timeout to SHOAL_SHUTDOWN_GRACE_S less
SHOAL_GATEWAY_DRAIN_DELAY_S.

What uvicorn lacks is a moment for a load balancer to notice: with
SHOAL_GATEWAY_DRAIN_DELAY_S > 0 the gateway first keeps serving that long while
/readyz answers 503 SHUTTING_DOWN, then hands the signal to uvicorn. A second
SIGTERM (or SIGINT) ends the wait for what is in flight at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from typing import Any

log = logging.getLogger(__name__)


class Drain:
    """Whether this gateway process is draining; installed by the app's lifespan."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.draining = False
        self._uvicorn_handler: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def install(self) -> bool:
        """Put this in front of the SIGTERM handler uvicorn installed (it installs its own
        before the lifespan starts, and restores the one before it when it exits). False
        where there is none to put in front of (the app served by a test client)."""
        if threading.current_thread() is not threading.main_thread():
            return False  # only the main thread may set a handler (a test's app thread)
        handler = signal.getsignal(signal.SIGTERM)
        if not callable(handler) or handler is signal.default_int_handler:
            return False
        self._uvicorn_handler = handler
        self._loop = asyncio.get_running_loop()
        signal.signal(signal.SIGTERM, self._on_sigterm)
        return True

    def _on_sigterm(self, sig: int, frame: Any) -> None:
        handler = self._uvicorn_handler
        if self.draining:
            # The second one: uvicorn treats a SIGINT during its shutdown as "force".
            handler(signal.SIGINT, frame)
            return
        self.draining = True
        if self.delay_s <= 0:
            log.info("SIGTERM: draining (no new connections; answering those in flight)")
            handler(sig, frame)
            return
        log.info("SIGTERM: /readyz answers 503 for %g s, then the gateway drains",
                 self.delay_s)
        assert self._loop is not None
        # A signal handler runs between two bytecodes of the main thread: schedule safely.
        self._loop.call_soon_threadsafe(self._loop.call_later, self.delay_s, handler, sig, frame)
