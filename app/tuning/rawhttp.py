"""A minimal keep-alive HTTP/1.1 client for load generation.

httpx spends ~4 ms of CPU per request here, as much as the whole shoal
pipeline; on a 2-core machine the load generator would then measure itself.
This client does only what the benchmark needs: POST a prepared body on one
connection, read status, headers and a Content-Length body.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

# uvicorn closes a keep-alive connection idle for 5 s (its timeout_keep_alive): a request
# written to it then reads "connection lost", an error of the client's making (an open
# loop's spare connections sit idle that long between bursts). Reconnect before that.
IDLE_RECONNECT_S = 4.0


class HttpError(Exception):
    pass


class Connection:
    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.last_used = 0.0  # time.monotonic() of the last response read

    async def _connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    def request_bytes(self, path: str, body: bytes, content_type: str) -> bytes:
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n")
        return head.encode() + body

    async def send(self, request: bytes) -> tuple[int, dict[str, str], bytes]:
        if self.writer is not None and time.monotonic() - self.last_used > IDLE_RECONNECT_S:
            self.writer.close()
            self.writer = None
        if self.writer is None or self.writer.is_closing():
            await self._connect()
        assert self.reader is not None and self.writer is not None
        self.writer.write(request)
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            self.writer = None
            raise HttpError(f"connection lost: {exc}") from exc
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        body = await self.reader.readexactly(int(headers.get("content-length", "0")))
        self.last_used = time.monotonic()
        return status, headers, body

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
