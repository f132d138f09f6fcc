"""Streaming: a request's output published as it is made.

A generate request whose kwargs say `stream: true` has its output published as it is
made, as Celery PROGRESS states on its `reply_to` before its result
(`app.worker.lifecycle.replies.Replier.progress`). The runtime's thread queues each step's deltas
and wakes the loop, which publishes them in order, and always before the batch's results.
A request revoked by its caller (Celery's `revoke`, or `shoal_cancel`, which a gateway
sends when an HTTP stream's client leaves) is answered CANCELLED if it has not started,
and stops at its next token if it runs (`WorkerView.cancel`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from celery.worker import state as worker_state

from app.worker import metrics
from app.worker.lifecycle.held import Held
from app.worker.lifecycle.loop import Loop
from app.worker.lifecycle.replies import Delivery, Replier
from runtimes.base import Delta, OnDeltas, Runtime


class Streams:
    """The deltas runtimes make, published in order on the loop."""

    def __init__(self, runtime: Runtime, replier: Replier, loop: Loop,
                 generation: Callable[[], int]) -> None:
        self.runtime = runtime
        self.replier = replier
        self.loop = loop  # woken to publish; its hostname goes into each update
        self.generation = generation  # the dispatcher's: deltas of an older one are dropped
        # Deltas the runtime's thread made, for the loop to publish in order:
        # (generation, the batch's requests by task id, one step's deltas).
        self._deltas: deque[tuple[int, dict[str, Held], list[Delta]]] = deque()

    def queuer(self, generation: int, batch: list[Held]) -> OnDeltas:
        """The batch's `on_deltas` (runtime thread): queue, and wake the loop to publish.
        Through one queue, as the loop runs `call_soon` callbacks in no set order."""
        by_id = {held.task_id: held for held in batch}

        def queue(deltas: list[Delta]) -> None:
            self._deltas.append((generation, by_id, deltas))
            self.loop.call_soon(self.publish)

        return queue

    def publish(self) -> None:
        """Publish the queued deltas as PROGRESS states, in the order they were made, one per
        request and pass: the deltas of one item that queued up meanwhile go as one text. A
        request revoked meanwhile publishes no more and is cancelled in the runtime."""
        made: dict[str, tuple[Held, dict[int, dict[str, Any]]]] = {}
        while self._deltas:
            generation, by_id, deltas = self._deltas.popleft()
            if generation != self.generation():
                continue  # the connection was lost: these requests are redelivered
            for delta in deltas:
                held, items = made.setdefault(delta.id, (by_id[delta.id], {}))
                item = items.get(delta.index)
                if item is None:
                    items[delta.index] = {"index": delta.index, "text": delta.text,
                                          "tokens": delta.tokens}
                else:
                    item["text"] += delta.text
                    item["tokens"] = delta.tokens
        updates: list[tuple[Delivery, str, dict[str, Any]]] = []
        for task_id, (held, items) in made.items():
            if task_id in worker_state.revoked:
                self.runtime.cancel([task_id])
                continue
            updates.append((held.delivery, task_id,
                            {"choices": list(items.values()), "worker": self.loop.hostname}))
            metrics.STREAM_DELTAS.labels(held.annotations.model).inc(len(items))
        if updates:
            self.replier.progress(updates)
