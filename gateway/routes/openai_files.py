"""OpenAI's files API: POST /v1/files, GET /v1/files, GET/DELETE /v1/files/{id},
GET /v1/files/{id}/content.

What the openai SDK's `client.files.create(file=..., purpose="batch")` and the Batch API
need: an upload (multipart/form-data, streamed into the blob store as it comes,
`gateway.edge.multipart_form`), and the batch's output and error files read back. Only
`purpose` "batch" is taken: shoal stores files for its Batch API and nothing else. A file
is its uploader's API key's, as a job is: another key's file answers 404, as no file does
(`gateway.jobs.openai_files`). Errors come in OpenAI's envelope.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from gateway.auth.access import caller_key
from gateway.edge.api_errors import ApiError, invalid
from gateway.edge.codecs import encode_response
from gateway.edge.multipart_form import End, FormReader, Part, boundary_of
from gateway.jobs.bulk_files import stream_file
from gateway.jobs.openai_files import (
    BATCH,
    NO_OWNER,
    FileRecord,
    FileStore,
    blob_key,
    file_object,
    new_file_id,
)
from tasks.errors import ErrorCode
from tasks.render import shown

MAX_FIELD_BYTES = 1024  # a form field that is not the file (`purpose`)
MAX_FILENAME = 255


def blobs_of(request: Request) -> Any:
    from tasks.blobs import blob_store  # fsspec takes ~0.15 s to import: not at start

    return blob_store(request.app.state.settings.blob_url)


def files_of(request: Request) -> FileStore:
    return FileStore(request.app.state.job_store)


def owner_of(request: Request) -> str:
    """Whose a new file or batch is: the caller's key's name (NO_OWNER with keys off)."""
    key = caller_key(request)
    return key.name if key is not None else NO_OWNER


def visible(request: Request, owner: str) -> bool:
    """Whether the caller may see what `owner` made (keys off: everyone; an admin key:
    everything)."""
    key = caller_key(request)
    return key is None or key.owns(None if owner == NO_OWNER else owner)


async def own_file(request: Request, file_id: Any) -> FileRecord:
    """The caller's file `file_id`; 404 for no file, or another key's."""
    record = await files_of(request).get(file_id) if isinstance(file_id, str) else None
    if record is None or not visible(request, record.owner):
        raise ApiError(ErrorCode.NOT_FOUND, f"no file {shown(file_id)} (unknown, deleted, "
                       "or not this API key's)")
    return record


async def create_file(request: Request) -> Response:
    """The upload, streamed into the blob store; `purpose` checked as soon as it comes."""
    form = FormReader(boundary_of(request.headers.get("content-type")))
    limit = request.app.state.settings.max_job_input_bytes
    blobs = blobs_of(request)
    record = FileRecord(new_file_id(), 0, "", "", owner_of(request))
    fields: dict[str, bytes] = {}
    current: Part | None = None
    writer: Any = None
    file: Any = None
    try:
        async for chunk in request.stream():
            events = form.feed(chunk)
            for event in events:
                if isinstance(event, Part):
                    current = event
                    if event.name == "file":
                        if writer is not None:
                            raise invalid("the form has two 'file' fields: upload one file")
                        _check_purpose(fields)  # a purpose sent first is refused first
                        record.filename = (event.filename or "upload.jsonl")[:MAX_FILENAME]
                        writer = blobs.open_write(blob_key(record.id))
                        file = await asyncio.to_thread(writer.__enter__)
                    else:
                        fields[event.name] = b""
                elif isinstance(event, End):
                    current = None
                elif current is not None and current.name == "file":
                    record.bytes += len(event)
                    if record.bytes > limit:
                        raise ApiError(ErrorCode.PAYLOAD_TOO_LARGE, f"the file is over "
                                       f"SHOAL_MAX_JOB_INPUT_BYTES ({limit} bytes)")
                    await asyncio.to_thread(file.write, event)
                elif current is not None:
                    fields[current.name] += event
                    if len(fields[current.name]) > MAX_FIELD_BYTES:
                        raise invalid(f"the form field {current.name!r} is over "
                                      f"{MAX_FIELD_BYTES} bytes")
        form.close()
        if writer is None:
            raise invalid("the form has no 'file' field: send the file as 'file' "
                          "(client.files.create(file=open(path, 'rb'), purpose='batch'))")
        record.purpose = _check_purpose(fields, required=True)
    except BaseException as exc:
        if writer is not None:
            await asyncio.to_thread(writer.__exit__, type(exc), exc, exc.__traceback__)
        raise
    await asyncio.to_thread(writer.__exit__, None, None, None)
    try:
        await files_of(request).create(record)
    except BaseException:
        await asyncio.to_thread(blobs.delete, [record.key])
        raise
    return encode_response(request, file_object(record))


def _check_purpose(fields: dict[str, bytes], required: bool = False) -> str:
    raw = fields.get("purpose")
    if raw is None:
        if required:
            raise invalid("the form has no 'purpose' field: send purpose=batch")
        return ""
    purpose = raw.decode("utf-8", "replace")
    if purpose != BATCH:
        raise ApiError(ErrorCode.VALIDATION_ERROR, f"'purpose' must be \"batch\", got "
                       f"{shown(purpose)}: this gateway keeps files for the Batch API only",
                       param="purpose")
    return purpose


async def list_files(request: Request) -> Response:
    params = request.query_params
    limit = _int_param(params.get("limit"), "limit", 10_000, 1, 10_000)
    order = params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid(f"'order' must be \"asc\" or \"desc\", got {shown(order)}")
    records, more = await files_of(request).page(
        owner_of(request), limit, params.get("after"), order == "desc", params.get("purpose"))
    data = [file_object(r) for r in records]
    return encode_response(request, {"object": "list", "data": data, "has_more": more,
                                     "first_id": data[0]["id"] if data else None,
                                     "last_id": data[-1]["id"] if data else None})


def _int_param(raw: str | None, name: str, default: int, low: int, high: int) -> int:
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit()) or not low <= int(raw) <= high:
        raise invalid(f"'{name}' must be a whole number from {low} to {high}, got {shown(raw)}")
    return int(raw)


async def retrieve_file(request: Request) -> Response:
    return encode_response(request, file_object(await own_file(
        request, request.path_params["file_id"])))


async def delete_file(request: Request) -> Response:
    record = await own_file(request, request.path_params["file_id"])
    await files_of(request).delete(record)
    await asyncio.to_thread(blobs_of(request).delete, [record.key])
    return encode_response(request, {"id": record.id, "object": "file", "deleted": True})


async def file_content(request: Request) -> Response:
    record = await own_file(request, request.path_params["file_id"])
    from tasks.blobs import BlobMissing

    try:
        source = await asyncio.to_thread(blobs_of(request).open_read, record.key)
    except BlobMissing:
        raise ApiError(ErrorCode.NOT_FOUND, f"the content of file {record.id} is gone from "
                       "the blob store") from None

    # The name as the uploader gave it, made safe for a header (ASCII, no quotes).
    name = "".join(c if " " <= c <= "~" and c not in '"\\' else "_" for c in record.filename)
    return StreamingResponse(stream_file(source), media_type="application/octet-stream", headers={
        "Content-Length": str(record.bytes),
        "Content-Disposition": f'attachment; filename="{name}"'})
