"""The lines of an OpenAI batch: its input lines read and checked, its output lines written.

An input line is OpenAI's request object, one JSON object per line:

    {"custom_id": "r1", "method": "POST", "url": "/v1/embeddings", "body": {...}}

`read_line` checks its frame (JSON, a string `custom_id`, `method` POST, `url` the
batch's endpoint, an object `body`) and hands back the custom id and body; the body
itself is checked later by the sync route's own code. A line whose frame is wrong
never runs: its answer (`never_ran`) is an error-file line with `error`
`{"code", "message"}` and no response. A line that ran, or was refused by the route's
checks as the sync route would refuse it, is answered with a response (`answered`):
its status code, a request id, and the body the sync route answers (an error in
OpenAI's envelope for a 4xx/5xx, in the error file).

The lines a batch runs are kept between its acceptance and its end in a file of frames
(`pack_record`, `RecordReader`): a 4-byte length and a msgpack record `[line, custom_id,
kwargs, body]` each (kwargs: the task's, ready to publish, binary parts raw), so the
publisher can resume at any byte offset and the finisher reads them again in order.

Pure functions and file readers; the gateway runs them in threads.
"""

from __future__ import annotations

import struct
import uuid
from dataclasses import dataclass
from typing import IO, Any

import msgpack
import orjson

from tasks.render import shown

_LENGTH = struct.Struct(">I")
MAX_CUSTOM_ID = 512  # characters; OpenAI's ids are short, a megabyte of id is a mistake

# The codes of lines that never ran (OpenAI's own names where it has the case).
INVALID_JSON = "invalid_json_line"
INVALID_REQUEST = "invalid_request"
MISMATCHED_URL = "mismatched_url"
MISMATCHED_MODEL = "mismatched_model"
BATCH_CANCELLED = "batch_cancelled"
BATCH_EXPIRED = "batch_expired"


class LineError(ValueError):
    """A line whose frame is wrong; it never runs (`code`, `message`; `custom_id` if the
    line had a readable one)."""

    def __init__(self, code: str, message: str, custom_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.custom_id = custom_id


@dataclass(frozen=True, slots=True)
class InputLine:
    custom_id: str
    body: dict[str, Any]


def read_line(raw: bytes, number: int, endpoint: str) -> InputLine | None:
    """The custom id and body of input line `number` (counted from 1); None for a blank
    line; LineError for a line whose frame is wrong (see the module doc)."""
    raw = raw.strip()
    if not raw:
        return None
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise LineError(INVALID_JSON, f"line {number} is not JSON ({exc}); each line must be "
                        '{"custom_id", "method": "POST", "url", "body"}') from None
    if not isinstance(value, dict):
        raise LineError(INVALID_JSON, f"line {number} is a JSON {type(value).__name__}, not "
                        'an object {"custom_id", "method": "POST", "url", "body"}')
    custom_id = value.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        raise LineError(INVALID_REQUEST, f"line {number}: 'custom_id' must be a non-empty "
                        f"string of at most {MAX_CUSTOM_ID} characters, got {shown(custom_id)}")
    if value.get("method") != "POST":
        raise LineError(INVALID_REQUEST, f"line {number}: 'method' must be \"POST\", got "
                        f"{shown(value.get('method'))}", custom_id)
    if value.get("url") != endpoint:
        raise LineError(MISMATCHED_URL, f"line {number}: 'url' is {shown(value.get('url'))}, "
                        f"but this batch's endpoint is {endpoint}: every line of a batch "
                        "goes to its endpoint", custom_id)
    body = value.get("body")
    if not isinstance(body, dict):
        raise LineError(INVALID_REQUEST, f"line {number}: 'body' must be an object (the "
                        f"request {endpoint} takes), got {shown(body)}", custom_id)
    return InputLine(custom_id, body)


def split_lines(chunks: Any) -> Any:
    """The lines of a file read in chunks (bytes, without their newline)."""
    rest = b""
    for chunk in chunks:
        lines = (rest + chunk).split(b"\n")
        rest = lines.pop()
        yield from lines
    if rest:
        yield rest


# --- output lines ----------------------------------------------------------------------

def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


def _line_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def answered(custom_id: str | None, status: int, body: Any, request_id: str) -> bytes:
    """The output (2xx) or error (4xx/5xx) line of a request that got a response; `body`
    is the sync route's (numpy rows are written as the route writes them)."""
    line = {"id": _line_id(), "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": None}
    return orjson.dumps(line, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"


def never_ran(custom_id: str | None, code: str, message: str) -> bytes:
    """The error line of a request that never ran (its frame was wrong, or its batch was
    cancelled or expired first)."""
    line = {"id": _line_id(), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}
    return orjson.dumps(line) + b"\n"


# --- the records of the lines a batch runs ---------------------------------------------

def pack_record(line: int, custom_id: str, kwargs: dict[str, Any], body: dict[str, Any]
                ) -> bytes:
    data = msgpack.packb([line, custom_id, kwargs, body], use_bin_type=True)
    return _LENGTH.pack(len(data)) + data


@dataclass(frozen=True, slots=True)
class Record:
    line: int
    custom_id: str
    kwargs: dict[str, Any]
    body: dict[str, Any]


class RecordReader:
    """Reads the records of a lines file in order from a byte offset (a resume point)."""

    def __init__(self, file: IO[bytes], offset: int = 0) -> None:
        self.file = file
        file.seek(offset)
        self.offset = offset

    def next(self) -> Record | None:
        """The next record (None at the end); `offset` moves past it."""
        head = self.file.read(_LENGTH.size)
        if len(head) < _LENGTH.size:
            return None
        (size,) = _LENGTH.unpack(head)
        data = self.file.read(size)
        if len(data) < size:
            raise ValueError("a batch's lines file ends inside a record")
        self.offset += _LENGTH.size + size
        line, custom_id, kwargs, body = msgpack.unpackb(data, raw=False)
        return Record(line, custom_id, kwargs, body)

    def next_part(self) -> list[Any]:
        """The next record's task kwargs as the job's one-request part (empty at the
        end), as `gateway.jobs.bulk_files.PartReader` gives a part's items."""
        record = self.next()
        return [] if record is None else [record.kwargs]

    def close(self) -> None:
        self.file.close()
