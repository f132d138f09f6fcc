"""Revokes of job parts, sent again until the broker takes them.

A job cancelled, failed or gone has its parts published and not answered revoked (the
broadcast `shoal_cancel`, `Broker.cancel`): a worker then answers them CANCELLED unrun.
A revoke sent while RabbitMQ is away is not taken, and the parts would run for nobody
once it is back: so the ids not taken are kept here and sent again every RETRY_S (in
messages of `gateway.broker.revokes.REVOKE_MAX_IDS` ids, whatever the jobs they came
from) until the broker takes them.
A revoke is idempotent on the workers, so a second one of the same id does no harm.

`Broker.cancel` says whether the broker took the message (False: no connection, or the
publish failed); a broker double that says nothing (None) is taken at its word.
What is still waiting when the gateway stops is lost with it; a job paused then has a
record in its folder (`gateway.jobs.paused_jobs`) from which a gateway that starts
revokes its parts again, should the job be gone.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from gateway.broker.revokes import REVOKE_MAX_IDS

log = logging.getLogger(__name__)

RETRY_S = 1.0


class PartRevokes:
    """Sends revokes through `broker.cancel`; keeps and resends those not taken."""

    def __init__(self, broker: Any, retry_s: float = RETRY_S) -> None:
        self.broker = broker
        self.retry_s = retry_s
        self.waiting: dict[str, None] = {}  # ids not taken yet, in the order they came
        self._retrier: asyncio.Task | None = None
        self._closing = False

    async def revoke(self, ids: list[str]) -> None:
        """Revoke `ids` now; if the broker does not take them, again until it does."""
        if not ids:
            return
        if await self._send(ids):
            return
        log.warning("could not revoke %d job parts (the broker is away?); sending them "
                    "again every %g s until it takes them", len(ids), self.retry_s)
        self.waiting.update(dict.fromkeys(ids))
        if not self._closing and (self._retrier is None or self._retrier.done()):
            self._retrier = asyncio.get_running_loop().create_task(self._retry())

    def close(self) -> asyncio.Task | None:
        """Retry no more (the gateway shuts down): the retrier, for the caller to cancel."""
        self._closing = True
        return self._retrier

    async def _send(self, ids: list[str]) -> bool:
        try:
            taken = await self.broker.cancel(ids)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.debug("revoke of %d job parts failed: %s", len(ids), exc)
            return False
        return taken is not False

    async def _retry(self) -> None:
        while self.waiting and not self._closing:
            await asyncio.sleep(self.retry_s)
            waiting = list(self.waiting)
            for start in range(0, len(waiting), REVOKE_MAX_IDS):
                ids = waiting[start:start + REVOKE_MAX_IDS]
                if not await self._send(ids):
                    break  # still away: the next turn sends them
                for task_id in ids:
                    self.waiting.pop(task_id, None)
                log.warning("revoked %d job parts the broker had not taken before",
                            len(ids))
