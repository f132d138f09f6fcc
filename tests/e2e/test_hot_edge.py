"""The hot routes answered by the HTTP edge itself (gateway.edge.hot_requests), against the
same requests sent through the ASGI stack, on one real `shoal gateway` process.

A request with `Expect: 100-continue` goes the ASGI way (the module doc lists what does);
everything else about it is the same request, so each pair must get the same status,
the same headers in the same order (values compared where they do not vary from call
to call) and the same body. `shoal_gateway_edge_served_total` says which way each went.
"""

from __future__ import annotations

import socket
from pathlib import Path

import msgpack
import orjson

from tests.conftest import MINILM
from tests.stack import http_status, metric_sum, private_stack, wait_for

SIM = {"SHOAL_RUNTIME": "sim", "SHOAL_SIM_COST_A_MS": "0", "SHOAL_SIM_COST_B_US": "0",
       "SHOAL_SIM_COST_C_NS": "0"}
READ_TIMEOUT_S = 30
# Headers whose values differ from call to call (times, the date, the batch's size).
VARYING = {b"date", b"x-total-time-ms", b"x-queue-time-ms", b"x-inference-time-ms",
           b"x-batch-requests", b"x-shoal-trace", b"x-request-id"}
JSON = b"application/json"


def _request(path: str, body: bytes, kind: bytes = JSON, extra: bytes = b"") -> bytes:
    return (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: t\r\nContent-Type: " + kind
            + b"\r\nContent-Length: %d\r\n" % len(body) + extra + b"\r\n" + body)


def _read_response(sock: socket.socket, buffer: bytearray) -> tuple[int, list, bytes]:
    """One response off a keep-alive connection (a 100 Continue skipped)."""
    while True:
        while b"\r\n\r\n" not in buffer:
            chunk = sock.recv(65536)
            assert chunk, f"closed before a whole response: {bytes(buffer)!r}"
            buffer += chunk
        head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        headers = [tuple(line.split(b": ", 1)) for line in lines[1:]]
        buffer[:] = rest
        if status == 100:
            continue
        length = int(dict(headers)[b"content-length"])
        while len(buffer) < length:
            chunk = sock.recv(65536)
            assert chunk, "closed before the whole body"
            buffer += chunk
        body = bytes(buffer[:length])
        buffer[:] = buffer[length:]
        return status, headers, body


def _exchange(port: int, request: bytes) -> tuple[int, list, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT_S) as sock:
        sock.sendall(request)
        return _read_response(sock, bytearray())


def _comparable(response: tuple[int, list, bytes]) -> tuple:
    status, headers, body = response
    shown = [(name, None if name in VARYING else value) for name, value in headers]
    return status, shown, body


def _served(url: str) -> float:
    return metric_sum(f"{url}/metrics", "shoal_gateway_edge_served_total")


def test_the_edge_answers_the_hot_routes_as_the_asgi_stack_does(tmp_path: Path) -> None:
    with private_stack(tmp_path, "hotedge", MINILM) as private:
        url, port, stack = private.url, private.port, private.stack
        gateway = stack.gateway("hot-gateway", port, [MINILM], SHOAL_QUEUE_PREFIX=private.prefix)
        stack.worker(f"hot-{private.prefix[-8:]}", [MINILM],
                     SHOAL_QUEUE_PREFIX=private.prefix, **SIM)
        wait_for(lambda: http_status(f"{url}/readyz") == 200, 60, "the gateway to be ready",
                 give_up=stack.exited)
        encode = f"/v1/encode/{MINILM}"
        wait_for(lambda: _exchange(port, _request(encode, b'{"items":[{"text":"w"}]}'))[0]
                 == 200, 120, "the worker to serve the model", give_up=stack.exited)
        cases = [
            _request(encode, b'{"items":[{"text":"a"},{"text":"b c"}]}'),
            _request(encode, msgpack.packb({"items": [{"text": "a"}]}), b"application/msgpack"),
            _request(encode, b'{"items":[{"text":"a"}]}', extra=b"Accept: application/msgpack"
                     b"\r\nX-Request-Id: mine-1\r\nX-Shoal-Trace: 1\r\n"),
            _request("/v1/embeddings", orjson.dumps({"model": MINILM, "input": ["a", "b"]})),
            _request("/v1/embeddings", orjson.dumps({"model": MINILM, "input": "a",
                                                     "encoding_format": "base64"})),
            _request(f"/v1/encode/{MINILM}x", b'{"items":[{"text":"a"}]}'),  # 404
            _request("/v1/embeddings", orjson.dumps({"model": "nope", "input": "a"})),
            _request("/v1/embeddings", orjson.dumps({"model": MINILM, "input": ""})),  # 400
            _request(encode, b'{"items": [}'),  # 400 not JSON
            _request(encode, b"<x/>", b"application/xml"),  # 415
            _request(encode, b'{"items":[{"text":"a"}],"extra":1}'),  # 422 unknown field
            _request(encode, b'{"items":[{"text":"a"}]}', extra=b"X-Timeout-Ms: 1x\r\n"),
            _request(encode, b"x" * 2_000_000),  # 413 from its Content-Length
        ]
        before = _served(url)
        for request in cases:
            hot = _exchange(port, request)
            head, _, body = request.partition(b"\r\n\r\n")
            asgi = _exchange(port, head + b"\r\nExpect: 100-continue\r\n\r\n" + body)
            assert _comparable(hot) == _comparable(asgi), request[:200]
            assert dict(hot[1])[b"x-request-id"]  # echoed or assigned
        assert _served(url) - before == len(cases)  # the ASGI ones are not counted
        traced = _exchange(port, cases[2])[1]
        assert dict(traced)[b"x-request-id"] == b"mine-1"
        assert b"gateway_in=" in dict(traced)[b"x-shoal-trace"]

        # One keep-alive connection: a JSON body, a chunked one, an error, two pipelined
        # in one write (the second waits behind the first), then `Connection: close`.
        with socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT_S) as sock:
            buffer = bytearray()
            sock.sendall(cases[0])
            assert _read_response(sock, buffer)[0] == 200
            chunked = (b"POST " + encode.encode() + b" HTTP/1.1\r\nHost: t\r\nContent-Type: "
                       b"application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                       b"5\r\n{\"ite\r\n13\r\nms\":[{\"text\":\"a\"}]}\r\n0\r\n\r\n")
            sock.sendall(chunked)
            status, _, body = _read_response(sock, buffer)
            assert status == 200 and orjson.loads(body)["dims"] == 384
            sock.sendall(cases[5])
            assert _read_response(sock, buffer)[0] == 404
            sock.sendall(cases[0] + cases[3])
            assert [_read_response(sock, buffer)[0] for _ in range(2)] == [200, 200]
            head, _, body = cases[0].partition(b"\r\n\r\n")
            sock.sendall(head + b"\r\nConnection: close\r\n\r\n" + body)
            status, headers, _ = _read_response(sock, buffer)
            assert status == 200 and (b"connection", b"close") in headers
            assert sock.recv(1) == b""  # closed after it
        requests = metric_sum(f"{url}/metrics", "shoal_gateway_requests_total")
        assert requests >= 2 * len(cases) + 6
        assert "Traceback" not in gateway.log()
