"""Jobs: POST /v1/jobs, GET /v1/jobs/{id}, GET /v1/jobs/{id}/result, DELETE /v1/jobs/{id}.

A job is a native request run in the background (`{"operation", "model", "items",
"options"}`, answered inline in the job's view), or a bulk run over a JSONL file
(streamed into the blob store as the body of a POST with Content-Type
application/x-ndjson, or named by `"input"`: a key already in the store), cut into
parts and gathered into one result file. Either is checked exactly as the sync
route checks a request, and refused with a 4xx before anything is queued.
`Prefer: respond-async` on a native route makes its request a job (`accept_native`).

With API keys on, a job belongs to the key that created it (`Job.owner`, the key's name):
every job route answers another key 404 JOB_NOT_FOUND, as for no job (existence is not
disclosed), and 403 for a job whose model the key may no longer use; a key marked
`admin` sees and cancels all. A bulk job's `"input"` may name only a blob-store key the
keys file grants the key (`inputs`) or the input upload of one of the key's own jobs;
anything else is "no such file", as for a missing one.

A key (all callers together when keys are off) has at most SHOAL_JOBS_PER_KEY jobs queued
or running and SHOAL_JOB_TEXTS_PER_KEY items in them not yet done: past either, 429
TOO_MANY_JOBS with Retry-After (`gateway.jobs.key_jobs`), checked before an upload is read
and again, atomically, when the job is made.

State lives in Redis (`gateway.jobs.store`); parts are driven by
`gateway.jobs.driver`; their results come back through `gateway.jobs.part_replies`.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import msgpack
import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from gateway.auth.access import caller_key, check_model_allowed
from gateway.calls.model_call import ROUTE_OF_OPERATION, served_model
from gateway.calls.native_api import body_limit, checked_kwargs, read_native
from gateway.edge.api_errors import ApiError, invalid
from gateway.edge.codecs import check_body_size, encode_response, media_type, read_body
from gateway.edge.raw_headers import header
from gateway.jobs.bulk_files import (
    BULK_OPERATIONS,
    NPY,
    InputCheck,
    part_items,
    read_chunks,
    stream_file,
)
from gateway.jobs.key_jobs import Limits
from gateway.jobs.store import CANCELLED, Job, JobStore, view
from tasks.catalog import ModelEntry
from tasks.errors import ErrorCode
from tasks.render import names, shown

JSONL_TYPES = frozenset({"application/x-ndjson", "application/jsonl", "application/x-jsonl",
                         "application/ndjson"})
_REQUEST_FIELDS = {"operation", "model", "items", "options", "query"}
_INPUT_FIELDS = {"operation", "model", "input", "options", "query"}


def _blobs(request: Request) -> Any:
    from tasks.blobs import blob_store  # fsspec takes ~0.15 s to import: not at start

    return blob_store(request.app.state.settings.blob_url)


def _store(request: Request) -> JobStore:
    return request.app.state.job_store


async def create_job(request: Request) -> Response:
    if media_type(request.headers.get("content-type")) in JSONL_TYPES:
        return await _upload(request)
    settings = request.app.state.settings
    # The widest limit here; `_accept` applies the model's own once it knows the model.
    body = await read_body(request, max(settings.max_body_bytes, settings.max_claim_body_bytes))
    if not isinstance(body, dict):
        raise invalid("the body must be an object: {\"operation\", \"model\", \"items\", "
                      "\"options\"}, or {\"operation\", \"model\", \"input\"} for a file in "
                      "the blob store, or send the file itself as application/x-ndjson")
    if "input" in body:
        return await _from_input(request, body)
    op = body.get("operation")
    _check_operation(op)
    fields = _REQUEST_FIELDS - ({"query"} if op != "score" else set())
    unknown = set(body) - fields
    if unknown:
        raise invalid(f"unknown fields {names(unknown)}; allowed: {sorted(fields)}")
    request_body = {k: v for k, v in body.items() if k not in ("operation", "model")}
    return await _accept(request, op, body.get("model"), request_body)


async def accept_native(request: Request, op: str) -> Response:
    """A native route's request with `Prefer: respond-async`: the same checks, then a job."""
    entry, body = await read_native(request, op)
    return await _accept_checked(request, op, entry, body)


def prefers_async(request: Request) -> bool:
    prefer = header(request, b"prefer")
    return prefer is not None and "respond-async" in prefer.lower()


def _check_operation(op: Any) -> None:
    if not isinstance(op, str) or op not in ROUTE_OF_OPERATION:  # a list is unhashable
        raise invalid(f"'operation' must be one of {sorted(ROUTE_OF_OPERATION)}, "
                      f"got {shown(op)}")


async def _accept(request: Request, op: str, model: Any, body: dict[str, Any]) -> Response:
    """An inline job from POST /v1/jobs: its model, and the body limit the model's sync
    route has (the body was read under the widest)."""
    entry = served_model(request, model, op)
    check_body_size(request, body_limit(request, entry))
    return await _accept_checked(request, op, entry, body)


async def _accept_checked(request: Request, op: str, entry: ModelEntry,
                          body: dict[str, Any]) -> Response:
    """An inline job: checked as the sync route checks it, its request kept in the blob
    store (a gateway that takes the job over publishes it from there)."""
    parsed, kwargs = checked_kwargs(request, entry, body)
    await request.app.state.broker.admit(entry.id)
    job = _new_job(request, entry, op, parsed.options, kwargs.get("query"))
    job.input = f"{job.folder}/request.msgpack"
    job.parts_total, job.items_total = 1, len(parsed.items)
    await asyncio.to_thread(_blobs(request).put, job.input,
                            msgpack.packb(kwargs, use_bin_type=True))
    return await _start(request, job)


def _new_job(request: Request, entry: ModelEntry, op: str, options: Any,
             query: Any) -> Job:
    from tasks.blobs import JOBS, BlobStore

    job_id = uuid.uuid4().hex
    raw_options = options if isinstance(options, dict) else None
    key = caller_key(request)
    return Job(id=job_id, operation=op, model=entry.id, options=raw_options or {},
               query=query if isinstance(query, str) else None,
               folder=BlobStore.new_key(JOBS, job_id), owner=key.name if key else None)


CANCEL_HINT = "cancel one of its jobs (DELETE /v1/jobs/{id})"


def _limits(request: Request) -> Limits:
    return Limits.of(request.app.state.settings, caller_key(request))


async def _start(request: Request, job: Job) -> Response:
    try:
        # Created unless the key is at its limits (429 TOO_MANY_JOBS, gateway.jobs.key_jobs)
        await request.app.state.job_driver.keys.create(job, _limits(request), CANCEL_HINT)
    except BaseException:
        # Refused (the job store is away: 503; the key at its limits: 429): nothing of it
        # stays in the blob store.
        if job.owns_input:
            await asyncio.to_thread(_blobs(request).delete, [job.folder], True)
        raise
    await request.app.state.job_driver.kick(job.id)
    return encode_response(request, view(job), 202, {"Location": f"/v1/jobs/{job.id}"})


# --- bulk ------------------------------------------------------------------------------------

def _bulk_entry(request: Request, op: Any, model: Any, options: Any,
                query: Any) -> tuple[ModelEntry, InputCheck]:
    """The model's entry and a check for its input lines; 4xx for a bad operation,
    model or options before any byte of the input is read."""
    _check_operation(op)
    if op not in BULK_OPERATIONS:
        raise invalid(f"a bulk job runs {sorted(BULK_OPERATIONS)}; {op} needs its items "
                      "together: send them as an inline job ({\"items\": [...]})")
    entry = served_model(request, model, op)
    if options is not None and not isinstance(options, dict):
        raise invalid("'options' must be an object")
    if op == "score" and not isinstance(query, str):
        raise invalid("a bulk score needs 'query' (a string)")
    settings = request.app.state.settings

    def check(items: list[Any]) -> None:
        kwargs: dict[str, Any] = {"model": entry.id, "items": items, "options": options}
        if query is not None:
            kwargs["query"] = query
        entry.parse(kwargs)

    check([{"text": "x"}]) if "text" in entry.contract.inputs else None  # options first
    profile = entry.profile(settings.device)
    per_part = part_items(settings.job_part_items,
                          profile.max_items if profile else settings.batch_max_items)
    return entry, InputCheck(check, settings.max_text_chars, per_part)


async def _upload(request: Request) -> Response:
    """The body is the input file: streamed into the blob store and checked line by line
    as it comes, never held whole."""
    params = request.query_params
    try:
        options = orjson.loads(params["options"]) if "options" in params else None
    except orjson.JSONDecodeError as exc:
        raise invalid(f"the 'options' query parameter is not JSON: {exc}") from None
    entry, check = _bulk_entry(request, params.get("operation"), params.get("model"), options,
                               params.get("query"))
    await request.app.state.broker.admit(entry.id)
    await request.app.state.job_driver.keys.check(_limits(request), CANCEL_HINT)  # before
    # the upload is read; counted again, with its items, when the job is made
    limit = request.app.state.settings.max_job_input_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    job = _new_job(request, entry, str(params.get("operation")), options, params.get("query"))
    job.input = f"{job.folder}/input.jsonl"
    blobs = _blobs(request)
    writer = blobs.open_write(job.input)
    file = await asyncio.to_thread(writer.__enter__)

    def take(chunk: bytes) -> None:  # one thread hop per chunk: check it and write it
        check.feed(chunk)
        file.write(chunk)

    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            if chunk:
                await asyncio.to_thread(take, chunk)
        await asyncio.to_thread(check.close)
    except BaseException as exc:
        await asyncio.to_thread(writer.__exit__, type(exc), exc, exc.__traceback__)
        await asyncio.to_thread(blobs.delete, [job.folder], True)  # nothing of it stays
        raise
    await asyncio.to_thread(writer.__exit__, None, None, None)
    return await _start(request, _bulk(job, check))


async def _from_input(request: Request, body: dict[str, Any]) -> Response:
    """A bulk job over a file already in the blob store: read and checked before it is
    accepted (the caller's file: it stays when the job ends)."""
    unknown = set(body) - _INPUT_FIELDS
    if unknown:
        raise invalid(f"unknown fields {names(unknown)}; allowed: {sorted(_INPUT_FIELDS)}")
    key = body.get("input")
    if not isinstance(key, str) or not key or ".." in key.split("/"):
        raise invalid("'input' must be a key in the blob store")
    entry, check = _bulk_entry(request, body.get("operation"), body.get("model"),
                               body.get("options"), body.get("query"))
    from tasks.blobs import BlobMissing

    missing = ApiError(ErrorCode.NOT_FOUND, f"no file {key!r} in the blob store")
    caller = caller_key(request)
    if caller is not None and not (caller.may_read_input(key)
                                   or await _input_of_own_job(request, caller.name, key)):
        raise missing  # another tenant's file is no file to this key
    await request.app.state.broker.admit(entry.id)
    await request.app.state.job_driver.keys.check(_limits(request), CANCEL_HINT)
    blobs = _blobs(request)

    limit = request.app.state.settings.max_job_input_bytes

    def read_all() -> None:
        if blobs.size(key) > limit:
            raise _too_large(limit)
        with blobs.open_read(key) as file:
            for chunk in read_chunks(file):
                check.feed(chunk)
        check.close()

    try:
        await asyncio.to_thread(read_all)
    except BlobMissing:
        raise missing from None
    job = _new_job(request, entry, body["operation"], body.get("options"), body.get("query"))
    job.input, job.owns_input = key, False
    return await _start(request, _bulk(job, check))


async def _input_of_own_job(request: Request, owner: str, blob_key: str) -> bool:
    """Whether `blob_key` is the uploaded input of a job that `owner`'s key created."""
    from tasks.blobs import JOBS

    kind, _, rest = blob_key.partition("/")
    folder, _, name = rest.partition("/")
    if kind != JOBS or "-" not in folder or "/" in name:
        return False
    job = await _store(request).get(folder.partition("-")[2])
    return job is not None and job.owner == owner and job.input == blob_key


def _bulk(job: Job, check: InputCheck) -> Job:
    job.bulk = True
    job.part_items = check.per_part
    job.parts_total, job.items_total = check.parts, check.items
    return job


def _too_large(limit: int) -> ApiError:
    return ApiError(ErrorCode.PAYLOAD_TOO_LARGE,
                    f"the input is over SHOAL_MAX_JOB_INPUT_BYTES ({limit} bytes)")


# --- reading and cancelling ----------------------------------------------------------------

async def _job(request: Request) -> Job:
    job_id = request.path_params["job_id"]
    job = await _store(request).get(job_id)
    key = caller_key(request)
    if job is None or (key is not None and not key.owns(job.owner)):
        raise ApiError(ErrorCode.JOB_NOT_FOUND, f"no job {job_id!r} (unknown, or finished "
                       "more than SHOAL_JOB_TTL_S ago)")
    if key is not None and not key.admin:
        check_model_allowed(request, job.model)
    return job


async def get_job(request: Request) -> Response:
    return encode_response(request, view(await _job(request)))


async def get_result(request: Request) -> Response:
    job = await _job(request)
    if job.state != "succeeded":
        raise ApiError(ErrorCode.JOB_NOT_FINISHED, f"job {job.id} is {job.state}; its result "
                       "is there once it has succeeded")
    if not job.bulk:
        return encode_response(request, job.result)
    blobs = _blobs(request)
    size = await asyncio.to_thread(blobs.size, job.result_file)
    file = await asyncio.to_thread(blobs.open_read, job.result_file)

    kind = "application/x-npy" if job.result_type == NPY else "application/x-ndjson"
    name = f"{job.id}.{job.result_type}"
    return StreamingResponse(stream_file(file), media_type=kind, headers={
        "Content-Length": str(size), "Content-Disposition": f'attachment; filename="{name}"'})


async def cancel_job(request: Request) -> Response:
    """Cancel: parts not yet published never are, published ones are revoked (a worker
    answers them CANCELLED unrun), running ones finish and are dropped; the job's folder
    in the blob store is deleted at once. A job that has already finished is left as it
    is (200 with its view)."""
    job = await _job(request)
    store = _store(request)
    if job.active and await store.finish(job.id, CANCELLED):
        # The driver revokes too when it notices, and deletes the job's folder; this
        # covers a job whose driver is gone.
        driver = request.app.state.job_driver
        await driver.revoke(job.id, job.published)
        await driver.drop_files(job)
        job = await _job(request)
    return encode_response(request, view(job))
