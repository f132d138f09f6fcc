"""X-Timeout-Ms (gateway.calls.model_call.timeout_ms): plain ASCII digits, once, within the range.

The header is read as the server hands it over, so the direct tests build a request
from an ASGI scope (any whitespace left in a value there is refused); the wire tests send
it to uvicorn's httptools protocol (the gateway's), which strips the spaces and tabs HTTP
allows around a value (RFC 9110 5.5) before the check, and nothing else.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import orjson
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.calls.model_call import timeout_ms
from tasks.errors import ShoalError
from tests.stack import free_port, wait_for

SETTINGS = SimpleNamespace(default_timeout_ms=30_000, max_timeout_ms=300_000)
READ_TIMEOUT_S = 10  # a socket read that waits longer than this is a failed test


def _request(*values: str) -> Request:
    app = SimpleNamespace(state=SimpleNamespace(settings=SETTINGS))
    headers = [(b"x-timeout-ms", v.encode()) for v in values]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers,
                    "app": app})


def _refusal(*values: str) -> str:
    with pytest.raises(ShoalError) as raised:
        timeout_ms(_request(*values))
    assert raised.value.status == 422
    assert raised.value.body()["error"]["code"] == "VALIDATION_ERROR"
    return raised.value.body()["error"]["message"]


@pytest.mark.parametrize("value", ["100", "1", "300000", "007"])
def test_plain_digits_in_range_are_the_deadline(value: str) -> None:
    assert timeout_ms(_request(value)) == int(value)


def test_no_header_is_the_default() -> None:
    assert timeout_ms(_request()) == SETTINGS.default_timeout_ms


@pytest.mark.parametrize("value", ["+100", " 100", "100 ", " 100 ", "\t100", "1_000", "1e3",
                                   "-5", "100.0", "0x10", "", "soon", "\u0661\u0660\u0660",
                                   "\u00b9\u00b2"])
def test_anything_but_plain_digits_is_a_422(value: str) -> None:
    message = _refusal(value)
    assert "plain digits" in message and "X-Timeout-Ms" in message


@pytest.mark.parametrize("value", ["0", "300001", "9" * 19, "9" * 5000])
def test_digits_out_of_range_are_a_422(value: str) -> None:
    assert _refusal(value) == "X-Timeout-Ms must be between 1 and 300000"


@pytest.mark.parametrize("values", [("100", "100"), ("100", "200"), ("100", "+1", "x")])
def test_the_header_sent_more_than_once_is_a_422(values: tuple[str, ...]) -> None:
    assert _refusal(*values) == f"X-Timeout-Ms was sent {len(values)} times; send it once"


# --- on the wire: what HTTP strips before the check ------------------------------------------


async def _deadline(request: Request) -> Response:
    try:
        return JSONResponse({"ms": timeout_ms(request)})
    except ShoalError as exc:
        return JSONResponse(exc.body(), status_code=exc.status)


class _Server(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # a thread cannot; the test process keeps its own
        pass


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    app = Starlette(routes=[Route("/", _deadline, methods=["POST"])])
    app.state.settings = SETTINGS
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, http="httptools",
                            loop="none", lifespan="off", log_level="warning")
    server = _Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    wait_for(lambda: server.started, 10, "the test server to start")
    yield port
    server.should_exit = True
    thread.join(10)


def _post(port: int, header_lines: bytes) -> tuple[int, dict]:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(READ_TIMEOUT_S)
        sock.sendall(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\nConnection: close"
                     b"\r\n" + header_lines + b"\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    return int(head.split()[1]), orjson.loads(body)


@pytest.mark.parametrize(("line", "status"), [
    (b"X-Timeout-Ms: 100\r\n", 200),
    (b"X-Timeout-Ms:100\r\n", 200),
    (b"X-Timeout-Ms: \t 100 \t\r\n", 200),  # HTTP's own whitespace around a value
    (b"X-Timeout-Ms: 1 00\r\n", 422),
    (b"X-Timeout-Ms: +100\r\n", 422),
    (b"X-Timeout-Ms: 1_000\r\n", 422),
    (b"X-Timeout-Ms: 100\r\nX-Timeout-Ms: 100\r\n", 422),
    (b"X-Timeout-Ms: 100\r\nx-timeout-ms: 200\r\n", 422),
])
def test_the_header_on_the_wire(port: int, line: bytes, status: int) -> None:
    got, body = _post(port, line)
    assert got == status, body
    if status == 200:
        assert body == {"ms": 100}
    else:
        assert body["error"]["code"] == "VALIDATION_ERROR"
