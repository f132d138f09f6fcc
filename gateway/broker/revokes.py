"""Revokes of requests whose callers left, sent in batches.

A caller that hangs up (`gateway.edge.caller_left`) leaves a request that may already be
queued, held by a worker or queued in its runtime: it is revoked with Celery's broadcast
control message `shoal_cancel` (`gateway.broker.streams.ReplyStreams.cancel`), which
every worker reads. Callers leave together (a client's pool closes its connections, a
load balancer gives up on many at once), and a broadcast costs every worker a message:
so the ids revoked during one turn of the loop go out as one message, at most
REVOKE_MAX_IDS ids each, and one broadcast is in flight at a time (the ids that come
meanwhile wait for it and leave together after it). No timer: one caller that leaves is
revoked on the loop's next turn.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from gateway.edge.gateway_metrics import REVOKE_MESSAGES

# Ids per shoal_cancel message: ~40 bytes each, so a message stays well under 64 KiB.
REVOKE_MAX_IDS = 1000


class Revokes:
    """Ids to revoke, gathered per loop turn and sent by `cancel` (a list of ids each)."""

    def __init__(self, cancel: Callable[[list[str]], Awaitable[None]]) -> None:
        self._cancel = cancel
        self._ids: list[str] = []
        self._sending: asyncio.Task | None = None
        self._due = False  # a flush is scheduled on the loop's next turn

    def revoke(self, task_id: str) -> None:
        """Revoke this request on every worker, with the others revoked this turn."""
        self._ids.append(task_id)
        if not self._due and self._sending is None:
            self._due = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._due = False
        if not self._ids or self._sending is not None:
            return
        ids, self._ids = self._ids, []
        self._sending = asyncio.get_running_loop().create_task(self._send(ids))
        self._sending.add_done_callback(self._sent)

    async def _send(self, ids: list[str]) -> None:
        for start in range(0, len(ids), REVOKE_MAX_IDS):
            REVOKE_MESSAGES.inc()
            await self._cancel(ids[start:start + REVOKE_MAX_IDS])

    def _sent(self, _task: asyncio.Task) -> None:
        self._sending = None
        self._flush()  # what was revoked while it was sent
