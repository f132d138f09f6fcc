"""OpenAI's Batch API: POST /v1/batches, GET /v1/batches, GET /v1/batches/{id},
POST /v1/batches/{id}/cancel.

A batch runs the lines of an uploaded file (`gateway.routes.openai_files`) on one of
the endpoints in `gateway.routes.batch_endpoints.ENDPOINTS`, as a job of the jobs system:
the input is checked line by line when the batch is created (each body exactly as its
sync route checks it; a bad line is answered in the error file, not a failed batch),
then each line that can run is one part of the job, published marked bulk (workers run
callers who wait first) with the jobs' backpressure, lease and takeover, and answered
through the jobs' reply queue. When every line is answered the job's driver writes the
output and error files in OpenAI's format (`gateway.jobs.batch_output`). The batch object
(`gateway.jobs.batch_store`) takes its status and counts from the job while it runs.

A batch is its creator's API key's, as its files are: another key gets 404.
`completion_window` is "24h" (OpenAI's only value); shoal does not expire a batch that
runs longer. Cancelling answers the lines not yet run `batch_cancelled` in the error file
and keeps the answers already in (OpenAI's partial results).

A batch is a job of its key, and counts towards the key's job limits (its runnable lines
as items; `gateway.jobs.key_jobs`): past them, 429 in OpenAI's error envelope, `type`
"requests" (jobs at once) or "tokens" (queued items), with Retry-After. (OpenAI itself
accepts a batch past its enqueued-token limit and fails it with `token_limit_exceeded`;
an answer at once, which SDKs retry after Retry-After, keeps the caller's file unread.)
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.auth.access import caller_key
from gateway.broker.broker_errors import unavailable
from gateway.edge.api_errors import ApiError, invalid
from gateway.edge.codecs import encode_response, read_body
from gateway.jobs.batch_output import finish_cancelled, finish_unrun, lines_key
from gateway.jobs.batch_store import (
    FAILED_,
    IN_PROGRESS,
    WINDOW_S,
    Batch,
    BatchStore,
    batch_object,
    final_fields,
    new_batch_id,
)
from gateway.jobs.key_jobs import Limits
from gateway.jobs.openai_files import BATCH
from gateway.jobs.store import CANCELLED, Job, JobStore
from gateway.routes.batch_endpoints import ENDPOINTS, prepare
from gateway.routes.openai_files import blobs_of, own_file, owner_of, visible
from tasks.errors import ErrorCode
from tasks.render import names, shown

_FIELDS = frozenset({"input_file_id", "endpoint", "completion_window", "metadata"})
MAX_METADATA = 16  # OpenAI's limits: 16 pairs, keys of 64 characters, values of 512
MAX_KEY, MAX_VALUE = 64, 512
STUCK_S = 60.0  # a cancel whose files are not written after this is finished by a reader
CANCEL_HINT = "cancel one of its batches (POST /v1/batches/{id}/cancel)"


def _jobs(request: Request) -> JobStore:
    return request.app.state.job_store


def _check(body: Any) -> tuple[str, str, dict[str, str] | None]:
    """(input_file_id, endpoint, metadata) of a create body; 400 naming what is wrong."""
    if not isinstance(body, dict):
        raise invalid("the body must be an object: {\"input_file_id\", \"endpoint\", "
                      "\"completion_window\": \"24h\", \"metadata\"}")
    unknown = set(body) - _FIELDS
    if unknown:
        raise invalid(f"unknown fields {names(unknown)}; allowed: {sorted(_FIELDS)}")
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str) or not file_id:
        raise invalid("'input_file_id' must be the id of a file uploaded with "
                      "purpose=batch (POST /v1/files)")
    endpoint = body.get("endpoint")
    if not isinstance(endpoint, str) or endpoint not in ENDPOINTS:
        raise invalid(f"'endpoint' must be one of {list(ENDPOINTS)}, got {shown(endpoint)}")
    window = body.get("completion_window")
    if not isinstance(window, str) or window not in WINDOW_S:
        raise invalid(f"'completion_window' must be \"24h\", got {shown(window)}")
    metadata = body.get("metadata")
    if metadata is not None and not (
            isinstance(metadata, dict) and len(metadata) <= MAX_METADATA
            and all(isinstance(k, str) and len(k) <= MAX_KEY and isinstance(v, str)
                    and len(v) <= MAX_VALUE for k, v in metadata.items())):
        raise invalid(f"'metadata' must be an object of at most {MAX_METADATA} string "
                      f"values, keys of at most {MAX_KEY} characters and values of at most "
                      f"{MAX_VALUE}")
    return file_id, endpoint, metadata


async def create_batch(request: Request) -> Response:
    body = await read_body(request, request.app.state.settings.max_body_bytes)
    file_id, endpoint, metadata = _check(body)
    broker = request.app.state.broker
    if not broker.ready:
        raise unavailable("the message broker is not connected")
    source = await own_file(request, file_id)
    if source.purpose != BATCH:
        raise invalid(f"file {file_id} has purpose {source.purpose!r}: a batch's input is "
                      "a file uploaded with purpose=batch", param="input_file_id")
    limits = Limits.of(request.app.state.settings, caller_key(request))
    await request.app.state.job_driver.keys.check(limits, CANCEL_HINT)  # before the file is read
    from tasks.blobs import JOBS, BlobStore

    job_id = uuid.uuid4().hex
    folder = BlobStore.new_key(JOBS, job_id)
    blobs = blobs_of(request)
    batch = Batch(new_batch_id(), endpoint, file_id, body["completion_window"], metadata,
                  owner_of(request), in_progress_at=time.time())
    try:
        found = await asyncio.to_thread(prepare, request, endpoint, blobs, source.key, folder)
        batch.total, batch.refused = found.total, found.refused
        if found.fatal is not None:  # the file as a whole cannot be a batch
            await asyncio.to_thread(blobs.delete, [folder], True)
            batch.status, batch.failed_at, batch.errors = FAILED_, time.time(), [found.fatal]
            batch.in_progress_at = None
            await BatchStore(_jobs(request)).create(batch)
            return encode_response(request, batch_object(batch, None))
        if found.model is None:  # no line can run: answered at once
            await BatchStore(_jobs(request)).create(batch)
            await finish_unrun(_jobs(request), blobs, batch, folder)
            return await _answer(request, batch.id)
        await broker.admit(found.model.id)  # 503 for a model no worker serves
    except BaseException:
        await asyncio.to_thread(blobs.delete, [folder], True)
        raise
    key = caller_key(request)
    job = Job(id=job_id, operation=found.model.operation, model=found.model.id, bulk=True,
              batch=batch.id, folder=folder, input=lines_key(folder), part_items=1,
              parts_total=found.runnable, items_total=found.runnable,
              owner=key.name if key else None)
    batch.model, batch.job_id = found.model.id, job_id
    await BatchStore(_jobs(request)).create(batch)  # first: the driver finds it at the end
    try:  # unless the key is past its limits now (429), counting this batch's lines
        await request.app.state.job_driver.keys.create(job, limits, CANCEL_HINT)
    except BaseException:
        await _forget(request, batch)
        await asyncio.to_thread(blobs.delete, [folder], True)
        raise
    await request.app.state.job_driver.kick(job.id)
    return encode_response(request, batch_object(batch, job))


async def _forget(request: Request, batch: Batch) -> None:
    """Remove the record of a batch refused after it was written (its key at its limits)."""
    store = BatchStore(_jobs(request))
    async with _jobs(request).redis.pipeline(transaction=True) as pipe:
        pipe.delete(store.key(batch.id))
        pipe.zrem(store.index(batch.owner), batch.id)
        await pipe.execute()


async def _own_batch(request: Request) -> Batch:
    batch_id = request.path_params["batch_id"]
    batch = await BatchStore(_jobs(request)).get(batch_id)
    if batch is None or not visible(request, batch.owner):
        raise ApiError(ErrorCode.NOT_FOUND, f"no batch {shown(batch_id)} (unknown, finished "
                       "more than SHOAL_JOB_TTL_S ago, or not this API key's)")
    return batch


async def _current(request: Request, batch: Batch) -> tuple[Batch, Job | None]:
    """The batch and its job, with what the record lacks of a job that ended written
    into it (see `final_fields`); a batch whose job was cancelled and whose cancel did not
    finish (its gateway died, or the job was cancelled through DELETE /v1/jobs/{id}) is
    finished here."""
    job = await _jobs(request).get(batch.job_id) if batch.job_id else None
    update = final_fields(batch, job)
    store = BatchStore(_jobs(request))
    if update:
        await store.update(batch.id, **update)
        batch = await store.get(batch.id) or batch
    elif job is not None and job.state == CANCELLED and not batch.final and (
            batch.cancelling_at is None or time.time() - batch.cancelling_at > STUCK_S):
        await _finish_cancel(request, batch, job)
        batch = await store.get(batch.id) or batch
    return batch, job


async def _finish_cancel(request: Request, batch: Batch, job: Job | None) -> None:
    """Write a cancelled batch's files, once: whoever holds its lock (for STUCK_S)."""
    jobs = _jobs(request)
    if await jobs.redis.set(f"{BatchStore(jobs).key(batch.id)}:finishing", 1, nx=True,
                            ex=int(STUCK_S)):
        await finish_cancelled(jobs, blobs_of(request), batch, job)


async def _answer(request: Request, batch_id: str) -> Response:
    batch = await BatchStore(_jobs(request)).get(batch_id)
    assert batch is not None
    batch, job = await _current(request, batch)
    return encode_response(request, batch_object(batch, job))


async def retrieve_batch(request: Request) -> Response:
    batch, job = await _current(request, await _own_batch(request))
    return encode_response(request, batch_object(batch, job))


async def list_batches(request: Request) -> Response:
    params = request.query_params
    raw = params.get("limit", "20")
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= 100:
        raise invalid(f"'limit' must be a whole number from 1 to 100, got {shown(raw)}")
    batches, more = await BatchStore(_jobs(request)).page(owner_of(request), int(raw),
                                                          params.get("after"))
    data = [batch_object(*await _current(request, b)) for b in batches]
    return encode_response(request, {"object": "list", "data": data, "has_more": more,
                                     "first_id": data[0]["id"] if data else None,
                                     "last_id": data[-1]["id"] if data else None})


async def cancel_batch(request: Request) -> Response:
    """Cancel: lines not yet published never are, published ones are revoked; the answers
    already in are kept in the output and error files, the rest answered
    `batch_cancelled`. A batch that has already ended is answered as it is."""
    batch, job = await _current(request, await _own_batch(request))
    store = _jobs(request)
    if batch.status == IN_PROGRESS and job is not None and job.active and \
            await store.finish(job.id, CANCELLED):
        await BatchStore(store).update(batch.id, cancelling_at=time.time())
        job = await store.get(job.id)
        if job is not None:
            await request.app.state.job_driver.revoke(job.id, job.published)
        await _finish_cancel(request, batch, job)
    return await _answer(request, batch.id)
