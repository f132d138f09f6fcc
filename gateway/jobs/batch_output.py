"""The end of an OpenAI batch: every line answered once, in its output or its error file.

A batch's job records each line's answer in Redis as it comes (`gateway.jobs.part_replies`:
`[1, result]` for a result, `[0, failure]` for a line the model refused). At the end the
lines are read again in order from the batch's lines file (`gateway.jobs.batch_lines`),
their answers fetched in chunks, and each is written as OpenAI's output line (the sync
route's response body, made by the route's own function: `RENDERERS`, which
`gateway.routes.batch_endpoints` fills, as the jobs layer may not import routes) or error
line; the lines refused at acceptance (`errors.jsonl` in the job's folder) go first into
the error file. A batch that ends complete does this in its job's driver
(`finish_batch`); a cancelled one in the cancel (`finish_cancelled`), where the lines
that never ran are answered `batch_cancelled`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from gateway.edge.error_shapes import openai_body, openai_status
from gateway.jobs.batch_lines import (
    BATCH_CANCELLED,
    RecordReader,
    answered,
    never_ran,
    new_request_id,
)
from gateway.jobs.batch_store import CANCELLED_, COMPLETED, Batch, BatchStore
from gateway.jobs.openai_files import BATCH_OUTPUT, FileRecord, FileStore, blob_key, new_file_id
from gateway.jobs.store import SUCCEEDED, Job, JobStore
from tasks.errors import ShoalError

log = logging.getLogger(__name__)

# Endpoint -> (line body, result, request id, model id) -> the sync route's response body.
Renderer = Callable[[dict[str, Any], dict[str, Any], str, str], Any]
RENDERERS: dict[str, Renderer] = {}
CHUNK = 512  # lines whose answers are fetched from Redis at once


def lines_key(folder: str) -> str:
    return f"{folder}/lines.bin"


def refused_key(folder: str) -> str:
    return f"{folder}/errors.jsonl"


def error_line(endpoint: str, custom_id: str | None, error: ShoalError,
               request_id: str) -> bytes:
    """A request refused (by the route's checks or the model) as its sync route refuses
    it: OpenAI's status and error envelope."""
    status = openai_status(error)
    return answered(custom_id, status, openai_body(endpoint, error, status), request_id)


class _File:
    """An output or error file being written (in threads); dropped if it stays empty."""

    def __init__(self, blobs: Any) -> None:
        self.blobs = blobs
        self.id = new_file_id()
        self.writer = blobs.open_write(blob_key(self.id))
        self.file = self.writer.__enter__()
        self.lines = 0
        self.bytes = 0

    def write(self, line: bytes) -> None:
        self.file.write(line)
        self.lines += 1
        self.bytes += len(line)

    def close(self) -> str | None:
        self.writer.__exit__(None, None, None)
        if self.lines:
            return self.id
        self.blobs.delete([blob_key(self.id)])
        return None

    def abort(self, exc: BaseException) -> None:
        self.writer.__exit__(type(exc), exc, exc.__traceback__)


@dataclass(slots=True)
class Written:
    output: _File
    errors: _File
    completed: int = 0
    failed: int = 0


def _render(batch: Batch, reader: RecordReader, answers: list[bytes | None],
            out: Written, not_run: tuple[str, str] | None) -> None:
    """Write the answers of the next len(answers) records (in a thread)."""
    render = RENDERERS[batch.endpoint]
    for answer in answers:
        record = reader.next()
        assert record is not None
        request_id = new_request_id()
        if answer is None:
            code, message = not_run or ("not_answered", "no answer was recorded for this line")
            out.errors.write(never_ran(record.custom_id, code, message))
            out.failed += 1
            continue
        ok, value = msgpack.unpackb(answer, raw=False)
        if ok:
            body = render(record.body, value, request_id, batch.model)
            out.output.write(answered(record.custom_id, 200, body, request_id))
            out.completed += 1
        else:
            error = ShoalError.from_celery_failure(value)
            out.errors.write(error_line(batch.endpoint, record.custom_id, error, request_id))
            out.failed += 1


async def write_outputs(jobs: JobStore, blobs: Any, batch: Batch, job: Job | None,
                        not_run: tuple[str, str] | None = None) -> Written:
    """Write the batch's output and error files (see the module doc)."""
    output = await asyncio.to_thread(_File, blobs)
    errors = await asyncio.to_thread(_File, blobs)
    out = Written(output, errors)
    folder = job.folder if job is not None else ""
    try:
        if folder:
            await asyncio.to_thread(_copy_refused, blobs, refused_key(folder), out)
        if job is not None and job.parts_total:
            reader = await asyncio.to_thread(
                lambda: RecordReader(blobs.open_read(lines_key(folder))))
            try:
                for first in range(0, job.parts_total, CHUNK):
                    indices = list(range(first, min(first + CHUNK, job.parts_total)))
                    answers = await jobs.redis.hmget(jobs.parts_key(job.id), indices)
                    await asyncio.to_thread(_render, batch, reader, answers, out, not_run)
            finally:
                await asyncio.to_thread(reader.close)
    except BaseException as exc:
        await asyncio.to_thread(output.abort, exc)
        await asyncio.to_thread(errors.abort, exc)
        raise
    return out


def _copy_refused(blobs: Any, key: str, out: Written) -> None:
    if not blobs.exists(key):
        return
    with blobs.open_read(key) as file:
        for line in file:
            out.errors.write(line)
            out.failed += 1


async def _close(files: FileStore, blobs: Any, batch: Batch, out: Written
                 ) -> tuple[str | None, str | None]:
    """Close both files and record them as the batch owner's files; their ids."""
    ids = []
    for written, kind in ((out.output, "output"), (out.errors, "error")):
        file_id = await asyncio.to_thread(written.close)
        if file_id is not None:
            await files.create(FileRecord(file_id, written.bytes, f"{batch.id}_{kind}.jsonl",
                                          BATCH_OUTPUT, batch.owner))
        ids.append(file_id)
    return ids[0], ids[1]


async def _drop(files: FileStore, blobs: Any, ids: tuple[str | None, str | None]) -> None:
    for file_id in ids:
        if file_id is not None:
            record = await files.get(file_id)
            if record is not None:
                await files.delete(record)
            await asyncio.to_thread(blobs.delete, [blob_key(file_id)])


async def finish_batch(jobs: JobStore, blobs: Any, job: Job) -> None:
    """Every line of a batch whose lines have all been answered: its files written, its
    job and record finished (the driver's end of a batch's job)."""
    batches, files = BatchStore(jobs), FileStore(jobs)
    batch = await batches.get(job.batch)
    if batch is None:  # its record is gone: nothing to write for
        log.warning("batch %s of job %s is gone; its output is dropped", job.batch, job.id)
        await jobs.finish(job.id, SUCCEEDED)
        return
    await batches.update(batch.id, finalizing_at=time.time())
    out = await write_outputs(jobs, blobs, batch, job)
    ids = await _close(files, blobs, batch, out)
    if not await jobs.finish(job.id, SUCCEEDED, result_file=f"{ids[0] or ''} {ids[1] or ''}",
                             result_type="batch"):
        await _drop(files, blobs, ids)  # cancelled meanwhile: the cancel writes its own
        return
    await batches.update(batch.id, status=COMPLETED, completed_at=time.time(),
                         output_file_id=ids[0], error_file_id=ids[1],
                         completed=out.completed, failed=out.failed)
    await asyncio.to_thread(blobs.delete, [job.folder], True)


async def finish_cancelled(jobs: JobStore, blobs: Any, batch: Batch, job: Job | None) -> None:
    """A cancelled batch (its job already cancelled): the lines answered so far in its
    output and error files, every other line in its error file as `batch_cancelled`."""
    out = await write_outputs(jobs, blobs, batch, job, not_run=(
        BATCH_CANCELLED, "the batch was cancelled before this line ran"))
    ids = await _close(FileStore(jobs), blobs, batch, out)
    await BatchStore(jobs).update(batch.id, status=CANCELLED_, cancelled_at=time.time(),
                                  output_file_id=ids[0], error_file_id=ids[1],
                                  completed=out.completed, failed=out.failed)
    if job is not None:
        await asyncio.to_thread(blobs.delete, [job.folder], True)


async def finish_unrun(jobs: JobStore, blobs: Any, batch: Batch, folder: str) -> None:
    """A batch none of whose lines could run: its error file is its refused lines, and it
    is completed at once (as OpenAI completes a batch whose every line failed)."""
    unrun = Job(id="", operation="", model="", folder=folder)
    out = await write_outputs(jobs, blobs, batch, unrun)
    ids = await _close(FileStore(jobs), blobs, batch, out)
    await BatchStore(jobs).update(batch.id, status=COMPLETED, completed_at=time.time(),
                                  output_file_id=ids[0], error_file_id=ids[1],
                                  completed=out.completed, failed=out.failed)
    await asyncio.to_thread(blobs.delete, [folder], True)
