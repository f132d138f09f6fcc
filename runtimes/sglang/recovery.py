"""Serving requests through crashes of their model's SGLang server ("Crashes" in the
`runtimes.sglang.runtime` module doc): a dead server is restarted once per death (whoever
notices first); a request that already streamed fails STREAM_INTERRUPTED; any other is
retried once alone after the restart (new requests wait meanwhile), and one that kills the
server again alone is POISON_INPUT if the restarted server answers a known-good request
(the probe), INTERNAL if it does not."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from runtimes.base import OnDeltas, Outcome, Request, failed
from runtimes.sglang.attempt import attempt
from runtimes.sglang.client import ServerDied, SGLangClient
from runtimes.sglang.live import Live
from runtimes.sglang.model import ServedModel
from runtimes.sglang.prepare import Prepared, prepare
from runtimes.sglang.results import unavailable
from runtimes.sglang.server import SGLangServer
from tasks.errors import ErrorCode

log = logging.getLogger(__name__)


class Recovery:
    """`serve` runs requests on the loop; `start_server` starts a model's new server (on a
    thread), `serving` says whether the model is still loaded in an open runtime. Counts
    `restarts` and `poison_isolated` for the worker's metrics."""

    def __init__(self, client: SGLangClient,
                 start_server: Callable[[ServedModel], SGLangServer],
                 serving: Callable[[ServedModel], bool]) -> None:
        self._client = client
        self._start_server = start_server
        self._serving = serving
        self.restarts = 0
        self.poison_isolated = 0

    async def serve(self, model: ServedModel, request: Request, prepared: Prepared,
                    live: Live, on_deltas: OnDeltas | None) -> Outcome:
        """The request's outcome, once its model has no request waiting to be retried
        alone."""
        async with model.calm:
            await model.calm.wait_for(lambda: model.isolating == 0)
        try:
            return await attempt(self._client, model, request, prepared, live, on_deltas)
        except ServerDied as died:
            if live.streamed:
                return self._interrupted(model, request, died,
                                         "this request had already streamed part of its "
                                         "output, so it is not retried. The server is being "
                                         "restarted; send it again.")
            log.warning("SGLang server for %s died (%s) under request %s; retrying it alone "
                        "after the restart", model.entry.id, died.how, request.id)
            model.isolating += 1
            try:
                return await self._retry_alone(model, request, prepared, live, on_deltas,
                                               died)
            finally:
                model.isolating -= 1
                async with model.calm:
                    model.calm.notify_all()

    def _interrupted(self, model: ServedModel, request: Request, died: ServerDied,
                     why: str) -> Outcome:
        """A streamed request whose server died: restart it (not awaited) and answer
        STREAM_INTERRUPTED, as its caller holds text a rerun would repeat."""
        asyncio.get_running_loop().create_task(self.restart(model, died.incarnation))
        return failed(request.id, ErrorCode.STREAM_INTERRUPTED,
                      f"the SGLang server died mid-generation ({died.how}); {why}")

    async def _retry_alone(self, model: ServedModel, request: Request, prepared: Prepared,
                           live: Live, on_deltas: OnDeltas | None,
                           died: ServerDied) -> Outcome:
        if not await self.restart(model, died.incarnation):
            return unavailable(model, request)
        async with model.alone:
            if (model.server is None or not model.server.alive()) \
                    and not await self.restart(model, model.incarnation):
                return unavailable(model, request)
            live.rids.clear()
            try:
                return await attempt(self._client, model, request, prepared, live, on_deltas)
            except ServerDied as again:
                if live.streamed:
                    return self._interrupted(model, request, again,
                                             "again, while this request was retried alone; "
                                             "not retried further")
                return await self._died_alone(model, request, again)

    async def _died_alone(self, model: ServedModel, request: Request,
                          again: ServerDied) -> Outcome:
        """The request killed the server a second time, alone: POISON_INPUT, unless the
        restarted server fails the probe too (then it is not blamed)."""
        if not await self.restart(model, again.incarnation):
            return unavailable(model, request)
        problem = await self._probe(model)
        if problem is not None:
            return failed(request.id, ErrorCode.INTERNAL,
                          f"the SGLang server for {model.entry.id} died twice under "
                          f"this request ({again.how}), but it also fails a "
                          f"known-good request ({problem}); this request is not "
                          "blamed")
        self.poison_isolated += 1
        log.error("request %s for %s isolated as poison: it killed the SGLang server "
                  "again when run alone", request.id, model.entry.id)
        return failed(request.id, ErrorCode.POISON_INPUT,
                      f"this request crashed the SGLang server ({again.how}) twice: "
                      "with other requests, then alone after a restart; it is not "
                      "retried (the other requests were served without it)")

    async def restart(self, model: ServedModel, incarnation: int) -> bool:
        """Replace the server of `incarnation` (once, whoever asks first): whether a healthy
        server runs now."""
        async with model.restart_lock:
            if model.incarnation != incarnation:
                return model.server is not None and model.broken is None
            old = model.server
            model.incarnation += 1
            model.load_cache = None
            if not self._serving(model):
                model.broken = "the model was unloaded or the runtime closed"
                return False
            if old is not None:
                await asyncio.to_thread(old.stop, 1.0)
            self.restarts += 1
            log.warning("restarting the SGLang server for %s (restart %d)", model.entry.id,
                        self.restarts)
            try:
                model.server = await asyncio.to_thread(self._start_server, model)
                model.broken = None
                return True
            except Exception as exc:
                model.server = None
                model.broken = str(exc)
                log.error("the SGLang server for %s could not be restarted: %s",
                          model.entry.id, exc)
                return False

    async def _probe(self, model: ServedModel) -> str | None:
        """None when the model answers a known-good request, else what went wrong."""
        from runtimes.child_side.adapter import probe_kwargs
        from tasks.adapters import ADAPTERS as CONTRACTS

        contract = CONTRACTS[model.entry.adapter]
        request = Request("shoal-probe", model.entry.operation,
                          probe_kwargs(contract.operation, contract.inputs))
        try:
            prepared = await asyncio.get_running_loop().run_in_executor(None, prepare, model,
                                                                         request)
            outcome = await attempt(self._client, model, request, prepared, Live(request, ""),
                                    None)
        except ServerDied as died:
            return f"the server died on the probe too ({died.how})"
        except Exception as exc:
            return repr(exc)
        return None if outcome.ok else f"{outcome.error_code}: {outcome.error_message}"
