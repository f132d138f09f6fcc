"""OpenAI batches in Redis, and the batch object that `/v1/batches` shows.

A batch is a record (`{prefix}:batch:{id}`, a hash of JSON values, one per field so
that the driver and a cancel never overwrite each other's fields) over a job of the
jobs system (`Job.batch`: one part per line the batch runs). The record holds what the
caller gave and what the batch's end wrote (file ids, final counts, its status and
times); while its job runs, status and counts are read from the job (`batch_object`).
Batches are listed per owner (`{prefix}:batches:{owner}`, by creation time). A finished
batch's record is kept SHOAL_JOB_TTL_S, as its job is; its files stay until deleted.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import orjson

from gateway.jobs.openai_files import NO_OWNER
from gateway.jobs.store import CANCELLED, FAILED, SUCCEEDED, Job, JobStore

VALIDATING, IN_PROGRESS, FINALIZING, COMPLETED = ("validating", "in_progress", "finalizing",
                                                  "completed")
FAILED_, EXPIRED, CANCELLING, CANCELLED_ = "failed", "expired", "cancelling", "cancelled"
FINAL = frozenset({FAILED_, COMPLETED, EXPIRED, CANCELLED_})
WINDOW_S = {"24h": 24 * 3600}


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


@dataclass(slots=True)
class Batch:
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None
    owner: str = NO_OWNER
    model: str = ""
    job_id: str = ""  # empty when no line could run (the batch ended at once)
    status: str = IN_PROGRESS
    total: int = 0  # lines of the input
    refused: int = 0  # lines answered at acceptance, in the error file, never run
    completed: int = 0  # final counts, written at the end
    failed: int = 0
    errors: list[dict[str, Any]] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: float = 0.0
    in_progress_at: float | None = None
    finalizing_at: float | None = None
    completed_at: float | None = None
    failed_at: float | None = None
    cancelling_at: float | None = None
    cancelled_at: float | None = None
    expired_at: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # room for later fields

    @property
    def final(self) -> bool:
        return self.status in FINAL


_NAMES = frozenset(f.name for f in fields(Batch))


class BatchStore:
    """Batch records in the jobs' Redis (the JobStore's client and key prefix)."""

    def __init__(self, jobs: JobStore) -> None:
        self.jobs = jobs

    def key(self, batch_id: str) -> str:
        return f"{self.jobs.prefix}:batch:{batch_id}"

    def index(self, owner: str) -> str:
        return f"{self.jobs.prefix}:batches:{owner}"

    async def create(self, batch: Batch) -> None:
        batch.created_at = batch.created_at or time.time()
        mapping = {k: orjson.dumps(v) for k, v in asdict(batch).items()}
        async with self.jobs.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.key(batch.id), mapping=mapping)
            pipe.zadd(self.index(batch.owner), {batch.id: batch.created_at})
            if batch.final:
                pipe.expire(self.key(batch.id), self.jobs.ttl_s)
            await pipe.execute()

    async def get(self, batch_id: str) -> Batch | None:
        raw = await self.jobs.redis.hgetall(self.key(batch_id))
        if not raw:
            return None
        values = {k.decode(): orjson.loads(v) for k, v in raw.items()}
        return Batch(**{k: v for k, v in values.items() if k in _NAMES})

    async def update(self, batch_id: str, **values: Any) -> None:
        """Set fields; a final status starts the record's TTL."""
        async with self.jobs.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.key(batch_id), mapping={k: orjson.dumps(v)
                                                   for k, v in values.items()})
            if values.get("status") in FINAL:
                pipe.expire(self.key(batch_id), self.jobs.ttl_s)
            await pipe.execute()

    async def page(self, owner: str, limit: int, after: str | None
                   ) -> tuple[list[Batch], bool]:
        """Up to `limit` of `owner`'s batches, newest first, after the batch `after`."""
        redis = self.jobs.redis
        index = self.index(owner)
        start = 0
        if after is not None:
            rank = await redis.zrevrank(index, after)
            start = 0 if rank is None else rank + 1
        found: list[Batch] = []
        while len(found) <= limit:
            ids = await redis.zrevrange(index, start, start + limit)
            if not ids:
                break
            start += len(ids)
            for batch_id in ids:
                batch = await self.get(batch_id.decode())
                if batch is None:  # expired: its index entry goes too
                    await redis.zrem(index, batch_id)
                else:
                    found.append(batch)
        return found[:limit], len(found) > limit


def final_fields(batch: Batch, job: Job | None) -> dict[str, Any] | None:
    """What the record lacks once the batch's job has ended without the driver or the
    cancel having written it (a gateway that died in between): the fields to set, or
    None while the job runs (or the record is already final)."""
    if batch.final or job is None or job.active:
        if job is None and not batch.final and batch.job_id:
            # Its job is gone from Redis (lost with a Redis that does not persist).
            return {"status": FAILED_, "failed_at": time.time(), "errors": [
                {"code": "job_lost", "message": "the batch's job is gone from Redis (was it "
                 "restarted without persistence?); create the batch again", "line": None,
                 "param": None}]}
        return None
    if job.state == SUCCEEDED:
        output, _, errors = job.result_file.partition(" ")
        return {"status": COMPLETED, "completed_at": job.finished_at,
                "output_file_id": output or None, "error_file_id": errors or None,
                "completed": job.items_done,
                "failed": batch.refused + job.parts_done - job.items_done}
    if job.state == FAILED:
        error = job.error or {}
        return {"status": FAILED_, "failed_at": job.finished_at, "errors": [
            {"code": str(error.get("code", "failed")), "message": str(error.get("message", "")),
             "line": None, "param": None}]}
    if job.state == CANCELLED:
        return None  # the cancel writes the partial output; until then it is cancelling
    return None


def batch_object(batch: Batch, job: Job | None) -> dict[str, Any]:
    """The batch as OpenAI's API shows it: its record, with status and counts from its
    job while that runs."""
    status, completed, failed = batch.status, batch.completed, batch.failed
    finalizing_at = batch.finalizing_at
    if not batch.final and job is not None:
        completed = job.items_done
        failed = batch.refused + job.parts_done - job.items_done
        if status == IN_PROGRESS and job.active and job.parts_done >= job.parts_total:
            status = FINALIZING
        elif status == IN_PROGRESS and job.state == CANCELLED:
            status = CANCELLING
    window = WINDOW_S.get(batch.completion_window, 0)

    def at(value: float | None) -> int | None:
        return None if value is None else int(value)

    return {
        "id": batch.id, "object": "batch", "endpoint": batch.endpoint,
        "errors": None if not batch.errors else {"object": "list", "data": batch.errors},
        "input_file_id": batch.input_file_id, "completion_window": batch.completion_window,
        "status": status, "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id, "created_at": at(batch.created_at),
        "in_progress_at": at(batch.in_progress_at),
        "expires_at": at(batch.created_at + window) if window else None,
        "finalizing_at": at(finalizing_at), "completed_at": at(batch.completed_at),
        "failed_at": at(batch.failed_at), "expired_at": at(batch.expired_at),
        "cancelling_at": at(batch.cancelling_at), "cancelled_at": at(batch.cancelled_at),
        "request_counts": {"total": batch.total, "completed": completed, "failed": failed},
        "metadata": batch.metadata, "model": batch.model or None,
    }
