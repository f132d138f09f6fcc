"""The HTTP edge of a real `shoal gateway` process under hostile clients, and its drain.

Each test runs a gateway of its own (a private queue prefix, short limits in its env):
oversized headers get 431 and cost it no memory, slow headers and bodies are closed
within their read timeout, connections over the cap are refused (each refusal read by a
client still sending its request, not lost to a reset), an aborted upload is
one log line and a metric, and on SIGTERM the requests in flight get their answers
while new connections are refused and the process exits within the grace.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import signal
import socket
from pathlib import Path

import httpx
import orjson

from tests.conftest import MINILM
from tests.stack import http_status, metric_sum, private_stack, queue_counts, wait_for

ENCODE = {"items": [{"text": "x"}]}
SIM = {"SHOAL_RUNTIME": "sim", "SHOAL_SIM_COST_A_MS": "0", "SHOAL_SIM_COST_B_US": "0",
       "SHOAL_SIM_COST_C_NS": "0"}
TIMEOUT_S = 1.0  # the gateway's header and body read timeouts here
MARGIN_S = 10.0  # how much later than its timeout a close may come on this loaded machine
EDGE = {"SHOAL_GATEWAY_HEADER_TIMEOUT_S": str(TIMEOUT_S),
        "SHOAL_GATEWAY_BODY_TIMEOUT_S": str(TIMEOUT_S),
        "SHOAL_GATEWAY_MAX_CONNECTIONS": "32",
        "SHOAL_GATEWAY_KEEP_ALIVE_S": "120"}


def _ready(url: str, stack) -> None:
    wait_for(lambda: http_status(f"{url}/readyz") == 200, 60, "the gateway to be ready",
             give_up=stack.exited)


def _connect(port: int, timeout: float = TIMEOUT_S + MARGIN_S) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(timeout)  # a read that waits longer fails the test
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the gateway sends until it closes the connection (socket.timeout if it
    does not close within the socket's timeout)."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def _read_clean(sock: socket.socket) -> bytes:
    """Everything the gateway sends until its EOF; a reset raises (fails the test)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _status_and_body(response: bytes) -> tuple[int, dict]:
    head, body = response.split(b"\r\n\r\n", 1)
    return int(head.split()[1]), orjson.loads(body)


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_the_edge_limits_of_a_gateway_process(tmp_path: Path) -> None:
    with private_stack(tmp_path, "edge", MINILM) as private:
        gateway = private.stack.gateway("edge-gateway", private.port, [MINILM],
                                        SHOAL_QUEUE_PREFIX=private.prefix, **EDGE)
        _ready(private.url, private.stack)
        port = private.port

        # Oversized headers: 431 with the error body...
        with _connect(port) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 100_000)
            assert _status_and_body(_read_until_closed(sock)) == (431, {"error": {
                "code": "HEADERS_TOO_LARGE", "message": "the request line and headers are "
                "over the gateway's limit of 16384 bytes"}})
        # ...and no memory held for them: eight clients that try to send 8 MB each.
        rss = _rss_bytes(gateway.pid)
        for _ in range(8):
            with _connect(port) as sock, contextlib.suppress(BrokenPipeError,
                                                             ConnectionResetError):
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Big: ")
                sock.sendall(b"a" * (8 * 1024 * 1024))  # refused long before its end
                _read_until_closed(sock)
        assert metric_sum(f"{private.url}/metrics", "shoal_gateway_edge_refusals_total") == 9
        assert _rss_bytes(gateway.pid) - rss < 32 * 1024 * 1024

        # A 64 KB header sent slowly, until the answer comes: the client reads its 431
        # and then EOF, not a reset (the gateway drains what it still sends).
        with _connect(port) as sock:
            request = b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 65536
            for start in range(0, len(request), 1024):
                sock.sendall(request[start:start + 1024])  # a reset here fails the test
                if select.select([sock], [], [], 0.005)[0]:  # the wait ends at the answer
                    break
            status, body = _status_and_body(_read_clean(sock))
            assert (status, body["error"]["code"]) == (431, "HEADERS_TOO_LARGE")

        # Slow headers: 408 and a close within the timeout (the read times out otherwise).
        with _connect(port) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n")
            status, body = _status_and_body(_read_until_closed(sock))
            assert (status, body["error"]["code"]) == (408, "REQUEST_TIMEOUT")

        # A body declared 1,000 bytes that sends 40: 408 and a close, not a wait forever.
        with _connect(port) as sock:
            sock.sendall(b"POST /v1/encode/" + MINILM.encode() + b" HTTP/1.1\r\nHost: t\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                         + b" " * 40)
            status, body = _status_and_body(_read_until_closed(sock))
            assert (status, body["error"]["code"]) == (408, "REQUEST_TIMEOUT")

        # The connection cap: 32 open (each served once, then kept alive), the 33rd refused.
        held = []
        try:
            for _ in range(32):
                sock = _connect(port)
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
                assert sock.recv(65536).startswith(b"HTTP/1.1 200")
                held.append(sock)
            encode = orjson.dumps(ENCODE)
            for _ in range(3):  # requests written before any read, as clients do
                with _connect(port) as sock:
                    sock.sendall(b"POST /v1/encode/" + MINILM.encode() + b" HTTP/1.1\r\n"
                                 b"Host: t\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(encode), encode))
                    status, body = _status_and_body(_read_clean(sock))
                    assert (status, body["error"]["code"]) == (503, "TOO_MANY_CONNECTIONS")
        finally:
            for sock in held:
                sock.close()
        wait_for(lambda: http_status(f"{private.url}/healthz") == 200, 10,
                 "the gateway to accept connections again")

        # Aborted uploads: one warning line each, no traceback, counted.
        for _ in range(20):
            with _connect(port) as sock:
                sock.sendall(b"POST /v1/encode/" + MINILM.encode() + b" HTTP/1.1\r\n"
                             b"Host: t\r\nContent-Length: 100000\r\n\r\n{\"items\"")
        wait_for(lambda: metric_sum(f"{private.url}/metrics",
                                    "shoal_gateway_client_disconnects_total") == 20,
                 10 + MARGIN_S, "the aborted uploads to be counted")
        log = gateway.log()
        assert "Traceback" not in log
        assert log.count("disconnected before its body was read") == 20


def test_sigterm_answers_what_is_in_flight_refuses_new_connections_and_exits(
        tmp_path: Path) -> None:
    grace_s = 120  # a worker starts within it on this loaded machine
    with private_stack(tmp_path, "drain", MINILM) as private:
        url, stack = private.url, private.stack
        gateway = stack.gateway("drain-gateway", private.port, [MINILM],
                                SHOAL_QUEUE_PREFIX=private.prefix,
                                SHOAL_GATEWAY_UNSERVED="wait",
                                SHOAL_SHUTDOWN_GRACE_S=str(grace_s),
                                SHOAL_GATEWAY_DRAIN_DELAY_S="4")
        _ready(url, stack)

        async def drain() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=grace_s) as client:
                # No worker yet: the requests are published and wait in the queue.
                calls = [asyncio.create_task(client.post(
                    f"{url}/v1/encode/{MINILM}", json={"items": [{"text": f"t{i}"}]},
                    headers={"x-timeout-ms": str(grace_s * 1000)})) for i in range(3)]
                await asyncio.to_thread(wait_for, lambda: queue_counts(private.queue)[0] >= 1,
                                        30, "the requests to be queued")
                gateway.kill(signal.SIGTERM)
                # While the drain delay lasts, /readyz says so (a load balancer stops)...
                await asyncio.to_thread(wait_for, lambda: http_status(f"{url}/readyz") == 503,
                                        4, "/readyz to answer 503 while draining")
                # ...then new connections are refused,
                await asyncio.to_thread(wait_for, lambda: _refused(private.port), 30,
                                        "new connections to be refused")
                assert not any(call.done() for call in calls)
                # and the requests in flight are answered once a worker serves them.
                stack.worker(f"drain-{private.prefix[-8:]}", [MINILM],
                             SHOAL_QUEUE_PREFIX=private.prefix, **SIM)
                return await asyncio.gather(*calls)

        responses = asyncio.run(drain())
        assert [r.status_code for r in responses] == [200, 200, 200], \
            [r.text for r in responses]
        gateway.proc.wait(grace_s)  # exits within the grace (TimeoutExpired otherwise)
        assert "Traceback" not in gateway.log()


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def test_a_request_still_in_flight_when_the_grace_runs_out_gets_503(tmp_path: Path) -> None:
    with private_stack(tmp_path, "grace", MINILM) as private:
        url, stack = private.url, private.stack
        gateway = stack.gateway("grace-gateway", private.port, [MINILM],
                                SHOAL_QUEUE_PREFIX=private.prefix,
                                SHOAL_GATEWAY_UNSERVED="wait", SHOAL_SHUTDOWN_GRACE_S="2")
        _ready(url, stack)

        async def cut_short() -> httpx.Response:
            async with httpx.AsyncClient(timeout=60) as client:
                call = asyncio.create_task(client.post(
                    f"{url}/v1/encode/{MINILM}", json=ENCODE,
                    headers={"x-timeout-ms": "60000"}))
                await asyncio.to_thread(wait_for, lambda: queue_counts(private.queue)[0] >= 1,
                                        30, "the request to be queued")
                gateway.kill(signal.SIGTERM)  # no worker will ever answer it
                return await call

        response = asyncio.run(cut_short())
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "SHUTTING_DOWN"
        assert response.headers["retry-after"] == "1"
        gateway.proc.wait(30)
        assert "Traceback" not in gateway.log()
