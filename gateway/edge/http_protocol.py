"""The gateway's HTTP edge: uvicorn's httptools protocol with the limits it lacks.

httptools (llhttp) buffers a header of any size, and uvicorn gives a connection
unlimited time to send its headers and body and admits any number of
connections: a slow or hostile client could hold memory and sockets without
bound. `EdgeProtocol` adds, per gateway process (SHOAL_GATEWAY_* settings):

- header bytes: the request line and headers are counted as they arrive; over
  SHOAL_GATEWAY_MAX_HEADER_BYTES the parser is fed no more, the client gets 431
  HEADERS_TOO_LARGE and the connection closes (memory: at most the limit plus
  one read, per connection);
- header time: from a connection's opening, or a request's first byte, to the
  end of its headers, SHOAL_GATEWAY_HEADER_TIMEOUT_S; then 408 REQUEST_TIMEOUT
  (a bare close if nothing came at all) and a close;
- body time: from the end of the headers to the end of the body,
  SHOAL_GATEWAY_BODY_TIMEOUT_S; then 408 and a close (the app, still waiting for
  the body, sees the client gone and answers nothing);
- connections: over SHOAL_GATEWAY_MAX_CONNECTIONS open ones, a new one is answered
  503 TOO_MANY_CONNECTIONS at once and closed, before anything is parsed.

A refusal that answers is not closed at once: the client is usually still sending
(the rest of its headers or body, or its request at the cap), and closing a socket
with unread bytes in its receive buffer sends a TCP reset, which most clients report
instead of the status they were sent. So after the answer the connection is
half-closed (the client reads the answer, then EOF) and what still comes is read and
discarded, until the client's EOF, DRAIN_MAX_BYTES or DRAIN_MAX_S, whichever is first;
at most DRAIN_MAX_CONNECTIONS drain at once per process, the others close at once.

Timers cost little: one per connection from its opening to its first headers,
then only for a request whose headers or body span several reads. Every refusal
is counted in shoal_gateway_edge_refusals_total{reason}, never logged (a hostile
client must not flood the log).

The hot routes (`POST /v1/embeddings`, `/v1/encode/{model}`, `/v1/score/{model}`) are
answered from this protocol's callbacks, without an ASGI task (`gateway.edge.hot_requests`
says which requests still go the ASGI way).

`shoal gateway` passes `http="gateway.edge.http_protocol:EdgeProtocol"` to uvicorn (a string: the
supervisor of several gateway processes pickles its config).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.edge.caller_left import caller_left
from gateway.edge.gateway_metrics import EDGE_REFUSALS
from gateway.edge.hot_requests import HotCycle, router_of, take
from gateway.edge.one_write import HeldHeaders
from gateway.edge.outer_middleware import EDGE_ANSWERED
from tasks.errors import STATUS_OF_CODE, ErrorCode, ShoalError

# A refused client still sending gets this long, and this many bytes, to finish before the
# close (see the module doc). 1 s: several round trips even on a slow link, for a client
# to finish a write in progress and read the answer, and short enough that a refused
# connection gives back its socket soon. 4 MiB: the rest of any header a client really
# sends (clients with a cookie jar or a token gone wrong send 1 MB ones, and write all of
# it before reading: stopping at 64 KiB reset them after their 431) or of a small body in
# flight; the bytes are discarded as they come (no memory), so a hostile client pushing
# them costs only the reads, and DRAIN_MAX_S still bounds the time.
DRAIN_MAX_S = 1.0
DRAIN_MAX_BYTES = 4 * 1024 * 1024
# Under a flood of refusals, each draining connection holds a socket for up to DRAIN_MAX_S:
# past this many at once in a process, a refusal closes at once as it used to (as it does
# with DRAIN_MAX_S at 0).
DRAIN_MAX_CONNECTIONS = 256

_PHRASES = {408: b"Request Timeout", 431: b"Request Header Fields Too Large",
            503: b"Service Unavailable"}


def canned_response(code: ErrorCode, message: str) -> bytes:
    """A whole HTTP/1.1 response with the native error body (the route may not be known
    yet) and x-should-retry as every error has it, closing the connection."""
    status = STATUS_OF_CODE[code]
    body = orjson.dumps({"error": {"code": str(code), "message": message}})
    retry = b"true" if ShoalError(code, message).retryable else b"false"
    return b"".join([
        b"HTTP/1.1 %d %s\r\n" % (status, _PHRASES[status]),
        b"content-type: application/json\r\n",
        b"content-length: %d\r\n" % len(body),
        b"x-should-retry: %s\r\n" % retry,
        b"connection: close\r\n\r\n",
        body,
    ])


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    max_header_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int

    @classmethod
    def from_settings(cls, settings: Any) -> EdgeLimits:
        return cls(settings.gateway_max_header_bytes, settings.gateway_header_timeout_s,
                   settings.gateway_body_timeout_s, settings.gateway_max_connections)

    def responses(self) -> dict[str, bytes]:
        return {
            "headers_too_large": canned_response(
                ErrorCode.HEADERS_TOO_LARGE, f"the request line and headers are over the "
                f"gateway's limit of {self.max_header_bytes} bytes"),
            "header_timeout": canned_response(
                ErrorCode.REQUEST_TIMEOUT, f"the request's headers did not arrive within "
                f"{self.header_timeout_s:g} s"),
            "body_timeout": canned_response(
                ErrorCode.REQUEST_TIMEOUT, f"the request's body did not arrive within "
                f"{self.body_timeout_s:g} s of its headers"),
            "connection_cap": canned_response(
                ErrorCode.TOO_MANY_CONNECTIONS, f"this gateway holds its limit of "
                f"{self.max_connections} connections; retry later"),
        }


class EdgeProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with header size, read time and connection limits."""

    # Read from the settings by the first connection of a process (or set by `configure`).
    limits: EdgeLimits | None = None
    _responses: dict[str, bytes] = {}
    draining: ClassVar[int] = 0  # connections of this process draining after a refusal

    @classmethod
    def configure(cls, limits: EdgeLimits) -> None:
        cls.limits = limits
        cls._responses = limits.responses()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if EdgeProtocol.limits is None:
            from tasks.settings import get_settings

            EdgeProtocol.configure(EdgeLimits.from_settings(get_settings()))
        self._limits: EdgeLimits = EdgeProtocol.limits  # type: ignore[assignment]
        self._reading_headers = True  # between requests, or inside a request's headers
        self._header_bytes = 0  # of the request being read, while _reading_headers
        self._started_message = False  # a request's first byte came, its headers have not
        self._tail = b""  # the last bytes of headers read so far: "\r\n\r\n" may span reads
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._refused = False  # answered (or closed) by the edge: nothing more is parsed
        self._drain_timer: asyncio.TimerHandle | None = None  # set while draining
        self._drain_left = 0  # bytes still accepted (and discarded) while draining
        # The app's hot routes, answered in this protocol's callbacks (gateway.edge.hot_requests)
        self._hot = router_of(self.app)

    # --- connections ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self._limits.max_connections:
            # Refused before it joins `connections`: uvicorn never waits for it.
            self.transport = transport
            self._refuse("connection_cap")
            return
        super().connection_made(transport)
        self._header_timer = self.loop.call_later(self._limits.header_timeout_s,
                                                  self._on_header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        self._cancel_body_timer()
        self._stop_draining()
        super().connection_lost(exc)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # The caller hung up before its answer: what waits for it releases the request
            # (gateway.edge.caller_left); uvicorn alone only tells a handler reading the body.
            caller_left(cycle.scope)
            if type(cycle) is HotCycle:
                cycle.lost()

    def _refuse(self, reason: str, answer: bool = True) -> None:
        EDGE_REFUSALS.labels(reason).inc()
        self._refused = True
        self._reading_headers = False  # nothing more is counted or fed
        self._cancel_header_timer()
        self._cancel_body_timer()
        if not answer:
            self.transport.close()
            return
        self.transport.write(self._responses[reason])
        if EdgeProtocol.draining >= DRAIN_MAX_CONNECTIONS or DRAIN_MAX_S <= 0:
            self.transport.close()
            return
        self._drain()

    # --- draining after a refusal -------------------------------------------------------------

    def _drain(self) -> None:
        """Half-close after the answer, then discard what comes, within the drain bounds."""
        EdgeProtocol.draining += 1
        self._drain_left = DRAIN_MAX_BYTES
        self._drain_timer = self.loop.call_later(DRAIN_MAX_S, self._end_drain)
        # A keep-alive timer left from an earlier response would cut the drain short.
        self._unset_keepalive_if_required()
        # The FIN follows the answer once it is flushed: a client that reads sees the answer,
        # then EOF. TLS cannot half-close; draining alone still avoids the reset there.
        if self.transport.can_write_eof():
            self.transport.write_eof()
        # uvicorn pauses reading for a body it holds unread or a pipelined request: the
        # drain must read, or the client's bytes would sit unread until the close (a reset).
        if self.flow is not None:
            self.flow.resume_reading()

    def _drain_received(self, data: bytes) -> None:
        self._drain_left -= len(data)
        if self._drain_left < 0:
            self._end_drain()

    def _end_drain(self) -> None:
        self._stop_draining()
        self.transport.close()

    def _stop_draining(self) -> None:
        if self._drain_timer is not None:
            self._drain_timer.cancel()
            self._drain_timer = None
            EdgeProtocol.draining -= 1

    # --- header bytes ---------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._refused:  # a read already on its way when the drain ended is dropped too
            if self._drain_timer is not None:
                self._drain_received(data)
            return
        # A read over the header budget is fed no further than the end of the headers
        # ("\r\n\r\n"): a body or pipelined requests after it are counted afresh (a loop,
        # not recursion: one read may hold thousands of small pipelined requests).
        if self._reading_headers and len(data) <= \
                self._limits.max_header_bytes - self._header_bytes:
            # The usual read: within the budget whatever it holds (a body or the start of
            # a pipelined request after the headers counts against this request's budget,
            # so a pipelined request may reach twice the limit: memory stays bounded).
            self._header_bytes += len(data)
            super().data_received(data)
            if not self._reading_headers:  # a body still to come: time it
                self._arm_timers()
            elif self._started_message:  # headers still unfinished: time them
                self._tail = (self._tail + data)[-3:]
                self._arm_timers()
            return
        while self._reading_headers and data:
            room = self._limits.max_header_bytes - self._header_bytes
            seen = self._tail + data
            end = seen.find(b"\r\n\r\n")
            if end < 0:
                if len(data) > room:
                    self._refuse("headers_too_large", answer=self._idle())
                    return
                self._header_bytes += len(data)
                self._tail = seen[-3:]
                super().data_received(data)
                self._arm_timers()
                return
            end += 4 - len(self._tail)  # where the headers end in `data`
            if end > room:
                self._refuse("headers_too_large", answer=self._idle())
                return
            self._header_bytes += end
            head, data = data[:end], data[end:]
            super().data_received(head)
            if self.transport.is_closing():
                return
            # Headers over (a message may have ended too), or a false end: start over.
            self._tail = b""
        if data:
            super().data_received(data)
        self._arm_timers()

    def _idle(self) -> bool:
        """No response is being written on this connection (a 431 or 408 may go out)."""
        return self.cycle is None or self.cycle.response_complete

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._started_message = True

    def on_headers_complete(self) -> None:
        self._reading_headers = False
        self._started_message = False
        self._tail = b""
        self._cancel_header_timer()
        if self._hot is not None and take(self, self._hot):
            return
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.transport is self.transport:
            cycle.transport = HeldHeaders(self.transport, cycle)  # gateway.edge.one_write

    def on_response_complete(self) -> None:
        cycle = self.cycle
        if cycle is not None and isinstance(cycle.transport, HeldHeaders):
            cycle.transport.flush()
        super().on_response_complete()

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if type(cycle) is HotCycle:
            cycle.on_body(body)
            return
        super().on_body(body)

    def on_message_complete(self) -> None:
        cycle = self.cycle
        if type(cycle) is HotCycle:
            cycle.on_message_complete()
        else:
            super().on_message_complete()
        self._cancel_body_timer()
        self._reading_headers = True
        self._header_bytes = 0
        self._tail = b""

    # --- read timers ------------------------------------------------------------------------

    def _arm_timers(self) -> None:
        """After a read: time the headers or the body that it left unfinished."""
        if self.transport.is_closing():
            return
        if self._reading_headers:
            if self._started_message and self._header_timer is None:
                self._header_timer = self.loop.call_later(self._limits.header_timeout_s,
                                                          self._on_header_timeout)
        elif self._body_timer is None and self.cycle is not None and self.cycle.more_body:
            self._body_timer = self.loop.call_later(self._limits.body_timeout_s,
                                                    self._on_body_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if not self._idle():
            # A pipelined request's headers trickle in while the one before is answered:
            # that answer is not cut short; the next one's time starts over.
            self._header_timer = self.loop.call_later(self._limits.header_timeout_s,
                                                      self._on_header_timeout)
            return
        # Nothing came (a connection opened and left idle): close without an answer.
        self._refuse("header_timeout", answer=self._started_message)

    def _on_body_timeout(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if self.transport.is_closing() or cycle is None or not cycle.more_body:
            return
        answer = not cycle.response_started
        if answer:
            # The app waits for the rest of the body: it now sees the client gone
            # (ClientDisconnect), answers nothing, and logs nothing (gateway.edge.outer_middleware).
            cycle.scope["state"][EDGE_ANSWERED] = True
        cycle.disconnected = True
        cycle.message_event.set()
        self._refuse("body_timeout", answer=answer)
