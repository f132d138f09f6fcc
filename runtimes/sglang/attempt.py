"""One attempt at a request on its model's current SGLang server: a generate request's items
as concurrent streams (`generate.GenerateItem`), an encode request's texts in one `/encode`
call. `client.ServerDied` if the server dies meanwhile; what follows a death is
`recovery.Recovery`'s."""

from __future__ import annotations

import asyncio

from runtimes.base import OnDeltas, Outcome, Request, failed
from runtimes.sglang.client import SGLangClient, died_or_broke
from runtimes.sglang.generate import GenerateItem
from runtimes.sglang.live import Live
from runtimes.sglang.model import ServedModel
from runtimes.sglang.prepare import Prepared
from runtimes.sglang.results import encode_result, generate_result, unavailable
from runtimes.sglang.server import SGLangServer
from tasks.errors import ErrorCode


async def attempt(client: SGLangClient, model: ServedModel, request: Request,
                  prepared: Prepared, live: Live, on_deltas: OnDeltas | None) -> Outcome:
    """One attempt on the current server; ServerDied if it dies meanwhile."""
    async with model.restart_lock:
        server, incarnation = model.server, model.incarnation
    if server is None:
        return unavailable(model, request)
    parsed, tokens = prepared
    if not model.generate:
        return await encode(client, model, server, incarnation, request, prepared, live)
    choices = await asyncio.gather(*(
        GenerateItem(client, model, server, incarnation, request, parsed.options, ids, index,
                     live, on_deltas).run()
        for index, ids in enumerate(tokens)))
    return generate_result(request, list(choices))


async def encode(client: SGLangClient, model: ServedModel, server: SGLangServer,
                 incarnation: int, request: Request, prepared: Prepared,
                 live: Live) -> Outcome:
    """Every text of the request in one `/encode` call, each its own SGLang request."""
    import httpx

    parsed, tokens = prepared
    rids = [f"{request.id}/{i}" for i in range(len(tokens))]
    live.rids.extend(rids)
    model.inflight += len(tokens)
    try:
        response = await client.encode(server, tokens, rids)
    except httpx.TransportError as exc:
        return await died_or_broke(server, incarnation, request, repr(exc))
    finally:
        model.inflight -= len(tokens)
    if response.status_code != 200:
        return failed(request.id, ErrorCode.INTERNAL,
                      f"SGLang refused the request ({response.status_code}): "
                      f"{response.text[:500]}")
    return encode_result(request, parsed, tokens, response.json())
