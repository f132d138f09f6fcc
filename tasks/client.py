"""Celery signatures for backend services: `encode.delay(model=..., items=[...])`.

    from tasks.client import encode
    result = encode.delay(model="sentence-transformers/all-MiniLM-L6-v2",
                          items=[{"text": "hello"}]).get(timeout=10)
    vectors = embedding_rows(result)

The task is routed to the model's queue and served by a shoal worker; the
result is the same dict an HTTP caller's response is made from.

Streamed generation: with `stream=True` in the kwargs the worker publishes the
output as it is made (Celery PROGRESS states) before the result; `stream`
yields it:

    result = generate.apply_async(kwargs={"model": ..., "items": [{"text": "Once"}],
                                          "options": {"max_tokens": 64}, "stream": True})
    for delta in stream(result, timeout=60):
        print(delta["text"], end="")    # {"index", "text", "tokens"} per item
    result.get()                        # the full text and usage, as without streaming

`result.revoke()` stops a running generation at its next token (keep iterating: the
stream then ends with the result, finish_reason "cancelled").
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

from celery.result import AsyncResult

from tasks import errors  # noqa: F401  (lets AsyncResult.get() re-raise ShoalError)
from tasks.celery_app import app
from tasks.envelope import PROGRESS
from tasks.names import CLASSIFY, ENCODE, EXTRACT, GENERATE, SCORE
from tasks.results import embedding_rows, multivector_rows, ranked

encode = app.signature(ENCODE)
score = app.signature(SCORE)
extract = app.signature(EXTRACT)
classify = app.signature(CLASSIFY)
generate = app.signature(GENERATE)

__all__ = ["app", "classify", "embedding_rows", "encode", "extract", "generate",
           "multivector_rows", "ranked", "score", "stream"]

_END = object()


def stream(result: AsyncResult, timeout: float | None = None) -> Iterator[dict[str, Any]]:
    """The deltas of a streamed generate task (`{"index", "text", "tokens"}`, in order) as
    they come; returns when its result is in, which `result.get()` then gives at once.
    Raises what `get` raises (a ShoalError for a failed request, TimeoutError).

    The stream waits for the result with Celery's `get` on a thread of its own; two `get`s
    of one result at once (Celery's rpc backend drains one connection) can leave one
    waiting forever, so leaving the loop early waits for that thread, that is for the
    result. To stop a generation, `result.revoke()` first: it ends at the next token."""
    deltas: queue.Queue[Any] = queue.Queue()

    def on_message(meta: dict[str, Any]) -> None:
        if meta.get("status") == PROGRESS:
            for choice in (meta.get("result") or {}).get("choices") or ():
                deltas.put(choice)

    def follow() -> None:
        try:
            result.get(timeout=timeout, on_message=on_message, propagate=True)
        except BaseException as exc:  # handed to the iterating thread
            deltas.put(exc)
        else:
            deltas.put(_END)

    # Celery's get() blocks and calls on_message from inside; a thread makes it a generator.
    follower = threading.Thread(target=follow, name=f"stream-{result.id}", daemon=True)
    follower.start()
    try:
        while (item := deltas.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        follower.join()
