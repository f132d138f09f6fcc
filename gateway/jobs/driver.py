"""Drive jobs: hold their leases, have their parts published, gather their results.

One gateway drives a job at a time: the holder of its lease in Redis, which it
renews every third of SHOAL_JOB_LEASE_S. Every gateway scans the active jobs as
often and takes over a lease that expired (its holder died or lost Redis), then
continues from the recorded resume point (parts published, input offset). A part
published again after a takeover keeps its id (`part_id`), so its result counts
once. Results are recorded by whichever gateway consumes them (`gateway.jobs.part_replies`),
which wakes the driver here if it is this one; a driver elsewhere notices within
POLL_S. Publishing the parts, bounded in flight, and waiting for their answers:
`gateway.jobs.part_publisher`.

Cancelling or failing a job is a state change in Redis; the driver (or the DELETE
route, whichever comes first) then revokes the parts published and not answered. A job
whose record vanished from Redis (restarted without persistence) is stopped the same
way: its parts revoked, its files deleted; nothing writes its record again. That holds
too when Redis went away first and came back empty: a driver that stops for want of Redis
keeps its job in memory (`gateway.jobs.orphans`: its folder, the parts it published)
and checks every WATCH_S until Redis answers; if the job is gone then, nothing in Redis
lists it any more, so that is the only place left that can revoke its parts and delete
its files.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgpack

from gateway.calls.native_api import payload  # the sync route's response shape
from gateway.jobs.batch_output import finish_batch
from gateway.jobs.bulk_files import gather
from gateway.jobs.key_jobs import KeyJobs
from gateway.jobs.orphans import Orphans
from gateway.jobs.part_publisher import PartPublisher
from gateway.jobs.part_revokes import PartRevokes
from gateway.jobs.store import FAILED, SUCCEEDED, Job, JobStore, error_body, transient
from tasks.catalog import ModelEntry
from tasks.errors import ErrorCode
from tasks.settings import Settings

log = logging.getLogger(__name__)

SWEEP_MIN_AGE_S = 3600.0
CLOSE_WAIT_S = 2.0  # the most a gateway's shutdown waits for its job tasks to stop


class JobDriver:
    """The jobs this gateway drives: the scan that takes expired leases, one task per job
    driven (its lease kept, its parts published and waited for, its result gathered)."""

    def __init__(self, settings: Settings, store: JobStore, broker: Any,
                 served: dict[str, ModelEntry], blobs: Callable[[], Any]) -> None:
        self.settings = settings
        self.store = store
        self.broker = broker
        self.served = served
        self.blobs = blobs
        self.owner = f"gateway@{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.lease_s = settings.job_lease_s
        self._driving: dict[str, asyncio.Task] = {}
        self._scanner: asyncio.Task | None = None
        self._closing = False
        # The jobs driven here now, and those whose driver stopped for want of Redis, until
        # Redis answers again: then each is either there (the scan drives it again) or gone
        # (cleaned up there).
        self.revokes = PartRevokes(broker)  # sent again until the broker takes them
        self._orphans = Orphans(store, self.revokes.revoke, blobs)
        self.keys = KeyJobs(store)  # the API keys' limits and fair share
        self._parts = PartPublisher(settings, store, broker, blobs, self._orphans, self.keys,
                                    self.revokes)
        self._adopter: asyncio.Task | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._scanner = loop.create_task(self._scan_forever())
        self._adopter = loop.create_task(self._adopt_paused())

    async def _adopt_paused(self) -> None:
        """The jobs paused by gateways before this one started (their records in the blob
        store, `gateway.jobs.paused_jobs`): read once the blob store answers, then watched
        as this gateway's own orphans until Redis says whether each is still there."""
        while not self._closing:
            try:
                found = await self._orphans.records.read_all()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("cannot read the paused jobs' records (%s); trying again", exc)
                await asyncio.sleep(self.lease_s / 3)
                continue
            await self._orphans.adopt(found)
            return

    async def close(self) -> None:
        """Stop scanning and driving (on the gateway's shutdown), waiting CLOSE_WAIT_S at
        most: a cancel that lands inside the Redis client can be swallowed there (seen:
        the scanner then slept on, and a drained gateway never exited), so the scanner
        also stops at its next turn, and shutdown never waits for it longer than that."""
        self._closing = True
        watcher, retrier = self._orphans.close(), self.revokes.close()
        tasks = [t for t in (self._scanner, self._adopter, watcher, retrier,
                             *self._driving.values()) if t is not None and not t.done()]
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
        self._parts.notify(job_id)

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
        self._parts.watch(job_id)
        try:
            job = await self.store.get(job_id)
            if job is None:
                await self.store.forget(job_id)
                return
            await self._orphans.driving(job_id, job.folder, job.published)
            entry = self.served.get(job.model)
            if not job.active:  # cancelled while no driver held it: its files go now
                await self.drop_files(job, always=True)
                return
            if entry is None:
                return  # a model this gateway does not serve: left to one that does
            if await self.store.mark_running(job_id) and \
                    await self._parts.publish_all(job, entry) and \
                    await self._parts.wait_done(job):
                await self._gather(job, entry)
            else:  # cancelled, failed or gone: its files go (the caller's own input stays)
                await self.drop_files(job, always=True)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if transient(exc):
                log.warning("job %s paused (%s); it resumes on the next scan", job_id, exc)
                await self._orphans.orphan(job_id)
            else:
                log.exception("job %s failed", job_id)
                await self.store.finish(job_id, FAILED, error=error_body(
                    str(ErrorCode.INTERNAL), f"the job failed in the gateway: {exc}"))
        finally:
            keeper.cancel()
            self._parts.unwatch(job_id)
            self._orphans.stopped(job_id)
            # Released, so that another gateway takes over at its next scan; if this fails
            # the lease lapses by itself.
            with contextlib.suppress(Exception):
                await asyncio.shield(self.store.release(job_id, self.owner))

    async def revoke(self, job_id: str, published: int) -> None:
        """Revoke the parts published and not answered (see `PartPublisher.revoke`)."""
        await self._parts.revoke(job_id, published)

    async def drop_files(self, job: Job, always: bool = False) -> None:
        """Delete the folder of a job that ended without a result (cancelled, failed, or
        gone from Redis), at once rather than at the hourly sweep: its upload, part files
        and pause record (a caller's own input lies elsewhere and stays); a job that
        succeeded keeps it (its result). Unless `always` (its driver), only if no driver
        holds its lease: one that does deletes it when it sees the job stop (within
        POLL_S), and a part file it is writing must not outlive the folder. An OpenAI
        batch's folder goes when its cancel has written its files (`finish_cancelled`)."""
        if job.batch or not job.folder:
            return
        if not always and await self.store.redis.exists(self.store.lease_key(job.id)):
            return
        state = await self.store.redis.hget(self.store.key(job.id), "state")
        if state is None or state in (b"cancelled", b"failed"):  # never a result's folder
            await asyncio.to_thread(self.blobs().delete, [job.folder], True)

    # --- gathering -----------------------------------------------------------------------

    async def _gather(self, job: Job, entry: ModelEntry) -> None:
        blobs = self.blobs()
        if job.batch:  # an OpenAI batch: its lines' answers are read in chunks there
            await finish_batch(self.store, blobs, job)
            return
        parts = await self.store.parts(job.id)
        if job.bulk:
            metas = [msgpack.unpackb(parts[i], raw=False) for i in range(job.parts_total)]
            key, kind = await asyncio.to_thread(gather, blobs, job.folder, metas)
            if not await self.store.finish(job.id, SUCCEEDED, result_file=key,
                                           result_type=kind):
                await asyncio.to_thread(blobs.delete, [job.folder], True)  # cancelled
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
