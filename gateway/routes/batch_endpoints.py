"""The endpoints an OpenAI batch may run, and a batch's input checked line by line.

Each endpoint's lines are turned into tasks, and their results into response bodies, by
the sync route's own functions (`embeddings_task`/`embeddings_payload`, ...), so a line's
answer is what the sync route answers for the same body, and a line the route would
refuse is refused with the same status and message. The body halves are registered with
`gateway.jobs.batch_output.RENDERERS`, which writes a batch's output at its end.

`prepare` reads a batch's input file once, at acceptance, with the caller's request (so
its API key's model grants apply to every line, as on the sync route): every line's
frame and body checked, the lines that can run written as records (their task kwargs
and body) to the batch's lines file, the others answered at once in its refused file.
A batch runs one model, as OpenAI's do: a line naming another is refused. A whole file
that cannot be a batch (empty, no line of JSON, a custom_id twice) fails the batch.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from gateway.edge.api_errors import invalid
from gateway.jobs.batch_lines import (
    INVALID_JSON,
    MISMATCHED_MODEL,
    LineError,
    never_ran,
    new_request_id,
    pack_record,
    read_line,
    split_lines,
)
from gateway.jobs.batch_output import RENDERERS, error_line, lines_key, refused_key
from gateway.jobs.bulk_files import read_chunks
from gateway.routes.completions import (
    chat_payload,
    chat_task,
    completion_payload,
    completion_task,
)
from gateway.routes.embeddings import embeddings_payload, embeddings_task
from gateway.routes.rerank import rerank_payload, rerank_task
from tasks.catalog import ModelEntry
from tasks.errors import ShoalError

Task = Callable[[Request, dict[str, Any]], tuple[ModelEntry, dict[str, Any]]]


def _no_stream(task: Task) -> Task:
    """A generate route's task for a batch line: its answer is one body, never a stream."""
    def checked(request: Request, body: dict[str, Any]) -> tuple[ModelEntry, dict[str, Any]]:
        if body.get("stream") not in (None, False) or body.get("stream_options") is not None:
            raise invalid("'stream' is not supported in a batch: each line is answered "
                          "with one response body (leave 'stream' and 'stream_options' out)")
        return task(request, body)
    return checked


TASKS: dict[str, Task] = {
    "/v1/embeddings": embeddings_task,
    "/v1/completions": _no_stream(completion_task),
    "/v1/chat/completions": _no_stream(chat_task),
    "/v1/rerank": rerank_task,
}
RENDERERS.update({
    "/v1/embeddings": lambda body, result, request_id, model: embeddings_payload(body, result),
    "/v1/completions": lambda body, result, request_id, model: completion_payload(
        body, result, f"cmpl-{uuid.uuid4().hex}"),
    "/v1/chat/completions": lambda body, result, request_id, model: chat_payload(
        body, result, f"chatcmpl-{uuid.uuid4().hex}"),
    "/v1/rerank": lambda body, result, request_id, model: rerank_payload(
        body, result, request_id, model),
})
ENDPOINTS = tuple(TASKS)


@dataclass(slots=True)
class Prepared:
    """What `prepare` found: line counts, the batch's model, or why it fails whole."""

    total: int = 0  # lines that are not blank
    runnable: int = 0
    refused: int = 0
    model: ModelEntry | None = None
    fatal: dict[str, Any] | None = None  # OpenAI's batch error: {code, message, line}


def prepare(request: Request, endpoint: str, blobs: Any, input_key: str,
            folder: str) -> Prepared:
    """Check the input file `input_key` for `endpoint` and write the batch's lines and
    refused files under `folder` (see the module doc). Blocks: run it in a thread."""
    task = TASKS[endpoint]
    found = Prepared()
    seen: set[str] = set()
    not_json = 0
    with blobs.open_read(input_key) as source, \
            blobs.open_write(lines_key(folder)) as lines, \
            blobs.open_write(refused_key(folder)) as refused:
        for number, raw in enumerate(split_lines(read_chunks(source)), 1):
            try:
                line = read_line(raw, number, endpoint)
            except LineError as exc:
                found.total += 1
                not_json += exc.code == INVALID_JSON
                found.refused += 1
                refused.write(never_ran(exc.custom_id, exc.code, exc.message))
                continue
            if line is None:
                continue
            found.total += 1
            if line.custom_id in seen:
                found.fatal = {"code": "duplicate_custom_id", "line": number, "param": None,
                               "message": f"line {number}: the custom_id {line.custom_id!r} "
                               "is already used by an earlier line; every line of a batch "
                               "needs its own custom_id"}
                return found
            seen.add(line.custom_id)
            try:
                entry, kwargs = task(request, line.body)
            except ShoalError as exc:
                found.refused += 1
                refused.write(error_line(endpoint, line.custom_id, exc, new_request_id()))
                continue
            if found.model is None:
                found.model = entry
            elif entry.id != found.model.id:
                found.refused += 1
                refused.write(never_ran(line.custom_id, MISMATCHED_MODEL, f"line {number} "
                              f"runs {entry.id}, but this batch runs {found.model.id} (its "
                              "first line's model): a batch runs one model"))
                continue
            lines.write(pack_record(number, line.custom_id, kwargs, line.body))
            found.runnable += 1
    if found.total == 0:
        found.fatal = {"code": "empty_file", "line": None, "param": None, "message":
                       "the input file has no lines: send one request per line, "
                       '{"custom_id", "method": "POST", "url", "body"}'}
    elif not_json == found.total:
        found.fatal = {"code": "invalid_json_line", "line": 1, "param": None, "message":
                       "no line of the input file is JSON: it must be JSONL, one request "
                       'per line, {"custom_id", "method": "POST", "url", "body"}'}
    return found
