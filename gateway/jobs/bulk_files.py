"""A bulk job's input file cut into parts, and its parts' results gathered into one file.

The input is JSONL: one item per line, `{"text": ...}` (any item the model's
native route takes) or a bare JSON string; blank lines are skipped. `InputCheck`
reads it as it streams in (the upload route feeds it chunk by chunk) and checks
every line with the model entry's own parser, so a bad file is refused before
anything is queued, with the line named. `PartReader` reads it again, from any
byte offset, when parts are published: both cut parts with the same rule
(`part_items` items, or fewer once they hold `PART_MAX_BYTES`), so the number of
parts is known at upload and a splitter can resume from a recorded offset.

Part results are written to the blob store as they come (`encode_part`: raw
float32 rows for a dense float32 encode, JSONL lines otherwise) and `gather`
joins them in order into `result.npy` or `result.jsonl`.

Everything here blocks (file I/O, parsing); the gateway runs it in threads.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Iterator
from typing import IO, Any

import orjson

from gateway.edge.api_errors import ApiError, invalid
from tasks.errors import ErrorCode, ShoalError
from tasks.results import embedding_rows, multivector_rows

# A part's bytes of input at most: with long texts, `part_items` of them would make
# messages of tens of MB (the broker holds each in memory, and one part is one unit of
# redelivery); 1 MiB keeps a part a few hundred ms to seconds of model time.
PART_MAX_BYTES = 1024 * 1024
# Items per part when settings do not say: 8 batches of the model's tuned size (see
# `part_items`), within these bounds.
MIN_PART_ITEMS, MAX_PART_ITEMS = 256, 4096
BULK_OPERATIONS = frozenset({"encode", "score", "extract", "classify"})
NPY, JSONL = "npy", "jsonl"
COPY_CHUNK = 1024 * 1024


def part_items(configured: int, batch_items: int) -> int:
    """Items per part: `configured` (SHOAL_JOB_PART_ITEMS) if set, else 8 batches of the
    model's tuned `batch_items`, clamped to MIN_PART_ITEMS..MAX_PART_ITEMS.

    A part costs a fixed ~2 ms of CPU outside the model (a publish with confirm, the
    worker's consume and reply, the gateway's record in Redis and its part file) and
    a message the broker holds. 8 batches make that under 1% of the model time on this
    CPU (MiniLM: 512 texts ~ 0.8 s) and a few % on a GPU, while a part stays small
    enough that cancelling or a lost gateway wastes little, progress moves often, and
    the worker still interleaves it with other callers' requests (it runs a part as
    budget-sized batches, tasks.split)."""
    if configured:
        return configured
    return max(MIN_PART_ITEMS, min(MAX_PART_ITEMS, 8 * batch_items))


def _full(items: int, size: int, per_part: int) -> bool:
    """The one rule where a part ends, shared by the check and the reader."""
    return items >= per_part or size >= PART_MAX_BYTES


def parse_line(raw: bytes, line: int) -> Any:
    """The item of one input line; None for a blank line."""
    raw = raw.strip()
    if not raw:
        return None
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(ErrorCode.INVALID_REQUEST,
                       f"line {line}: not JSON ({exc}); the input must be JSONL, one item "
                       'per line: {"text": "..."} or a JSON string') from None
    if isinstance(value, str):
        return {"text": value}
    if isinstance(value, dict):
        return value
    raise invalid(f"line {line}: expected an item such as {{\"text\": \"...\"}} or a JSON "
                  f"string, got a JSON {type(value).__name__}")


class InputCheck:
    """Checks a JSONL input as it streams in; counts its items and parts.

    `check(items)` is the model's parser for a list of items (raises ShoalError);
    items are checked a part at a time, and only a part that fails is checked again
    item by item, to name the line."""

    def __init__(self, check: Any, max_text_chars: int, per_part: int) -> None:
        self.check = check
        self.max_text_chars = max_text_chars
        self.per_part = per_part
        self.lines = 0
        self.items = 0
        self.parts = 0
        self._rest = b""
        self._batch: list[Any] = []
        self._batch_lines: list[int] = []
        self._batch_bytes = 0

    def feed(self, chunk: bytes) -> None:
        data = self._rest + chunk if self._rest else chunk
        lines = data.split(b"\n")
        self._rest = lines.pop()
        for raw in lines:
            self._line(raw)

    def close(self) -> None:
        if self._rest:
            self._line(self._rest)
            self._rest = b""
        self._flush()
        if self.items == 0:
            raise invalid("the input has no items: send one JSON item per line")

    def _line(self, raw: bytes) -> None:
        self.lines += 1
        item = parse_line(raw, self.lines)
        if item is None:
            return
        text = item.get("text")
        if isinstance(text, str) and len(text) > self.max_text_chars:
            raise ApiError(ErrorCode.PAYLOAD_TOO_LARGE,
                           f"line {self.lines}: the text has {len(text)} characters, over "
                           f"the limit of {self.max_text_chars}")
        self._batch.append(item)
        self._batch_lines.append(self.lines)
        self._batch_bytes += len(raw) + 1
        if _full(len(self._batch), self._batch_bytes, self.per_part):
            self._flush()

    def _flush(self) -> None:
        if not self._batch:
            return
        try:
            self.check(self._batch)
        except ShoalError:
            for item, line in zip(self._batch, self._batch_lines, strict=True):
                try:
                    self.check([item])
                except ShoalError as exc:
                    error = ShoalError(exc.code, f"line {line}: {exc.message}")
                    raise error from None
            raise
        self.items += len(self._batch)
        self.parts += 1
        self._batch, self._batch_lines, self._batch_bytes = [], [], 0


class PartReader:
    """Reads a checked input's parts in order from a byte offset (a resume point)."""

    def __init__(self, file: IO[bytes], offset: int, per_part: int) -> None:
        self.file = file
        self.per_part = per_part
        file.seek(offset)
        self.offset = offset

    def next_part(self) -> list[Any]:
        """The next part's items (empty at the end); `offset` moves past it."""
        items: list[Any] = []
        size = 0
        while not _full(len(items), size, self.per_part):
            raw = self.file.readline()
            if not raw:
                break
            self.offset += len(raw)
            item = parse_line(raw, 0)  # checked at upload: it parses
            if item is not None:
                items.append(item)
                size += len(raw.rstrip(b"\n")) + 1
        return items

    def close(self) -> None:
        self.file.close()


# --- part results --------------------------------------------------------------------------

def encode_part(op: str, result: dict[str, Any]) -> tuple[str, bytes, int, int]:
    """(kind, bytes, items, dims) of a part's result as its part file holds it: raw
    little-endian float32 rows for a dense float32 encode (kind NPY), else JSONL."""
    if op == "encode" and result.get("output", "dense") == "dense" \
            and result.get("dtype", "float32") == "float32":
        return NPY, bytes(result["embeddings"]), int(result["count"]), int(result["dims"])
    records = item_records(op, result)
    return JSONL, b"".join(orjson.dumps(r) + b"\n" for r in records), len(records), 0


def item_records(op: str, result: dict[str, Any]) -> list[dict[str, Any]]:
    """One JSON object per input item, in order."""
    if op == "encode":
        output = result.get("output", "dense")
        if output == "dense":
            rows: list[Any] = embedding_rows(result)
        elif output == "multivector":
            rows = multivector_rows(result)
        else:
            rows = result["embeddings"]
        return [{"embedding": row} for row in rows]
    if op == "score":
        return [{"score": s} for s in result["scores"]]
    if op == "extract":
        return [{"entities": e} for e in result["entities"]]
    if op == "classify":
        return [{"labels": labels} for labels in result["labels"]]
    raise ValueError(f"no bulk output for {op}")


def part_key(folder: str, index: int, answer: str = "") -> str:
    """Where a part's result is kept. `answer` tells apart the results of two copies of
    one part (published again after a takeover): each writes its own file and the part's
    meta names the one counted, so a late copy never rewrites a file being gathered."""
    return f"{folder}/parts/{index:08d}{'.' + answer if answer else ''}"


def gather(store: Any, folder: str, metas: list[dict[str, Any]]) -> tuple[str, str]:
    """Join the part files (`metas`: each part's kind, items, dims and file, in order)
    into one result file; (its key, its type). The part files are removed afterwards."""
    kinds = {m["kind"] for m in metas}
    kind = NPY if kinds == {NPY} else JSONL
    key = f"{folder}/result.{kind}"
    with store.open_write(key) as out:
        if kind == NPY:
            import numpy.lib.format as npy  # loaded when a job writes one

            rows = sum(m["items"] for m in metas)
            npy.write_array_header_1_0(out, {"descr": "<f4", "fortran_order": False,
                                             "shape": (rows, metas[0]["dims"])})
        for index in range(len(metas)):
            with store.open_read(metas[index].get("file") or part_key(folder, index)) as part:
                shutil.copyfileobj(part, out, COPY_CHUNK)
    store.delete([f"{folder}/parts"], recursive=True)
    return key, kind


def read_chunks(file: IO[bytes]) -> Iterator[bytes]:
    try:
        while chunk := file.read(COPY_CHUNK):
            yield chunk
    finally:
        file.close()


async def stream_file(file: IO[bytes]) -> AsyncIterator[bytes]:
    """A blob's chunks for a streamed response, each read on a thread (a blob store read
    may be a network call); the file is closed at the end or when the client leaves."""
    chunks = read_chunks(file)
    try:
        while chunk := await asyncio.to_thread(next, chunks, b""):
            yield chunk
    finally:
        await asyncio.to_thread(chunks.close)
