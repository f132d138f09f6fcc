"""OpenAI's files (`/v1/files`): the inputs and outputs of the Batch API.

A file's bytes live in the blob store (`files/{id}`), its metadata in Redis beside the
jobs (`{prefix}:file:{id}`, a hash), listed per owner (`{prefix}:files:{owner}`, a
sorted set by creation time). A file belongs to the API key that uploaded it (or whose
batch wrote it), as a job does: every other key is told there is no such file. Files
stay until they are deleted (`DELETE /v1/files/{id}`); a batch's output and error files
are the caller's to delete too.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from gateway.jobs.store import JobStore

FILES = "files"  # the blob store's folder of files
NO_OWNER = "-"  # the owner of files made with API keys off
BATCH, BATCH_OUTPUT = "batch", "batch_output"


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def blob_key(file_id: str) -> str:
    return f"{FILES}/{file_id}"


@dataclass(slots=True)
class FileRecord:
    id: str
    bytes: int
    filename: str
    purpose: str
    owner: str = NO_OWNER
    created_at: float = 0.0

    @property
    def key(self) -> str:
        return blob_key(self.id)


def file_object(record: FileRecord) -> dict[str, Any]:
    """The file as OpenAI's API shows it."""
    return {"id": record.id, "object": "file", "bytes": record.bytes,
            "created_at": int(record.created_at), "filename": record.filename,
            "purpose": record.purpose, "status": "processed", "status_details": None,
            "expires_at": None}


class FileStore:
    """Files' metadata in the jobs' Redis (the JobStore's client and key prefix)."""

    def __init__(self, jobs: JobStore) -> None:
        self.jobs = jobs

    def key(self, file_id: str) -> str:
        return f"{self.jobs.prefix}:file:{file_id}"

    def index(self, owner: str) -> str:
        return f"{self.jobs.prefix}:files:{owner}"

    async def create(self, record: FileRecord) -> None:
        record.created_at = record.created_at or time.time()
        async with self.jobs.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.key(record.id), mapping=asdict(record))
            pipe.zadd(self.index(record.owner), {record.id: record.created_at})
            await pipe.execute()

    async def get(self, file_id: str) -> FileRecord | None:
        raw = await self.jobs.redis.hgetall(self.key(file_id))
        if not raw:
            return None
        fields = {k.decode(): v.decode() for k, v in raw.items()}
        return FileRecord(id=fields["id"], bytes=int(fields["bytes"]),
                          filename=fields["filename"], purpose=fields["purpose"],
                          owner=fields["owner"], created_at=float(fields["created_at"]))

    async def delete(self, record: FileRecord) -> None:
        async with self.jobs.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.key(record.id))
            pipe.zrem(self.index(record.owner), record.id)
            await pipe.execute()

    async def page(self, owner: str, limit: int, after: str | None, newest_first: bool,
                   purpose: str | None = None) -> tuple[list[FileRecord], bool]:
        """Up to `limit` of `owner`'s files after the file `after`, and whether more follow."""
        redis = self.jobs.redis
        index = self.index(owner)
        start = 0
        if after is not None:
            rank = await (redis.zrevrank(index, after) if newest_first
                          else redis.zrank(index, after))
            start = 0 if rank is None else rank + 1
        found: list[FileRecord] = []
        step = max(limit + 1, 100)
        while len(found) <= limit:
            ids = await (redis.zrevrange(index, start, start + step - 1) if newest_first
                         else redis.zrange(index, start, start + step - 1))
            if not ids:
                break
            start += len(ids)
            for file_id in ids:
                record = await self.get(file_id.decode())
                if record is not None and (purpose is None or record.purpose == purpose):
                    found.append(record)
        return found[:limit], len(found) > limit
