"""How full a model's SGLang server is (`Load`), for the worker's `load_of`: SGLang's own
count from `/v1/loads`, cached briefly and refreshed in the background, plus the items this
runtime sent that SGLang does not count yet. A model that is down or restarting reads as
full."""

from __future__ import annotations

import asyncio
import time

from batching.feeder import Load
from runtimes.sglang.client import SGLangClient
from runtimes.sglang.model import ServedModel

LOAD_CACHE_S = 0.05  # load_of is asked often: SGLang's answer is reused this long


def load_of(model: ServedModel, client: SGLangClient, loop: asyncio.AbstractEventLoop) -> Load:
    """The model's last load read; one older than LOAD_CACHE_S is refreshed on `loop` in the
    background for the next ask (never waits)."""
    cached = model.load_cache
    if (cached is None or time.monotonic() - cached[0] >= LOAD_CACHE_S) \
            and not model.load_refreshing:
        model.load_refreshing = True
        try:
            asyncio.run_coroutine_threadsafe(refresh_load(model, client), loop)
        except RuntimeError:  # the loop is closed
            model.load_refreshing = False
    if cached is not None:
        return cached[1]
    # Not read yet: what this runtime sent is all SGLang holds.
    return Load(running=model.inflight, waiting=0, max_running=max(model.max_running, 1),
                max_tokens=model.max_tokens)


async def refresh_load(model: ServedModel, client: SGLangClient) -> None:
    try:
        load = await fetch_load(model, client)
    except Exception:
        load = None
    finally:
        model.load_refreshing = False
    if load is None:
        full = max(model.max_running, 1)
        load = Load(running=full, waiting=model.inflight, max_running=full)
    model.load_cache = (time.monotonic(), load)


async def fetch_load(model: ServedModel, client: SGLangClient) -> Load | None:
    """SGLang's count, or None while the server is down or being restarted."""
    server = model.server
    if server is None or model.restart_lock.locked() or model.isolating:
        return None
    data = await client.loads(server)
    running = int(data["num_running_reqs"])
    waiting = int(data["num_waiting_reqs"])
    unseen = max(0, model.inflight - running - waiting)
    return Load(running=running, waiting=waiting + unseen,
                max_running=int(data.get("max_running_requests") or model.max_running),
                tokens=int(data.get("num_total_tokens") or data.get("num_used_tokens") or 0),
                max_tokens=int(data.get("max_total_num_tokens") or model.max_tokens))
