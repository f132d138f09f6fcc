"""A job's parts on the broker: published with bounded parts in flight, waited for, revoked.

The driver (`gateway.jobs.driver`) holds the job's lease; this publishes the parts not
yet published, from the recorded resume point (parts published, input offset), as
ordinary task messages marked bulk, each with its part's id (`part_id`: a part published
again after a takeover keeps it, so its result counts once), never more than
SHOAL_JOB_PARTS_IN_FLIGHT unanswered, of the job nor of all its API key's jobs on its
model together (`gateway.jobs.key_jobs`: a key's fair share). A full queue (or no broker,
or no worker for the model) makes a part wait and try again, as a client would on 429.
Each part is counted as it goes out, before Redis records it (`Orphans.published`), and
Redis then records the resume point.

Parts are answered through `gateway.jobs.part_replies`, whichever gateway consumes them:
a wait here wakes when one is recorded here (`notify`) and re-reads the counts in Redis
every POLL_S otherwise. A job that stops meanwhile (cancelled, failed, gone) ends the
wait with its parts published and not answered revoked.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgpack

from gateway.calls.blob_offload import check_out, upload_first
from gateway.edge.api_errors import ApiError
from gateway.jobs.batch_lines import Record, RecordReader
from gateway.jobs.batch_output import lines_key
from gateway.jobs.bulk_files import PartReader
from gateway.jobs.key_jobs import KeyJobs
from gateway.jobs.orphans import Orphans
from gateway.jobs.part_replies import part_id, replies_queue
from gateway.jobs.part_revokes import PartRevokes
from gateway.jobs.store import Job, JobStore
from tasks.catalog import ModelEntry
from tasks.envelope import task_part
from tasks.errors import ErrorCode
from tasks.settings import Settings

log = logging.getLogger(__name__)

LINE_PART_ITEMS = 32  # batch lines in flight per SHOAL_JOB_PARTS_IN_FLIGHT
LINES_PER_MESSAGE = LINE_PART_ITEMS  # batch lines coalesced into one task message
POLL_S = 0.5  # how often a waiting driver re-reads counts another gateway may have moved
RETRY_CODES = frozenset({ErrorCode.QUEUE_FULL, ErrorCode.BROKER_UNAVAILABLE,
                         ErrorCode.MODEL_UNAVAILABLE})  # a part waits and tries again


class PartPublisher:
    """Publishes the parts of the jobs driven here and waits for their answers."""

    def __init__(self, settings: Settings, store: JobStore, broker: Any,
                 blobs: Callable[[], Any], orphans: Orphans, keys: KeyJobs,
                 revokes: PartRevokes) -> None:
        self.settings = settings
        self.store = store
        self.keys = keys
        self.revokes = revokes
        self.broker = broker
        self.blobs = blobs
        self.orphans = orphans
        self.reply_to = replies_queue(settings.queue_prefix)
        self._wake: dict[str, asyncio.Event] = {}
        # The jobs driven here by key and model (a key's share): a part of one answered
        # wakes the others too, which may be waiting for the key's place it frees.
        self._share: dict[tuple[str | None, str], set[str]] = {}
        self._share_of: dict[str, tuple[str | None, str]] = {}
        # A key's place is checked and taken (published, recorded) under its share's lock:
        # two of its jobs driven here cannot both take its last place.
        self._share_locks: dict[tuple[str | None, str], asyncio.Lock] = {}

    def watch(self, job_id: str) -> None:
        """A driver here drives `job_id` from now on: its waits wake on `notify`."""
        self._wake[job_id] = asyncio.Event()

    def unwatch(self, job_id: str) -> None:
        self._wake.pop(job_id, None)
        share = self._share_of.pop(job_id, None)
        if share is not None:
            self._share[share].discard(job_id)
            if not self._share[share]:
                del self._share[share]
                lock = self._share_locks.get(share)
                if lock is not None and not lock.locked():
                    del self._share_locks[share]

    def notify(self, job_id: str) -> None:
        """A part of `job_id` was recorded here: wake its waits if it is driven here, and
        those of its key's other jobs on its model driven here (a place of the key's share
        may be free)."""
        share = self._share_of.get(job_id)
        others = self._share.get(share, ()) if share is not None else ()
        for other in (job_id, *others):
            event = self._wake.get(other)
            if event is not None:
                event.set()

    async def publish_all(self, job: Job, entry: ModelEntry) -> bool:
        """Publish the parts not yet published; False if the job stopped meanwhile."""
        if job.published >= job.parts_total:
            return True
        if not job.bulk:
            request = msgpack.unpackb(await asyncio.to_thread(self.blobs().get, job.input),
                                      raw=False)
            if not await self._publish(job, entry, 0, request):
                return False
            self.orphans.published(job.id, 1)
            if not await self.store.published(job.id, 1, 0, 0, job.items_total):
                await self.revoke(job.id, 1)
                return False
            return True
        if job.batch:
            return await self._publish_lines(job, entry)
        blobs = self.blobs()
        reader = await asyncio.to_thread(
            lambda: PartReader(blobs.open_read(job.input), job.offset, job.part_items))
        try:
            index, first = job.published, job.next_item
            while index < job.parts_total:
                async with self._place(job, index) as room:
                    if not room:
                        return False
                    items = await asyncio.to_thread(reader.next_part)
                    if not items:
                        raise RuntimeError(f"the input {job.input} ended before part "
                                           f"{index}: it changed after it was checked")
                    kwargs: dict[str, Any] = {"model": entry.id, "items": items,
                                              "options": job.options}
                    if job.query is not None:
                        kwargs["query"] = job.query
                    if not await self._publish(job, entry, index, kwargs):
                        return False
                    index += 1
                    self.orphans.published(job.id, index)
                    if not await self.store.published(job.id, index, reader.offset, first,
                                                      len(items)):
                        await self.revoke(job.id, index)  # stopped, or gone from Redis
                        return False
                first += len(items)
            return True
        finally:
            await asyncio.to_thread(reader.close)

    async def _publish_lines(self, job: Job, entry: ModelEntry) -> bool:
        """An OpenAI batch's lines (its parts: one request each, made at acceptance, id
        `<job>.<line>`), LINES_PER_MESSAGE to a coalesced message, so that a few messages
        stand in the model's queue before a caller's request, not hundreds; a line whose
        images go as claim checks goes alone. False if the job stopped meanwhile."""
        blobs = self.blobs()
        reader = await asyncio.to_thread(
            lambda: RecordReader(blobs.open_read(lines_key(job.folder)), job.offset))
        timeout_ms = int(self.settings.job_part_timeout_s * 1000)

        def read(count: int) -> list[Record]:
            records = [r for r in (reader.next() for _ in range(count)) if r is not None]
            if len(records) < count:
                raise RuntimeError(f"the lines of batch {job.batch} ended early: they "
                                   "changed after they were checked")
            return records

        try:
            index = job.published
            while index < job.parts_total:
                async with self._place(job, index) as room:
                    if not room:
                        return False
                    records = await asyncio.to_thread(
                        read, min(LINES_PER_MESSAGE, job.parts_total - index))
                    together = []
                    for offset, record in enumerate(records):
                        kwargs, uploads = await check_out(record.kwargs,
                                                          self.settings.claim_check_bytes)
                        if uploads:  # a claim-checked request is a message of its own
                            if not await self._publish(job, entry, index + offset,
                                                       record.kwargs):
                                return False
                            continue
                        together.append(dataclasses.replace(
                            task_part(entry, kwargs, timeout_ms, bulk=True),
                            task_id=part_id(job.id, index + offset)))
                    if together and not await self._send(
                            job, index, lambda parts=together: self.broker.publish_parts(
                                entry.id, parts, timeout_ms / 1000, self.reply_to)):
                        return False
                    first, index = index, index + len(records)
                    self.orphans.published(job.id, index)
                    if not await self.store.published(job.id, index, reader.offset, first,
                                                      len(records)):
                        await self.revoke(job.id, index)  # stopped, or gone from Redis
                        return False
            return True
        finally:
            await asyncio.to_thread(reader.close)

    async def wait_done(self, job: Job) -> bool:
        """Wait until every part is answered; False if the job stopped first (its parts
        not answered are then revoked)."""
        while True:
            state, done = await self._counts(job.id)
            if state not in ("queued", "running"):
                await self.revoke(job.id, job.parts_total)
                return False
            if done >= job.parts_total:
                return True
            await self._sleep(job.id)

    async def revoke(self, job_id: str, published: int) -> None:
        """Revoke the parts published and not answered: a worker answers them CANCELLED
        without running them; one already running finishes and its result is dropped. A
        revoke the broker does not take is sent again until it does (`PartRevokes`)."""
        recorded = await self.store.recorded(job_id)
        await self.revokes.revoke([part_id(job_id, i) for i in range(published)
                                   if i not in recorded])

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
        return await self._send(job, index, lambda: self.broker.publish_part(
            entry.id, part, timeout_ms / 1000, self.reply_to))

    async def _send(self, job: Job, index: int, publish: Callable[[], Awaitable[None]]
                    ) -> bool:
        """Publish (`publish()`) until the broker takes it; False if the job stopped."""
        while True:
            try:
                await publish()
                return True
            except ApiError as exc:
                if exc.code not in RETRY_CODES:
                    raise
                # A full queue (or no broker): wait, as a client would on 429.
                log.info("job %s part %d waits: %s", job.id, index, exc.message)
                await asyncio.sleep(max(exc.retry_after or 1, POLL_S))
            if not await self._still_active(job):
                return False

    @contextlib.asynccontextmanager
    async def _place(self, job: Job, published: int) -> AsyncIterator[bool]:
        """Wait until fewer than SHOAL_JOB_PARTS_IN_FLIGHT parts of the job are out, and
        fewer than that many of all its key's jobs on its model (the key's fair share,
        `gateway.jobs.key_jobs`), and hold that place while the part is published and
        recorded (True); False if the job stopped (its outstanding parts are then
        revoked). Another gateway's jobs of the key are counted from Redis, so across
        gateways a key may briefly hold one extra place per gateway."""
        share = (job.owner, job.model)
        self._share_of[job.id] = share
        self._share.setdefault(share, set()).add(job.id)
        lock = self._share_locks.setdefault(share, asyncio.Lock())
        while True:
            state, done = await self._counts(job.id)
            if state not in ("queued", "running"):
                await self.revoke(job.id, published)
                yield False
                return
            if published - done < self._in_flight(job):
                async with lock:
                    if await self.keys.in_flight(job.owner, job.model, LINE_PART_ITEMS
                                                 ) < self.settings.job_parts_in_flight:
                        yield True
                        return
            await self._sleep(job.id)

    def _in_flight(self, job: Job) -> int:
        """Parts out at once: SHOAL_JOB_PARTS_IN_FLIGHT; for an OpenAI batch, whose parts
        are single requests, as many lines as that many parts of LINE_PART_ITEMS would
        hold (they are marked bulk: callers who wait still go first)."""
        parts = self.settings.job_parts_in_flight
        return parts * LINE_PART_ITEMS if job.batch else parts

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
