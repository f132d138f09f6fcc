"""Jobs whose driver lost Redis: kept until Redis answers, stopped here if gone.

A driver that stops for want of Redis (or of the broker, or the blob store) pauses its
job: the scan drives it again once Redis answers with it. But a Redis that came back
empty (restarted without persistence) lists nothing any more, and the sweep only takes
folders an hour old, so this is the only place left that can stop such a job: every
WATCH_S until Redis answers, a job still there is left to the scan; a job gone has every
part it published revoked (`gateway.jobs.part_revokes`: again until the broker takes
them) and its folder deleted, and nothing is written to Redis (it stays gone: 404). A job
Redis has as cancelled or failed has its folder deleted too (its driver, which would have,
was away).

What a driver knows of its job without Redis (`KnownJob`: its folder, the parts it
published) is recorded here while it drives (`JobDriver`, `gateway.jobs.driver`), so that
it is at hand when the job is orphaned; the pause also writes it into the job's folder
(`gateway.jobs.paused_jobs`), and a gateway that starts adopts those records as orphans
of its own (`adopt`), so a gateway restarted while Redis was away still stops or resumes
them. Once Redis has answered for an orphan, its record is removed (or goes with its
folder).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.jobs.part_replies import part_id
from gateway.jobs.paused_jobs import KnownJob, PausedRecords
from gateway.jobs.store import JobStore

log = logging.getLogger(__name__)

WATCH_S = 0.5  # how often the watcher asks Redis again (as often as a driver polls)


class Orphans:
    """The jobs driven here now (`known`) and those whose driver stopped for want of Redis,
    until Redis answers again (`in` and `len` count these)."""

    def __init__(self, store: JobStore, revoke: Callable[[list[str]], Awaitable[None]],
                 blobs: Callable[[], Any]) -> None:
        self.store = store
        self.revoke = revoke
        self.blobs = blobs
        self.records = PausedRecords(blobs, store.prefix)
        self.known: dict[str, KnownJob] = {}  # the jobs driven here now
        self._orphans: dict[str, KnownJob] = {}
        self._watcher: asyncio.Task | None = None
        self._closing = False

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._orphans

    def __len__(self) -> int:
        return len(self._orphans)

    async def driving(self, job_id: str, folder: str, published: int) -> None:
        """A driver here took the job (again, should Redis have come back with it): what
        an earlier driver here published counts too, should the job vanish later."""
        orphan = self._orphans.pop(job_id, None)
        self.known[job_id] = KnownJob(job_id, folder, max(
            published, orphan.published if orphan is not None else 0))
        if orphan is not None:
            await self.records.remove(orphan)

    def published(self, job_id: str, published: int) -> None:
        """Counted before Redis is told: a part on the broker must be revoked if the job
        vanishes, whether or not Redis heard of it."""
        known = self.known.get(job_id)
        if known is not None:
            known.published = max(known.published, published)

    def stopped(self, job_id: str) -> None:
        """The job's driver here ended (or paused: see `orphan`)."""
        self.known.pop(job_id, None)

    async def orphan(self, job_id: str) -> None:
        """Keep the job of a driver that stopped for want of Redis (or of the broker, or
        the blob store) until Redis says whether it is still there; recorded in its folder
        too, for a gateway that starts meanwhile."""
        known = self.known.pop(job_id, None)
        if known is None or self._closing:
            return
        await self.records.write(known)  # first: an orphan here is one on record too
        self._keep(known)

    async def adopt(self, found: list[KnownJob]) -> None:
        """Paused jobs recorded in the blob store (read when this gateway starts): watched
        as orphans of this gateway's; one driven here already is Redis's (its record goes)."""
        for known in found:
            if known.job_id in self.known:
                await self.records.remove(known)
            elif known.job_id not in self._orphans and not self._closing:
                log.warning("job %s was paused by a gateway before this one started (%d "
                            "parts published); watching it until Redis answers",
                            known.job_id, known.published)
                self._keep(known)

    def _keep(self, known: KnownJob) -> None:
        self._orphans[known.job_id] = known
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    def close(self) -> asyncio.Task | None:
        """Watch no more (the gateway shuts down): the watcher's task, for the caller to
        cancel and wait for."""
        self._closing = True
        return self._watcher

    async def _watch(self) -> None:
        """Every WATCH_S until Redis answers for each orphan: there and active, it is left
        to the scan (which drives it again); cancelled or failed, its files go; gone, it is
        stopped here at once."""
        while self._orphans and not self._closing:
            await asyncio.sleep(WATCH_S)
            for job_id, known in list(self._orphans.items()):
                try:
                    state, batch = await self.store.redis.hmget(self.store.key(job_id),
                                                                "state", "batch")
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.debug("Redis still away (%s); job %s waits", exc, job_id)
                    break  # the next turn asks again
                if self._orphans.get(job_id) is not known:
                    continue  # a driver took it back meanwhile
                del self._orphans[job_id]
                if state is None:
                    await self._vanished(known)
                elif state in (b"cancelled", b"failed") and not batch:
                    # (a batch's folder goes when its cancel writes its files)
                    await self._delete(known)
                else:
                    await self.records.remove(known)

    async def _vanished(self, known: KnownJob) -> None:
        """Stop a job that vanished from Redis while its driver waited for Redis: revoke
        every part it published (what Redis had recorded of them went with it; revoking
        one already answered does nothing) and delete its folder. Nothing is written to
        Redis: the job stays gone (404)."""
        log.warning("job %s is gone from Redis (restarted without persistence?) while its "
                    "driver waited for it; revoking its %d parts published and deleting its "
                    "files", known.job_id, known.published)
        if known.published:
            await self.revoke([part_id(known.job_id, i) for i in range(known.published)])
        await self._delete(known)

    async def _delete(self, known: KnownJob) -> None:
        try:
            await asyncio.to_thread(self.blobs().delete, [known.folder], True)
        except Exception as exc:  # the blob store away: the sweep takes them later
            log.warning("could not delete the files of job %s: %s", known.job_id, exc)
