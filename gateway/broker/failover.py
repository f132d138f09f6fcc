"""An aio-pika robust connection that fails over across several broker URLs.

aio-pika's RobustConnection reconnects to the one URL it was given, `reconnect_interval`
seconds apart. This one holds the URLs of SHOAL_BROKER_URL (`;`-separated, the nodes
of one cluster): a connection that drops is re-established on the next URL
(round-robin), and an attempt that fails tries the following URLs at once, one round
through all of them before the robust connection's `reconnect_interval` (the gateway's
SHOAL_BROKER_RECONNECT_MAX_S) is slept. Everything the robust connection restores
(channels, declared exchanges and queues, consumers, QoS) is restored on whichever node
answers.

It overrides RobustConnection's private `__connect_transport` (one attempt): aio-pika
offers no hook to choose the URL per attempt. The import below fails loudly if an
aio-pika release renames it.
"""

from __future__ import annotations

import logging
from typing import Any

import aio_pika
from aio_pika.robust_connection import RobustConnection
from yarl import URL

from tasks.broker_urls import endpoint

log = logging.getLogger(__name__)

_ATTEMPT = "_RobustConnection__connect_transport"
if not hasattr(RobustConnection, _ATTEMPT):  # pragma: no cover - guards an aio-pika upgrade
    raise ImportError(f"aio-pika {aio_pika.__version__} has no RobustConnection.{_ATTEMPT}; "
                      "gateway.broker.failover needs updating")


class FailoverConnection(RobustConnection):
    def __init__(self, url: URL, *, urls: list[str], **kwargs: Any) -> None:
        self._urls = [URL(u) for u in urls] or [URL(url)]
        self._index = 0
        super().__init__(self._urls[0], **kwargs)

    @property
    def endpoint(self) -> str:
        """host:port of the URL in use (or tried last)."""
        return endpoint(str(self.url))

    def _advance(self) -> None:
        self._index = (self._index + 1) % len(self._urls)
        self.url = self._urls[self._index]

    async def _on_connection_close(self, closing: Any) -> None:
        # Lost: the next attempt goes to the next node (this one may be gone for good, and
        # a dead host can take a whole connect timeout to refuse).
        if not (self._close_called or self.is_closed):
            self._advance()
        await super()._on_connection_close(closing)

    async def _RobustConnection__connect_transport(self) -> None:
        attempt = getattr(super(), _ATTEMPT)
        for tried in range(len(self._urls)):
            try:
                await attempt()
                return
            except Exception as exc:
                if tried == len(self._urls) - 1:
                    raise
                log.warning("broker at %s not reachable (%s); trying the next URL",
                            self.endpoint, exc)
                self._advance()


async def connect_failover(urls: list[str], timeout: float | None = None,
                           **kwargs: Any) -> FailoverConnection:
    """A started FailoverConnection over `urls`; `timeout` bounds each attempt on one URL,
    kwargs are connection parameters (heartbeat, reconnect_interval, client_properties).
    Raises as aio_pika.connect_robust does when no URL answers in the first round."""
    connection = FailoverConnection(URL(urls[0]), urls=urls, **kwargs)
    await connection.connect(timeout=timeout)
    return connection
