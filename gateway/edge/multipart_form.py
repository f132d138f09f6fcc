"""A multipart/form-data body read as it streams in (RFC 7578), never held whole.

`POST /v1/files` takes an upload as the openai SDK sends it: a form with a `purpose`
field and a `file` field, the file possibly gigabytes. Starlette's own form parser needs
python-multipart, and spools every file to a temporary file before the route sees it;
here the route gets the file's bytes chunk by chunk (`FormReader.feed` returns events)
and writes them straight to the blob store.

Events: `Part(name, filename)` at a field's start, `bytes` of its content (in as many
pieces as the network gave), `End()` at its end. Everything that is not a form a client
would send (no boundary, headers past HEADER_LIMIT, a body that stops before its closing
boundary) is a 400 saying so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gateway.edge.api_errors import invalid
from tasks.errors import ShoalError

HEADER_LIMIT = 16 * 1024  # bytes of one part's headers
_BOUNDARY = re.compile(r'boundary=(?:"([^"]+)"|([^;,\s]+))', re.IGNORECASE)
_NAME = re.compile(r'\bname="([^"]*)"', re.IGNORECASE)
_FILENAME = re.compile(r'\bfilename="([^"]*)"', re.IGNORECASE)
_PREAMBLE, _HEADERS, _BODY, _AFTER, _DONE = range(5)


@dataclass(frozen=True, slots=True)
class Part:
    name: str
    filename: str | None


@dataclass(frozen=True, slots=True)
class End:
    pass


Event = Part | End | bytes


def boundary_of(content_type: str | None) -> bytes:
    """The boundary of a multipart/form-data Content-Type; 400 for any other type."""
    kind = (content_type or "").split(";", 1)[0].strip().lower()
    found = _BOUNDARY.search(content_type or "")
    if kind != "multipart/form-data" or found is None:
        raise _bad("send the upload as multipart/form-data (the openai SDK's "
                   "files.create does), with the fields 'file' and 'purpose'")
    return (found.group(1) or found.group(2)).encode("latin-1")


def _bad(message: str) -> ShoalError:
    return invalid(message)


class FormReader:
    """Turns the chunks of a multipart/form-data body into events (see the module doc)."""

    def __init__(self, boundary: bytes) -> None:
        self.first = b"--" + boundary
        self.delimiter = b"\r\n--" + boundary
        self.buffer = b""
        self.state = _PREAMBLE

    def feed(self, chunk: bytes) -> list[Event]:
        self.buffer += chunk
        events: list[Event] = []
        while True:
            step = self._step(events)
            if not step:
                return events

    def close(self) -> None:
        if self.state != _DONE:
            raise _bad("the form ended before its closing boundary: the upload was cut off")

    def _step(self, events: list[Event]) -> bool:
        """One move of the state machine; False when it needs more bytes."""
        buffer = self.buffer
        if self.state == _PREAMBLE:
            at = buffer.find(self.first)
            if at < 0:
                self.buffer = buffer[-len(self.first):]  # a preamble is ignored
                return False
            self.buffer = buffer[at + len(self.first):]
            self.state = _AFTER
            return True
        if self.state == _AFTER:
            if len(buffer) < 2:
                return False
            if buffer.startswith(b"--"):
                self.state, self.buffer = _DONE, b""
                return False
            if not buffer.startswith(b"\r\n"):
                raise _bad("a form boundary must be followed by a line break or '--'")
            self.buffer = buffer[2:]
            self.state = _HEADERS
            return True
        if self.state == _HEADERS:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > HEADER_LIMIT:
                    raise _bad(f"a form part's headers are over {HEADER_LIMIT} bytes")
                return False
            events.append(_part(buffer[:end]))
            self.buffer = buffer[end + 4:]
            self.state = _BODY
            return True
        if self.state == _BODY:
            at = buffer.find(self.delimiter)
            if at < 0:
                # Keep what could be the start of the delimiter; the rest is content.
                keep = len(self.delimiter) - 1
                if len(buffer) > keep:
                    events.append(buffer[:-keep])
                    self.buffer = buffer[-keep:]
                return False
            if at:
                events.append(buffer[:at])
            events.append(End())
            self.buffer = buffer[at + len(self.delimiter):]
            self.state = _AFTER
            return True
        return False  # done: what follows the closing boundary is ignored


def _part(raw: bytes) -> Part:
    headers = raw.decode("utf-8", "replace")
    for line in headers.split("\r\n"):
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-disposition":
            field = _NAME.search(value)
            if field is None:
                break
            filename = _FILENAME.search(value)
            return Part(field.group(1), filename.group(1) if filename else None)
    raise _bad("every form part needs 'Content-Disposition: form-data; name=\"...\"'")
