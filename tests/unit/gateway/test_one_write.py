"""gateway.edge.one_write: a response of known length leaves in one write.

uvicorn's own request cycle writes to a real socket transport (a socketpair) through
`HeldHeaders`; `_Writes` only counts the writes on their way to it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import pytest
from starlette.responses import JSONResponse, Response, StreamingResponse
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from gateway.edge.one_write import HeldHeaders


class _Writes:
    """The real transport, with each write recorded as it passes."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        self.transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


async def _serve(app: Any, method: str = "GET") -> tuple[list[bytes], bytes]:
    """Run `app` for one request through uvicorn's cycle: the writes, and what arrived."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, ours)
    writes = _Writes(transport)  # type: ignore[arg-type]
    scope = {"type": "http", "method": method, "path": "/", "headers": [],
             "http_version": "1.1", "query_string": b"", "root_path": "", "scheme": "http",
             "server": None, "client": None, "asgi": {"version": "3.0"}}
    done = asyncio.Event()
    cycle = RequestResponseCycle(
        scope=scope, transport=writes, flow=FlowControl(transport),  # type: ignore[arg-type]
        logger=logging.getLogger("test"), access_logger=logging.getLogger("test"),
        access_log=False, default_headers=[], message_event=asyncio.Event(),
        expect_100_continue=False, keep_alive=True, on_response=done.set)
    held = HeldHeaders(writes, cycle)  # type: ignore[arg-type]
    cycle.transport = held  # type: ignore[assignment]
    cycle.more_body = False
    await cycle.run_asgi(app)
    await asyncio.wait_for(done.wait(), 5)
    held.flush()  # as EdgeProtocol.on_response_complete does
    transport.close()  # after what was written, buffered or not
    theirs.setblocking(False)
    arrived = b""
    while True:
        try:
            chunk = await loop.sock_recv(theirs, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        arrived += chunk
    theirs.close()
    return writes.writes, arrived


def test_a_json_response_is_one_write_with_its_headers_and_body() -> None:
    writes, arrived = asyncio.run(_serve(JSONResponse({"vectors": [1, 2, 3]})))
    assert len(writes) == 1
    assert writes[0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert writes[0].endswith(b'\r\n\r\n{"vectors":[1,2,3]}')
    assert arrived == writes[0]


@pytest.mark.parametrize(("response", "method"), [
    (Response(status_code=204), "GET"),
    (JSONResponse({"a": 1}), "HEAD"),
])
def test_a_response_without_a_body_write_still_sends_its_headers(response: Response,
                                                                 method: str) -> None:
    writes, arrived = asyncio.run(_serve(response, method))
    assert b"".join(writes) == arrived
    assert arrived.startswith(b"HTTP/1.1 ") and arrived.endswith(b"\r\n\r\n")


def test_a_stream_sends_its_headers_before_its_first_chunk() -> None:
    async def chunks():
        yield b"data: one\n\n"
        yield b"data: two\n\n"

    writes, arrived = asyncio.run(_serve(StreamingResponse(chunks(),
                                                           media_type="text/event-stream")))
    assert writes[0].startswith(b"HTTP/1.1 200 OK\r\n") and writes[0].endswith(b"\r\n\r\n")
    assert b"data: one" in writes[1]
    assert arrived == b"".join(writes)
