"""A response with a known length leaves in one write: its headers wait for its body.

uvicorn writes a response's status line and headers when the app sends
`http.response.start`, and its body when it sends `http.response.body`: two `write`
system calls per response, two TCP segments, and two reads for the client. For a
response whose length is known (a `content-length`, which every JSON answer has) the
body follows at once, so `HeldHeaders` stands between the request's cycle and its
transport and holds the headers until the body's first write, then writes both as one.
Anything else a cycle asks of the transport (close, is_closing, ...) writes what is held
first; so does the end of the response (`flush`, called when it completes: a HEAD or
204 response has no body write). A chunked response (a stream) is written as it comes:
its headers must reach the client before its first event.
"""

from __future__ import annotations

import asyncio
from typing import Any


class HeldHeaders:
    """The transport a request's cycle writes to (see the module doc)."""

    __slots__ = ("_cycle", "_held", "transport")

    def __init__(self, transport: asyncio.Transport, cycle: Any) -> None:
        self.transport = transport
        self._cycle = cycle
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self.transport.write(held + data)
            return
        cycle = self._cycle
        # The headers' write: after `response_started`, with the length known and a body
        # to come (a HEAD's or 204's never comes).
        if (cycle.response_started and cycle.chunked_encoding is False
                and cycle.expected_content_length > 0 and not cycle.response_complete
                and cycle.scope["method"] != "HEAD"):
            self._held = data
            return
        self.transport.write(data)

    def flush(self) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self.transport.write(held)

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.transport, name)
        if not callable(attribute):
            return attribute

        def flushed_first(*args: Any, **kwargs: Any) -> Any:
            self.flush()
            return attribute(*args, **kwargs)

        return flushed_first
