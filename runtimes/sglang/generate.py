"""One item of a generate request, served as its own SGLang request (rid "{request id}/{index}")
streamed from the native `/generate` API: its output ids as they arrive, its deltas to the
caller, and its choice, or a failed outcome, at the end."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from runtimes.base import CANCELLED, Delta, OnDeltas, Outcome, Request, failed
from runtimes.families.deltas import sendable
from runtimes.sglang.client import SGLangClient, died_or_broke
from runtimes.sglang.live import Live
from runtimes.sglang.model import ServedModel
from runtimes.sglang.prepare import generate_body
from runtimes.sglang.results import choice, completion_text
from runtimes.sglang.server import SGLangServer
from tasks.errors import ErrorCode

log = logging.getLogger(__name__)

STOP = "stop"
LENGTH = "length"


class GenerateItem:
    """Item `index` (prompt `ids`) of `request` on the server of `incarnation`.

    `run` goes in steps: the body is built (`prepare.generate_body`); `_stream` sends it
    and reads SGLang's stream, `_take` taking each chunk (new output ids, timed; the finish
    reason; deltas for a streamed request); `_reason` says how the item finished; `_answer`
    makes its choice and streams what is left. A broken connection is `died_or_broke`:
    `ServerDied` (raised) if the server is gone."""

    def __init__(self, client: SGLangClient, model: ServedModel, server: SGLangServer,
                 incarnation: int, request: Request, options: Any, ids: list[int],
                 index: int, live: Live, on_deltas: OnDeltas | None) -> None:
        self.client = client
        self.model = model
        self.server = server
        self.incarnation = incarnation
        self.request = request
        self.options = options
        self.ids = ids
        self.index = index
        self.live = live
        self.on_deltas = on_deltas
        self.rid = f"{request.id}/{index}"
        self.output: list[int] = []  # the output ids so far
        self.finish: dict[str, Any] | None = None  # SGLang's finish reason, once it says
        self.sent = ""  # the text streamed to the caller so far
        self.started = 0.0
        self.first_at: float | None = None  # when the first and last output ids came
        self.last_at: float | None = None

    @property
    def streaming(self) -> bool:
        return self.request.stream and self.on_deltas is not None

    async def run(self) -> dict[str, Any] | Outcome:
        """The item's choice, or a failed outcome; ServerDied if the server died."""
        self.live.rids.append(self.rid)
        body = generate_body(self.ids, self.options, self.index, self.rid)
        self.started = time.perf_counter()
        if self.live.cancelled:
            return choice(self.model, self.index, self.ids, [], CANCELLED, self.options.stop,
                          0.0, 0.0)
        broken = await self._stream(body)
        if broken is not None:
            return broken
        if self.finish is None and not self.live.cancelled:
            return await died_or_broke(self.server, self.incarnation, self.request,
                                       "its stream ended without a finish reason")
        reason = self._reason()
        if isinstance(reason, Outcome):
            return reason
        return self._answer(reason)

    async def _stream(self, body: dict[str, Any]) -> Outcome | None:
        """Send the item and read its stream until SGLang is done: a failed outcome if
        SGLang refused or failed it, or the connection broke (unless it was cancelled)."""
        import httpx

        self.model.inflight += 1
        try:
            async with self.client.generate(self.server, body) as response:
                if response.status_code != 200:
                    detail = (await response.aread()).decode(errors="replace")[:500]
                    return failed(self.request.id, ErrorCode.INTERNAL,
                                  f"SGLang refused items[{self.index}] "
                                  f"({response.status_code}): {detail}")
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    error = self._take(json.loads(data))
                    if error is not None:
                        return error
        except (httpx.TransportError, httpx.StreamError) as exc:
            if not self.live.cancelled:
                return await died_or_broke(self.server, self.incarnation, self.request,
                                           repr(exc))
        finally:
            self.model.inflight -= 1
        return None

    def _take(self, chunk: dict[str, Any]) -> Outcome | None:
        """One chunk of the stream: a failed outcome if it is SGLang's error, else its
        output ids and finish reason kept, and what the caller has not seen streamed."""
        if "error" in chunk:
            error = chunk["error"]
            message = error.get("message") if isinstance(error, dict) else error
            return failed(self.request.id, ErrorCode.INTERNAL,
                          f"SGLang failed items[{self.index}]: {message}")
        ids_now = chunk.get("output_ids") or []
        if len(ids_now) > len(self.output):
            now = time.perf_counter()
            self.first_at = self.first_at or now
            self.last_at = now
            self.output = list(ids_now)
        self.finish = chunk.get("meta_info", {}).get("finish_reason") or self.finish
        if self.streaming and self.finish is None:
            self._send(final=False)
        return None

    def _reason(self) -> str | Outcome:
        """The choice's finish_reason (a cancelled item that did not finish on its own is
        CANCELLED), or a failed outcome if SGLang aborted it."""
        kind = (self.finish or {}).get("type")
        if self.live.cancelled and kind not in (STOP, LENGTH):
            return CANCELLED
        if kind == LENGTH:
            return LENGTH
        if kind == STOP:
            return STOP
        message = (self.finish or {}).get("message") or self.finish
        return failed(self.request.id, ErrorCode.INTERNAL,
                      f"SGLang aborted items[{self.index}]: {message}")

    def _answer(self, reason: str) -> dict[str, Any]:
        """The item's choice, with its latencies; the rest of its text streamed."""
        ttft, itl = self._latencies()
        answer = choice(self.model, self.index, self.ids, self.output, reason,
                        self.options.stop, ttft, itl)
        if self.streaming:
            self._send(final=True, text=answer["text"])
        return answer

    def _latencies(self) -> tuple[float, float]:
        """Time to the first output id and mean time between output ids, in ms."""
        first_at, last_at, count = self.first_at, self.last_at, len(self.output)
        ttft = (first_at - self.started) * 1000 if first_at else 0.0
        itl = ((last_at - first_at) * 1000 / (count - 1)
               if first_at and last_at and count > 1 else 0.0)
        return ttft, itl

    def _send(self, final: bool, text: str | None = None) -> None:
        """Stream what the item gained since `sent` (what `runtimes.families.deltas.sendable` lets
        go: text that may still change is held back until `final`)."""
        assert self.on_deltas is not None
        stops = self.options.stop
        if text is None:
            text = completion_text(self.model, self.output, stops)
        now = sendable(text, self.sent, stops, final)
        if now == self.sent:
            if final and not text.startswith(self.sent):
                log.warning("streamed text of %s/%d is no prefix of its final text",
                            self.request.id, self.index)
            return
        delta = now[len(self.sent):]
        self.sent = now
        self.live.streamed = True
        try:
            self.on_deltas([Delta(self.request.id, self.index, delta, len(self.output))])
        except Exception:
            log.exception("on_deltas failed for %s/%d", self.request.id, self.index)
