"""The HTTP edge's limits (gateway.edge.http_protocol), the request-id middleware, safe error
messages.

The protocol runs in a real uvicorn server (a thread of this process, on a free port)
serving a small Starlette app behind the gateway's own RequestIdMiddleware; the tests
speak raw HTTP/1.1 over sockets, as a hostile client would. The refusals that drain
are also run on a uvloop server, the loop `shoal gateway` runs.
"""

from __future__ import annotations

import asyncio
import select
import socket
import threading
from collections.abc import Iterator

import orjson
import pytest
import uvicorn
import uvloop
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from gateway.edge import http_protocol as edge
from gateway.edge.gateway_metrics import (
    CLIENT_DISCONNECTS,
    EDGE_REFUSALS,
    REQUESTS,
    UNEXPECTED_ERRORS,
)
from gateway.edge.http_protocol import EdgeLimits, EdgeProtocol
from gateway.edge.outer_middleware import RequestIdMiddleware, request_id_of
from tasks.render import names, shown
from tests.stack import free_port, wait_for

LIMITS = EdgeLimits(max_header_bytes=2048, header_timeout_s=0.5, body_timeout_s=0.5,
                    max_connections=8)
READ_TIMEOUT_S = 10  # a socket read that waits longer than this is a failed test


async def _echo(request: Request) -> Response:
    body = await request.body()
    return PlainTextResponse(f"{len(body)}")


async def _boom(request: Request) -> Response:
    raise RuntimeError("a bug")


def _app() -> Starlette:
    app = Starlette(routes=[Route("/echo", _echo, methods=["GET", "POST"]),
                            Route("/boom", _boom, methods=["GET"])])
    app.add_middleware(RequestIdMiddleware)
    return app


class _Server(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # a thread cannot; the test process keeps its own
        pass


LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, tuple[int, _Server]]]:
    """One test server per event loop: {loop: (port, server)}."""
    EdgeProtocol.configure(LIMITS)
    running: dict[str, tuple[int, _Server]] = {}
    threads = []
    for name, new_loop in LOOPS.items():
        port = free_port()
        config = uvicorn.Config(_app(), host="127.0.0.1", port=port, http=EdgeProtocol,
                                loop="none", lifespan="off", log_level="warning",
                                timeout_keep_alive=5)
        server = _Server(config)

        def serve(server: _Server = server, new_loop=new_loop) -> None:
            with asyncio.Runner(loop_factory=new_loop) as runner:
                runner.run(server.serve())

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        wait_for(lambda server=server: server.started, 10, f"the {name} test server to start")
        running[name] = (port, server)
        threads.append(thread)
    yield running
    for _, server in running.values():
        server.should_exit = True
    for thread in threads:
        thread.join(10)
    EdgeProtocol.limits = None


@pytest.fixture(scope="module")
def port(servers: dict[str, tuple[int, _Server]]) -> int:
    return servers["asyncio"][0]


@pytest.fixture(params=sorted(LOOPS))
def server(request: pytest.FixtureRequest,
           servers: dict[str, tuple[int, _Server]]) -> tuple[int, _Server]:
    """A test server on each loop, with no connection open or draining from a test before."""
    port, server = servers[request.param]
    wait_for(lambda: not server.server_state.connections and EdgeProtocol.draining == 0, 10,
             "the connections of earlier tests to close")
    return port, server


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    _BUFFERS.pop(sock.fileno(), None)
    sock.settimeout(READ_TIMEOUT_S)
    return sock


_BUFFERS: dict[int, bytes] = {}  # per socket: bytes read past the last response


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response (Content-Length framed); (0, {}, b"") when the server closed first."""
    data = _BUFFERS.pop(sock.fileno(), b"")
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return 0, {}, b""
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    length = int(headers.get("content-length", 0))
    while len(body) < length:
        body += sock.recv(65536)
    _BUFFERS[sock.fileno()] = body[length:]
    return int(lines[0].split()[1]), headers, body[:length]


def _closed(sock: socket.socket) -> bool:
    """True once the server closed the connection (EOF or reset)."""
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


def _get(path: str, extra: bytes = b"") -> bytes:
    return b"GET " + path.encode() + b" HTTP/1.1\r\nHost: t\r\n" + extra + b"\r\n"


def _counter(counter, *labels: str) -> float:
    return counter.labels(*labels)._value.get()


# --- header size ---------------------------------------------------------------------------


def test_headers_over_the_limit_get_431_with_the_error_body_and_a_close(port: int) -> None:
    before = _counter(EDGE_REFUSALS, "headers_too_large")
    with _connect(port) as sock:
        sock.sendall(_get("/echo", b"X-Big: " + b"a" * 100_000 + b"\r\n"))
        status, headers, body = _read_response(sock)
        assert status == 431
        assert headers["connection"] == "close"
        assert orjson.loads(body)["error"]["code"] == "HEADERS_TOO_LARGE"
        assert _closed(sock)
    assert _counter(EDGE_REFUSALS, "headers_too_large") == before + 1


def test_headers_arriving_in_pieces_are_counted_together(port: int) -> None:
    with _connect(port) as sock:
        sock.sendall(_get("/echo")[:-2])  # the headers, not their end
        for _ in range(4):
            sock.sendall(b"X-Piece: " + b"a" * 600 + b"\r\n")
        status, _, body = _read_response(sock)
        assert status == 431, body


def test_headers_just_under_the_limit_pass(port: int) -> None:
    request = _get("/echo", b"X-Pad: ")
    pad = LIMITS.max_header_bytes - len(request) - 2
    with _connect(port) as sock:
        sock.sendall(_get("/echo", b"X-Pad: " + b"a" * pad + b"\r\n"))
        status, _, _ = _read_response(sock)
        assert status == 200


def test_a_body_sent_with_its_headers_is_not_counted_as_headers(port: int) -> None:
    body = b"x" * 200_000
    with _connect(port) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
        status, _, answer = _read_response(sock)
        assert (status, answer) == (200, str(len(body)).encode())


def test_pipelined_requests_are_each_counted_afresh(port: int) -> None:
    one = _get("/echo", b"X-Pad: " + b"a" * 1500 + b"\r\n")
    with _connect(port) as sock:
        sock.sendall(one * 3)  # 3 x ~1.5 KB in one write: each under the 2 KB limit
        assert [_read_response(sock)[0] for _ in range(3)] == [200, 200, 200]


def test_many_small_pipelined_requests_in_one_write_are_served(port: int) -> None:
    with _connect(port) as sock:
        sock.sendall(_get("/echo") * 500)
        assert {_read_response(sock)[0] for _ in range(500)} == {200}


def test_the_end_of_the_headers_split_across_reads_is_found(port: int) -> None:
    with _connect(port) as sock:
        request = _get("/echo", b"X-Pad: " + b"a" * 1900 + b"\r\n")
        sock.sendall(request[:-1])
        # Without the last "\n" the headers are not over: nothing is answered yet.
        sock.settimeout(0.2)
        with pytest.raises(TimeoutError):
            sock.recv(1)
        sock.settimeout(READ_TIMEOUT_S)
        sock.sendall(request[-1:])
        assert _read_response(sock)[0] == 200


def test_a_large_body_after_headers_that_ended_across_reads_is_served(port: int) -> None:
    body = b"x" * 100_000
    head = b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\nX-Pad: %s\r\n\r\n" % (
        len(body), b"a" * 1500)
    with _connect(port) as sock:
        sock.sendall(head[:-1])  # "...\r\n\r": the headers' end comes with the body
        sock.settimeout(0.2)
        with pytest.raises(TimeoutError):
            sock.recv(1)
        sock.settimeout(READ_TIMEOUT_S)
        sock.sendall(head[-1:] + body)  # one write over the header budget
        status, _, answer = _read_response(sock)
        assert (status, answer) == (200, str(len(body)).encode())


# --- read timeouts ---------------------------------------------------------------------------


def test_slow_headers_get_408_and_a_close(port: int) -> None:
    before = _counter(EDGE_REFUSALS, "header_timeout")
    with _connect(port) as sock:
        sock.sendall(b"GET /echo HTTP/1.1\r\nHost: t\r\n")  # and never the blank line
        status, _, body = _read_response(sock)
        assert status == 408
        assert orjson.loads(body)["error"]["code"] == "REQUEST_TIMEOUT"
        assert _closed(sock)
    assert _counter(EDGE_REFUSALS, "header_timeout") == before + 1


def test_a_connection_that_sends_nothing_is_closed(port: int) -> None:
    with _connect(port) as sock:
        assert _closed(sock)  # within the header timeout, else the read times out


def test_slow_headers_on_a_kept_alive_connection_get_408(port: int) -> None:
    with _connect(port) as sock:
        sock.sendall(_get("/echo"))
        assert _read_response(sock)[0] == 200
        sock.sendall(b"GET /echo HTTP/1.1\r\n")
        assert _read_response(sock)[0] == 408


def test_a_slow_body_gets_408_and_the_app_logs_no_disconnect(port: int) -> None:
    before = _counter(EDGE_REFUSALS, "body_timeout")
    disconnects = _counter(CLIENT_DISCONNECTS, "other")
    with _connect(port) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n"
                     + b"x" * 40)
        status, _, body = _read_response(sock)
        assert status == 408
        assert "body" in orjson.loads(body)["error"]["message"]
        assert _closed(sock)
    assert _counter(EDGE_REFUSALS, "body_timeout") == before + 1
    assert _counter(CLIENT_DISCONNECTS, "other") == disconnects


# --- connections -------------------------------------------------------------------------------


def test_connections_over_the_cap_get_503_at_once(port: int) -> None:
    before = _counter(EDGE_REFUSALS, "connection_cap")
    held: list[socket.socket] = []
    try:
        for _ in range(LIMITS.max_connections):
            sock = _connect(port)
            sock.sendall(_get("/echo"))
            assert _read_response(sock)[0] == 200  # open, and counted by the server
            held.append(sock)
        with _connect(port) as over:
            status, _, body = _read_response(over)
            assert status == 503
            assert orjson.loads(body)["error"]["code"] == "TOO_MANY_CONNECTIONS"
        assert _counter(EDGE_REFUSALS, "connection_cap") == before + 1
    finally:
        for sock in held:
            sock.close()

    def served() -> bool:
        with _connect(port) as sock:
            sock.sendall(_get("/echo"))
            return _read_response(sock)[0] == 200

    wait_for(served, 10, "a connection to be served once the others closed")


# --- refusals the client can read: half-close and drain -------------------------------------


def _send_slowly(sock: socket.socket, data: bytes, until_answered: bool,
                 piece: int = 1024, gap_s: float = 0.005) -> None:
    """Send `data` in pieces as a slow client does, with a wait between pieces that ends
    early when an answer is readable; with `until_answered`, stop sending then (else send
    it all, as clients that write the whole request before reading do). A send that fails
    (a reset) fails the test."""
    for start in range(0, len(data), piece):
        sock.sendall(data[start:start + piece])
        readable, _, _ = select.select([sock], [], [], gap_s)
        if readable and until_answered:
            return


def _eof(sock: socket.socket) -> bool:
    """True at a clean EOF after the answer; a reset raises (and fails the test)."""
    return sock.recv(65536) == b""


@pytest.fixture
def long_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    # The tests below are about the answer reaching the client, not the drain's time bound:
    # a loaded machine must not end a drain before a paced client has sent its request.
    monkeypatch.setattr(edge, "DRAIN_MAX_S", 30.0)


@pytest.mark.parametrize("until_answered", [True, False])
def test_a_64_kb_header_sent_slowly_reads_its_431_before_the_close(
        server: tuple[int, _Server], until_answered: bool, long_drain: None) -> None:
    port, _ = server
    request = _get("/echo", b"X-Big: " + b"a" * (64 * 1024) + b"\r\n")
    with _connect(port) as sock:
        _send_slowly(sock, request, until_answered)
        status, headers, body = _read_response(sock)
        assert (status, headers["connection"]) == (431, "close")
        assert orjson.loads(body)["error"]["code"] == "HEADERS_TOO_LARGE"
        assert _eof(sock)


def test_a_1_mb_header_still_being_sent_gets_its_431_not_a_reset(
        server: tuple[int, _Server], long_drain: None) -> None:
    # A client that goes on writing its request after the answer came, as clients that
    # write the whole request before reading do. The edge
    # stops parsing at its limit but must read (and discard) the rest, or the close with
    # unread bytes resets the connection and the client never sees the 431.
    port, _ = server
    request = _get("/echo", b"X-Big: " + b"a" * (1024 * 1024) + b"\r\n")
    with _connect(port) as sock:
        _send_slowly(sock, request, until_answered=False, piece=16 * 1024)
        status, headers, body = _read_response(sock)
        assert (status, headers["connection"]) == (431, "close")
        assert orjson.loads(body)["error"]["code"] == "HEADERS_TOO_LARGE"
        assert _eof(sock)


def test_a_request_at_the_connection_cap_reads_its_503_before_the_close(
        server: tuple[int, _Server], long_drain: None) -> None:
    port, _ = server
    held: list[socket.socket] = []
    try:
        for _ in range(LIMITS.max_connections):
            sock = _connect(port)
            sock.sendall(_get("/echo"))
            assert _read_response(sock)[0] == 200
            held.append(sock)
        for _ in range(3):  # as a client does: the request written before any read
            with _connect(port) as over:
                over.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 20000"
                             b"\r\n\r\n" + b"x" * 20_000)
                status, _, body = _read_response(over)
                assert status == 503
                assert orjson.loads(body)["error"]["code"] == "TOO_MANY_CONNECTIONS"
                assert _eof(over)
    finally:
        for sock in held:
            sock.close()


def test_a_slow_body_reads_its_408_while_still_sending(server: tuple[int, _Server],
                                                      long_drain: None) -> None:
    port, _ = server
    with _connect(port) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 100000\r\n\r\n"
                     + b"x" * 40)
        # Nothing more until the 408 is readable, then the rest of the body regardless.
        readable, _, _ = select.select([sock], [], [], READ_TIMEOUT_S)
        assert readable, "no 408 within the read timeout"
        _send_slowly(sock, b"x" * 60_000, until_answered=False)
        status, _, body = _read_response(sock)
        assert status == 408
        assert "body" in orjson.loads(body)["error"]["message"]
        assert _eof(sock)


def test_the_drain_ends_at_its_byte_bound(server: tuple[int, _Server], long_drain: None,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(edge, "DRAIN_MAX_BYTES", 64 * 1024)  # the bound, not its size
    port, _ = server
    with _connect(port) as sock:
        sock.sendall(_get("/echo", b"X-Big: " + b"a" * 4096 + b"\r\n"))
        assert _read_response(sock)[0] == 431
        assert _eof(sock)
        wait_for(lambda: EdgeProtocol.draining == 1, 10, "the drain to start")
        # Past DRAIN_MAX_BYTES the server stops reading and closes: a send then fails.
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            for _ in range(4 * edge.DRAIN_MAX_BYTES // 4096 + 1000):
                sock.sendall(b"a" * 4096)
                select.select([], [], [], 0.001)  # lets the server's reset reach us
    wait_for(lambda: EdgeProtocol.draining == 0, 10, "the drain to end")


def test_the_drain_ends_at_its_time_bound_and_at_the_clients_close(
        server: tuple[int, _Server], monkeypatch: pytest.MonkeyPatch) -> None:
    port, _ = server
    monkeypatch.setattr(edge, "DRAIN_MAX_S", 0.2)
    with _connect(port) as sock:  # a client that neither sends nor closes
        sock.sendall(_get("/echo", b"X-Big: " + b"a" * 4096 + b"\r\n"))
        assert _read_response(sock)[0] == 431
        assert _eof(sock)
        wait_for(lambda: EdgeProtocol.draining == 0, 10, "the drain to time out")
    monkeypatch.setattr(edge, "DRAIN_MAX_S", 30.0)
    with _connect(port) as sock:  # a client that closes once it has read the answer
        sock.sendall(_get("/echo", b"X-Big: " + b"a" * 4096 + b"\r\n"))
        assert _read_response(sock)[0] == 431
        wait_for(lambda: EdgeProtocol.draining == 1, 10, "the drain to start")
    wait_for(lambda: EdgeProtocol.draining == 0, 10, "the drain to end at the client's EOF")


def test_past_the_drain_cap_a_refusal_answers_and_closes_at_once(
        server: tuple[int, _Server], monkeypatch: pytest.MonkeyPatch) -> None:
    port, _ = server
    monkeypatch.setattr(edge, "DRAIN_MAX_CONNECTIONS", 0)  # as if 256 were draining
    with _connect(port) as sock:
        sock.sendall(_get("/echo", b"X-Big: " + b"a" * 4096 + b"\r\n"))
        assert _read_response(sock)[0] == 431
        assert _closed(sock)
    assert EdgeProtocol.draining == 0


# --- the middleware: unexpected errors, disconnects, request ids ---------------------------


def test_an_unexpected_error_is_a_counted_500_with_the_error_body_on_a_kept_connection(
        port: int) -> None:
    counted = _counter(REQUESTS, "other", "500")
    unexpected = _counter(UNEXPECTED_ERRORS, "other")
    with _connect(port) as sock:
        sock.sendall(_get("/boom"))
        status, headers, body = _read_response(sock)
        assert status == 500
        assert orjson.loads(body) == {"error": {"code": "INTERNAL", "message":
                                                "internal error; see the gateway's log"}}
        assert headers.get("connection") != "close"
        sock.sendall(_get("/echo"))  # the same connection serves the next request
        assert _read_response(sock)[0] == 200
    assert _counter(REQUESTS, "other", "500") == counted + 1
    assert _counter(UNEXPECTED_ERRORS, "other") == unexpected + 1


def test_a_client_that_leaves_mid_body_is_one_metric(port: int,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    before = _counter(CLIENT_DISCONNECTS, "other")
    with caplog.at_level("INFO"):
        with _connect(port) as sock:
            sock.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\nxx")
        wait_for(lambda: _counter(CLIENT_DISCONNECTS, "other") == before + 1, 10,
                 "the disconnect to be counted")
    lines = [r for r in caplog.records if "disconnected" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None


@pytest.mark.parametrize(("sent", "kept"), [
    (b"abc-123_x.y:z", True),
    (b"0" * 128, True),
    (b"0" * 129, False),
    (b"a b", False),
    (b"a\x01b", False),
    (b"\xc3\xa9t\xc3\xa9", False),
    (b"", False),
])
def test_request_ids_are_echoed_only_if_safe(sent: bytes, kept: bool) -> None:
    got = request_id_of([(b"x-request-id", sent)])
    assert (got == sent.decode("latin-1")) is kept
    assert len(got) <= 128 and got.isascii() and " " not in got


def test_an_unsafe_request_id_is_replaced_in_the_response(port: int) -> None:
    with _connect(port) as sock:
        sock.sendall(_get("/echo", b"X-Request-Id: <script>\r\n"))
        _, headers, _ = _read_response(sock)
        assert headers["x-request-id"] != "<script>"
        assert len(headers["x-request-id"]) == 32


# --- safe rendering --------------------------------------------------------------------------


def test_keys_of_mixed_types_are_listed() -> None:
    assert names({"b", b"a", "c"}) == "['b', 'c', b'a']"
    assert names(str(i) for i in range(40)).endswith("... (24 more)]")


def test_values_nested_deep_or_large_render_short() -> None:
    deep: list = []
    cursor = deep
    for _ in range(10_000):
        cursor.append([])
        cursor = cursor[0]
    assert shown(deep) == "[[[[...]]]]"
    assert len(shown("x" * 10**6)) < 100
    assert len(shown(b"x" * 10**6)) < 100
    assert shown({b"k": 1, "k": 2}) in ("{b'k': 1, 'k': 2}", "{'k': 2, b'k': 1}")
