"""gateway.edge.raw_headers reads what Starlette's Headers reads, without building it."""

from __future__ import annotations

from starlette.requests import Request

from gateway.edge.raw_headers import header, header_values


def _request(headers: list[tuple[bytes, bytes]]) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers})


def test_the_same_values_as_starlettes_headers() -> None:
    request = _request([(b"content-type", b"application/json"), (b"x-timeout-ms", b"50"),
                        (b"x-timeout-ms", b"70"), (b"prefer", b"respond-async, wait=5"),
                        (b"x-note", "é".encode("latin-1"))])
    for name in ("content-type", "prefer", "x-timeout-ms", "accept", "x-note"):
        assert header(request, name.encode()) == request.headers.get(name)
        assert header_values(request, name.encode()) == request.headers.getlist(name)
    assert header_values(request, b"x-timeout-ms") == ["50", "70"]
    assert header(request, b"accept") is None
