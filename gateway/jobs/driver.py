"""Drive jobs: publish their parts with bounded parts in flight, gather their results.

One gateway drives a job at a time: the holder of its lease in Redis, which it
renews every third of SHOAL_JOB_LEASE_S. Every gateway scans the active jobs as
often and takes over a lease that expired (its holder died or lost Redis), then
continues from the recorded resume point (parts published, input offset). A part
published again after a takeover keeps its id (`part_id`), so its result counts
once. Results are recorded by whichever gateway consumes them (`gateway.jobs.part_replies`),
which wakes the driver here if it is this one; a driver elsewhere notices within
POLL_S.

Cancelling or failing a job is a state change in Redis; the driver (or the DELETE
route, whichever comes first) then revokes the parts published and not answered. A job
whose record vanished from Redis (restarted without persistence) is stopped the same
way: its parts revoked, its files deleted; nothing writes its record again. That holds
too when Redis went away first and came back empty: a driver that stops for want of Redis
keeps its job in memory (`_Known`: its folder, the parts it published) and checks every
POLL_S until Redis answers; if the job is gone then, nothing in Redis lists it any more,
so this is the only place left that can revoke its parts and delete its files.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgpack

from gateway.calls.blob_offload import check_out, upload_first
from gateway.calls.native_api import payload  # the sync route's response shape
from gateway.edge.api_errors import ApiError
from gateway.jobs.bulk_files import PartReader, gather
from gateway.jobs.part_replies import part_id, replies_queue
from gateway.jobs.store import FAILED, SUCCEEDED, Job, JobStore, error_body, transient
from tasks.catalog import ModelEntry
from tasks.envelope import task_part
from tasks.errors import ErrorCode
from tasks.settings import Settings

log = logging.getLogger(__name__)

SWEEP_MIN_AGE_S = 3600.0
CLOSE_WAIT_S = 2.0  # the most a gateway's shutdown waits for its job tasks to stop
POLL_S = 0.5  # how often a waiting driver re-reads counts another gateway may have moved
RETRY_CODES = frozenset({ErrorCode.QUEUE_FULL, ErrorCode.BROKER_UNAVAILABLE,
                         ErrorCode.MODEL_UNAVAILABLE})  # a part waits and tries again


@dataclasses.dataclass(slots=True)
class _Known:
    """What a driver knows of its job without Redis: enough to stop it if Redis comes back
    without it. `published` is counted here as parts go out, since the count in Redis
    misses a part published just before Redis went away."""

    job_id: str
    folder: str  # all of the job's files (its upload, parts, result); not a caller's input
    published: int


class JobDriver:
    def __init__(self, settings: Settings, store: JobStore, broker: Any,
                 served: dict[str, ModelEntry], blobs: Callable[[], Any]) -> None:
        self.settings = settings
        self.store = store
        self.broker = broker
        self.served = served
        self.blobs = blobs
        self.owner = f"gateway@{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.reply_to = replies_queue(settings.queue_prefix)
        self.lease_s = settings.job_lease_s
        self._driving: dict[str, asyncio.Task] = {}
        self._wake: dict[str, asyncio.Event] = {}
        self._scanner: asyncio.Task | None = None
        self._closing = False
        self._known: dict[str, _Known] = {}  # the jobs driven here now
        # Jobs whose driver stopped for want of Redis, until Redis answers again: then
        # each is either there (the scan drives it again) or gone (cleaned up here).
        self._orphans: dict[str, _Known] = {}
        self._watcher: asyncio.Task | None = None

    def start(self) -> None:
        self._scanner = asyncio.get_running_loop().create_task(self._scan_forever())

    async def close(self) -> None:
        """Stop scanning and driving (on the gateway's shutdown), waiting CLOSE_WAIT_S at
        most: a cancel that lands inside the Redis client can be swallowed there (seen:
        the scanner then slept on, and a drained gateway never exited), so the scanner
        also stops at its next turn, and shutdown never waits for it longer than that."""
        self._closing = True
        tasks = [t for t in (self._scanner, self._watcher, *self._driving.values())
                 if t is not None]
        for task in tasks:
            task.cancel()
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=CLOSE_WAIT_S)
        if pending:
            log.warning("%d job tasks did not stop within %g s of the shutdown; leaving them",
                        len(pending), CLOSE_WAIT_S)

    def notify(self, job_id: str) -> None:
        """A part of `job_id` was recorded here: wake its driver if it runs here."""
        event = self._wake.get(job_id)
        if event is not None:
            event.set()

    async def kick(self, job_id: str) -> None:
        """Drive a job just created here, if no one else does."""
        await self._try(job_id)

    async def _scan_forever(self) -> None:
        swept = time.monotonic()
        while not self._closing:
            try:
                for job_id in await self.store.active_ids():
                    if job_id not in self._driving:
                        await self._try(job_id)
                if time.monotonic() - swept > self.settings.blob_sweep_interval_s:
                    swept = time.monotonic()
                    await self._sweep()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: the next scan tries again
                log.warning("cannot scan jobs: %s", exc)
            await asyncio.sleep(self.lease_s / 3)

    async def _sweep(self) -> None:
        """Remove the files of jobs that are gone from Redis (expired SHOAL_JOB_TTL_S after
        they finished) or ended without a result, and of uploads that never became a job.
        A folder younger than SWEEP_MIN_AGE_S is left alone: its job may be being made."""
        blobs = self.blobs()
        from tasks.blobs import JOBS

        try:
            names = await asyncio.to_thread(blobs.fs.ls, blobs.path(JOBS), detail=False)
        except FileNotFoundError:
            return
        cutoff = time.time() - SWEEP_MIN_AGE_S
        for name in names:
            made, _, job_id = name.rstrip("/").rsplit("/", 1)[-1].partition("-")
            if not made.isdigit() or int(made) > cutoff:
                continue
            state = await self.store.redis.hget(self.store.key(job_id), "state")
            if state is None or state in (b"cancelled", b"failed"):
                await asyncio.to_thread(blobs.delete, [f"{JOBS}/{made}-{job_id}"], True)

    async def _try(self, job_id: str) -> None:
        if job_id in self._driving or not await self.store.acquire(job_id, self.owner,
                                                                   self.lease_s):
            return
        task = asyncio.get_running_loop().create_task(self._drive(job_id))
        self._driving[job_id] = task
        task.add_done_callback(lambda _: self._driving.pop(job_id, None))

    async def _keep_lease(self, job_id: str, driver: asyncio.Task) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                held = await self.store.renew(job_id, self.owner, self.lease_s)
                gone = not held and not await self.store.redis.exists(self.store.key(job_id))
            except Exception as exc:
                log.warning("cannot renew the lease of job %s: %s", job_id, exc)
                continue  # it may still be ours; if it lapses, another gateway takes over
            if not held:
                if gone:
                    # Gone with its lease (a Redis restarted without persistence): no
                    # gateway will drive it. The driver sees it gone at its next look
                    # (within POLL_S), revokes its parts and deletes its files.
                    log.warning("job %s is gone from Redis (restarted without "
                                "persistence?); stopping it and deleting its files", job_id)
                    return
                log.warning("lost the lease of job %s; another gateway drives it", job_id)
                driver.cancel()
                return

    async def _drive(self, job_id: str) -> None:
        me = asyncio.current_task()
        assert me is not None
        keeper = asyncio.get_running_loop().create_task(self._keep_lease(job_id, me))
        self._wake[job_id] = asyncio.Event()
        try:
            job = await self.store.get(job_id)
            if job is None:
                await self.store.forget(job_id)
                return
            # Driven again (Redis came back with it): what an earlier driver here published
            # counts too, should the job vanish later.
            orphan = self._orphans.pop(job_id, None)
            self._known[job_id] = _Known(job_id, job.folder, max(
                job.published, orphan.published if orphan is not None else 0))
            entry = self.served.get(job.model)
            if not job.active or entry is None:
                return  # a model this gateway does not serve: left to one that does
            if await self.store.mark_running(job_id) and \
                    await self._publish_all(job, entry) and await self._wait_done(job):
                await self._gather(job, entry)
            else:  # cancelled, failed or gone: its files go (the caller's own input stays)
                folder = [f"{job.folder}/parts", f"{job.folder}/input.jsonl",
                          f"{job.folder}/request.msgpack"]
                await asyncio.to_thread(self.blobs().delete, folder, True)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if transient(exc):
                log.warning("job %s paused (%s); it resumes on the next scan", job_id, exc)
                self._orphan(job_id)
            else:
                log.exception("job %s failed", job_id)
                await self.store.finish(job_id, FAILED, error=error_body(
                    str(ErrorCode.INTERNAL), f"the job failed in the gateway: {exc}"))
        finally:
            keeper.cancel()
            self._wake.pop(job_id, None)
            self._known.pop(job_id, None)
            # Released, so that another gateway takes over at its next scan; if this fails
            # the lease lapses by itself.
            with contextlib.suppress(Exception):
                await asyncio.shield(self.store.release(job_id, self.owner))

    # --- publishing ----------------------------------------------------------------------

    async def _publish_all(self, job: Job, entry: ModelEntry) -> bool:
        """Publish the parts not yet published; False if the job stopped meanwhile."""
        if job.published >= job.parts_total:
            return True
        if not job.bulk:
            request = msgpack.unpackb(await asyncio.to_thread(self.blobs().get, job.input),
                                      raw=False)
            if not await self._publish(job, entry, 0, request):
                return False
            self._count_published(job.id, 1)
            if not await self.store.published(job.id, 1, 0, 0, job.items_total):
                await self.revoke(job.id, 1)
                return False
            return True
        blobs = self.blobs()
        reader = await asyncio.to_thread(
            lambda: PartReader(blobs.open_read(job.input), job.offset, job.part_items))
        try:
            index, first = job.published, job.next_item
            while index < job.parts_total:
                if not await self._room(job, index):
                    return False
                items = await asyncio.to_thread(reader.next_part)
                if not items:
                    raise RuntimeError(f"the input {job.input} ended before part {index}: "
                                       "it changed after it was checked")
                kwargs: dict[str, Any] = {"model": entry.id, "items": items,
                                          "options": job.options}
                if job.query is not None:
                    kwargs["query"] = job.query
                if not await self._publish(job, entry, index, kwargs):
                    return False
                index += 1
                self._count_published(job.id, index)
                if not await self.store.published(job.id, index, reader.offset, first,
                                                  len(items)):
                    await self.revoke(job.id, index)  # stopped, or gone from Redis
                    return False
                first += len(items)
            return True
        finally:
            await asyncio.to_thread(reader.close)

    def _count_published(self, job_id: str, published: int) -> None:
        """Counted before Redis is told: a part on the broker must be revoked if the job
        vanishes, whether or not Redis heard of it."""
        known = self._known.get(job_id)
        if known is not None:
            known.published = max(known.published, published)

    async def _publish(self, job: Job, entry: ModelEntry, index: int,
                       kwargs: dict[str, Any]) -> bool:
        timeout_ms = int(self.settings.job_part_timeout_s * 1000)
        # Large images go through the blob store here too; each publish of a part (a
        # takeover may publish it again) has its own claims, deleted by its worker's ack.
        kwargs, uploads = await check_out(kwargs, self.settings.claim_check_bytes)
        if uploads:
            await upload_first(self.settings.blob_url, uploads)
        # Marked bulk: a worker runs it after the requests callers wait for (issue 29).
        part = dataclasses.replace(task_part(entry, kwargs, timeout_ms, claims=len(uploads),
                                             bulk=True),
                                   task_id=part_id(job.id, index))
        while True:
            try:
                await self.broker.publish_part(entry.id, part, timeout_ms / 1000,
                                               self.reply_to)
                return True
            except ApiError as exc:
                if exc.code not in RETRY_CODES:
                    raise
                # A full queue (or no broker): wait, as a client would on 429.
                log.info("job %s part %d waits: %s", job.id, index, exc.message)
                await asyncio.sleep(max(exc.retry_after or 1, POLL_S))
            if not await self._still_active(job):
                return False

    async def _room(self, job: Job, published: int) -> bool:
        """Wait until fewer than SHOAL_JOB_PARTS_IN_FLIGHT parts are out; False if the job
        stopped (its outstanding parts are then revoked)."""
        while True:
            state, done = await self._counts(job.id)
            if state not in ("queued", "running"):
                await self.revoke(job.id, published)
                return False
            if published - done < self.settings.job_parts_in_flight:
                return True
            await self._sleep(job.id)

    async def _wait_done(self, job: Job) -> bool:
        while True:
            state, done = await self._counts(job.id)
            if state not in ("queued", "running"):
                await self.revoke(job.id, job.parts_total)
                return False
            if done >= job.parts_total:
                return True
            await self._sleep(job.id)

    async def _counts(self, job_id: str) -> tuple[str, int]:
        state, done = await self.store.redis.hmget(self.store.key(job_id), "state",
                                                   "parts_done")
        return (state or b"").decode(), int(done or 0)

    async def _still_active(self, job: Job) -> bool:
        state, _ = await self._counts(job.id)
        return state in ("queued", "running")

    async def _sleep(self, job_id: str) -> None:
        event = self._wake.get(job_id)
        if event is None:
            await asyncio.sleep(POLL_S)
            return
        try:
            async with asyncio.timeout(POLL_S):
                await event.wait()
        except TimeoutError:
            pass
        event.clear()

    # --- jobs whose driver lost Redis -----------------------------------------------------

    def _orphan(self, job_id: str) -> None:
        """Keep the job of a driver that stopped for want of Redis (or of the broker, or
        the blob store) until Redis says whether it is still there."""
        known = self._known.pop(job_id, None)
        if known is None or self._closing:
            return
        self._orphans[job_id] = known
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch_orphans())

    async def _watch_orphans(self) -> None:
        """Every POLL_S until Redis answers for each orphan: there, it is left to the scan
        (which drives it again); gone, it is stopped here at once. The scan cannot do it:
        a Redis restarted empty lists nothing, and the sweep only takes folders an hour
        old."""
        while self._orphans and not self._closing:
            await asyncio.sleep(POLL_S)
            for job_id, known in list(self._orphans.items()):
                try:
                    there = await self.store.redis.exists(self.store.key(job_id))
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.debug("Redis still away (%s); job %s waits", exc, job_id)
                    break  # the next turn asks again
                if self._orphans.get(job_id) is not known:
                    continue  # a driver took it back meanwhile
                del self._orphans[job_id]
                if not there:
                    await self._vanished(known)

    async def _vanished(self, known: _Known) -> None:
        """Stop a job that vanished from Redis while its driver waited for Redis: revoke
        every part it published (what Redis had recorded of them went with it; revoking
        one already answered does nothing) and delete its folder. Nothing is written to
        Redis: the job stays gone (404)."""
        log.warning("job %s is gone from Redis (restarted without persistence?) while its "
                    "driver waited for it; revoking its %d parts published and deleting its "
                    "files", known.job_id, known.published)
        if known.published:
            await self.broker.cancel([part_id(known.job_id, i)
                                      for i in range(known.published)])
        try:
            await asyncio.to_thread(self.blobs().delete, [known.folder], True)
        except Exception as exc:  # the blob store away: the sweep takes them later
            log.warning("could not delete the files of vanished job %s: %s", known.job_id,
                        exc)

    async def revoke(self, job_id: str, published: int) -> None:
        """Revoke the parts published and not answered: a worker answers them CANCELLED
        without running them; one already running finishes and its result is dropped."""
        recorded = await self.store.recorded(job_id)
        ids = [part_id(job_id, i) for i in range(published) if i not in recorded]
        if ids:
            await self.broker.cancel(ids)

    # --- gathering -----------------------------------------------------------------------

    async def _gather(self, job: Job, entry: ModelEntry) -> None:
        parts = await self.store.parts(job.id)
        blobs = self.blobs()
        if job.bulk:
            metas = [msgpack.unpackb(parts[i], raw=False) for i in range(job.parts_total)]
            key, kind = await asyncio.to_thread(gather, blobs, job.folder, metas)
            if not await self.store.finish(job.id, SUCCEEDED, result_file=key,
                                           result_type=kind):
                await asyncio.to_thread(blobs.delete, [key])  # cancelled meanwhile
                return
            if job.owns_input:
                await asyncio.to_thread(blobs.delete, [job.input])
            return
        result = msgpack.unpackb(parts[0], raw=False)
        request = msgpack.unpackb(await asyncio.to_thread(blobs.get, job.input), raw=False)
        body = payload(job.operation, entry.parse(request), result)
        body["model"] = body["model"] or job.model
        await self.store.finish(job.id, SUCCEEDED, result=body)
        await asyncio.to_thread(blobs.delete, [job.folder], True)
