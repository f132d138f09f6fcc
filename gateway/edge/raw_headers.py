"""A request header read from the ASGI scope's raw list, on the hot path.

`request.headers` builds Starlette's `Headers` (a copy of the raw list) and each lookup
lowercases and encodes its name: a one-text request asks for five or six headers, which
was ~4% of the gateway's CPU under single-text load (py-spy). The ASGI server hands the
names over lowercased (uvicorn does, as the spec asks), so a lookup here compares bytes.
"""

from __future__ import annotations

from starlette.requests import Request


def header(request: Request, name: bytes) -> str | None:
    """The first value of header `name` (lowercase), or None."""
    for key, value in request.scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def header_values(request: Request, name: bytes) -> list[str]:
    """Every value of header `name` (lowercase), in order."""
    return [value.decode("latin-1") for key, value in request.scope["headers"] if key == name]
