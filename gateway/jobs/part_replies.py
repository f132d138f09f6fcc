"""The jobs' reply queue: every gateway consumes it, whichever is up records part results.

Job parts are published with `reply_to` = `{prefix}.jobs.replies`, a durable quorum
queue every gateway declares and consumes (competing consumers). A part's result
outlives the gateway that published it: a message is acked only once its results are
recorded (part file written, then counted in Redis), so a gateway that dies midway
leaves it to be redelivered to another, and recording is idempotent (HSETNX per part
index) so a duplicate never counts twice.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import Any

import aio_pika
import msgpack
from aio_pika.abc import AbstractIncomingMessage

from gateway.jobs.bulk_files import encode_part, part_key
from gateway.jobs.store import FAILED, Job, JobStore, error_body, transient
from tasks.envelope import H_MULTI, PROGRESS, SUCCESS, decode_results
from tasks.errors import ErrorCode, ShoalError

log = logging.getLogger(__name__)

PREFETCH = 32
# A recording that failed (Redis or the blob store away) is retried after this.
RETRY_S = 1.0


def replies_queue(prefix: str) -> str:
    return f"{prefix}.jobs.replies"


def part_id(job_id: str, index: int) -> str:
    """A part's task id: deterministic, so that a part published again after a takeover
    is the same request (its duplicate result is recognised and dropped)."""
    return f"{job_id}.{index}"


def parse_part_id(task_id: str) -> tuple[str, int] | None:
    job_id, _, index = task_id.rpartition(".")
    return (job_id, int(index)) if job_id and index.isdigit() else None


class JobReplies:
    def __init__(self, store: JobStore, prefix: str, blobs: Callable[[], Any],
                 on_recorded: Callable[[str], None]) -> None:
        self.store = store
        self.queue = replies_queue(prefix)
        self.blobs = blobs  # the blob store, opened on first use
        self.on_recorded = on_recorded

    async def attach(self, connection: aio_pika.abc.AbstractRobustConnection) -> None:
        channel = await connection.channel(publisher_confirms=False)
        # Per-consumer prefetch: quorum queues refuse a global QoS.
        await channel.set_qos(prefetch_count=PREFETCH)
        queue = await channel.declare_queue(self.queue, durable=True,
                                            arguments={"x-queue-type": "quorum"})
        await queue.consume(self._on_message)

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        try:
            results = decode_results(message.body, bool(message.headers.get(H_MULTI)))
        except Exception:  # a malformed reply must not kill the consumer, nor come back
            log.exception("undecodable job reply dropped")
            await message.ack()
            return
        for result in results:
            while True:
                try:
                    await self.record(result, message.correlation_id)
                    break
                except Exception as exc:
                    if not transient(exc):
                        await self._broken(result, message.correlation_id, exc)
                        break
                    # Redis or the blob store is away: keep the message (unacked, so
                    # another gateway gets it if this one dies) and try again.
                    log.warning("cannot record a job reply (%s); retrying in %.0fs", exc,
                                RETRY_S)
                    await asyncio.sleep(RETRY_S)
        await message.ack()

    async def _broken(self, result: dict[str, Any], correlation_id: str | None,
                      exc: Exception) -> None:
        """A result that cannot be recorded (not the shape its operation gives): its job
        fails, rather than the reply coming back for ever."""
        log.error("job reply %s cannot be recorded", result.get("task_id"), exc_info=exc)
        ids = parse_part_id(str(result.get("task_id") or correlation_id or ""))
        if ids is not None:
            await self.store.finish(ids[0], FAILED, error=error_body(
                str(ErrorCode.INTERNAL), f"the result of part {ids[1]} could not be "
                f"recorded: {exc!r}"))

    async def record(self, result: dict[str, Any], correlation_id: str | None) -> None:
        status = result.get("status")
        if status == PROGRESS:
            return
        ids = parse_part_id(str(result.get("task_id") or correlation_id or ""))
        if ids is None:
            log.warning("a reply on the jobs' queue for no job part dropped: %s",
                        result.get("task_id"))
            return
        job_id, index = ids
        job = await self.store.get(job_id)
        if job is None or not job.active:
            return  # a late result of a cancelled, failed or expired job
        if status == SUCCESS:
            await self._succeeded(job, index, result["result"])
        elif job.batch:
            await self._line_failed(job, index, result.get("result"))
        else:
            await self._failed(job, index, ShoalError.from_celery_failure(result.get("result")))
        self.on_recorded(job_id)

    async def _succeeded(self, job: Job, index: int, result: dict[str, Any]) -> None:
        if job.batch:  # an OpenAI batch's line: its result kept whole, counted as done
            value = msgpack.packb([1, result], use_bin_type=True)
            await self.store.record(job.id, index, value, 1)
            return
        if not job.bulk:
            value = msgpack.packb(result, use_bin_type=True)
            await self.store.record(job.id, index, value, job.items_total)
            return
        kind, data, items, dims = encode_part(job.operation, result)
        # Written before it is counted: a counted part always has its file (a crash in
        # between leaves a file nobody counts, removed with the parts at the end). A file
        # of its own: a second copy of the part, answered late, must not rewrite the one
        # counted while the driver gathers it.
        key = part_key(job.folder, index, uuid.uuid4().hex[:12])
        await asyncio.to_thread(self.blobs().put, key, data)
        meta = msgpack.packb({"kind": kind, "items": items, "dims": dims, "file": key},
                             use_bin_type=True)
        if await self.store.record(job.id, index, meta, items) == -1:
            # The job ended while the file was written: a late part of a job cancelled or
            # failed must not bring back its folder, deleted when it ended.
            state = await self.store.redis.hget(self.store.key(job.id), "state")
            late = [job.folder] if state in (None, b"cancelled", b"failed") else [key]
            await asyncio.to_thread(self.blobs().delete, late, True)

    async def _line_failed(self, job: Job, index: int, failure: Any) -> None:
        """A batch line the model refused is that line's answer (an error line), not the
        batch's end; counted as a part, not as an item done."""
        if ShoalError.from_celery_failure(failure).code == ErrorCode.CANCELLED:
            return  # revoked: only a cancelled batch's lines are
        value = msgpack.packb([0, failure], use_bin_type=True)
        await self.store.record(job.id, index, value, 0)

    async def _failed(self, job: Job, index: int, error: ShoalError) -> None:
        if error.code == ErrorCode.CANCELLED:
            return  # revoked: only a cancelled (or failed) job's parts are
        where = ""
        if job.bulk:
            first, last = await self.store.part_range(job.id, index)
            where = f"part {index} (items {first}-{last}, counted from 1) failed: "
        await self.store.finish(job.id, FAILED,
                                error=error_body(str(error.code), where + error.message))
