"""The HTTP side of the SGLang runtime: one `httpx.AsyncClient` for every server, used only on
the runtime's loop, and what a broken connection means (`ServerDied` if the server is gone,
else a failed outcome)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from runtimes.base import Outcome, Request, failed
from runtimes.sglang.model import ServedModel
from runtimes.sglang.server import SGLangServer
from tasks.errors import ErrorCode


class ServerDied(Exception):
    """The server of `incarnation` died under a request (`how`: its exit, described)."""

    def __init__(self, incarnation: int, how: str) -> None:
        super().__init__(how)
        self.incarnation = incarnation
        self.how = how


class SGLangClient:
    """The runtime's HTTP client to its SGLang servers. Make it on the runtime's loop."""

    def __init__(self) -> None:
        import httpx

        self.http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                                      limits=httpx.Limits(max_connections=None,
                                                          max_keepalive_connections=64))
        self.requests_sent = 0  # HTTP requests that reached an SGLang server (generate/encode)

    def generate(self, server: SGLangServer, body: dict[str, Any]) -> Any:
        """`/generate`, streamed: an async context manager of the response."""
        self.requests_sent += 1
        return self.http.stream("POST", f"{server.url}/generate", json=body)

    async def encode(self, server: SGLangServer, tokens: list[list[int]],
                     rids: list[str]) -> Any:
        """`/encode` of every text of a request at once: the response."""
        self.requests_sent += 1
        return await self.http.post(f"{server.url}/encode",
                                    json={"input_ids": tokens, "rid": rids})

    async def abort(self, model: ServedModel, rid: str) -> None:
        """Ask the model's current server to abort SGLang request `rid` (errors ignored)."""
        server = model.server
        if server is None:
            return
        with contextlib.suppress(Exception):
            await self.http.post(f"{server.url}/abort_request", json={"rid": rid},
                                 timeout=5.0)

    async def loads(self, server: SGLangServer) -> dict[str, Any]:
        """The server's `/v1/loads` for its (only) model."""
        response = await self.http.get(f"{server.url}/v1/loads", timeout=5.0)
        return response.json()["loads"][0]

    async def aclose(self) -> None:
        await self.http.aclose()


async def died_or_broke(server: SGLangServer, incarnation: int, request: Request,
                        what: str) -> Outcome:
    """After a broken connection: ServerDied if the server is gone, else an outcome."""
    for _ in range(100):
        if not server.alive():
            server.reap_group()
            raise ServerDied(incarnation, f"pid {server.pid} {server.describe_exit()}")
        await asyncio.sleep(0.05)
    return failed(request.id, ErrorCode.INTERNAL,
                  f"the SGLang server (pid {server.pid}) broke off the request: {what}")
