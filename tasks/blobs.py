"""The blob store: where claim-checked binaries, job inputs and job results live.

One fsspec filesystem under one URL (`SHOAL_BLOB_URL`): a local folder by default
(one machine, nothing to set up), `s3://bucket/prefix` (s3fs) or any fsspec URL for
a fleet. Keys are relative paths; every key starts with its kind and the epoch second
it was made (`claims/1764800000-<hex>`, `jobs/1764800000-<id>/input.jsonl`), so
`sweep` can remove what outlived its TTL on any filesystem, without relying on each
one's idea of a modification time.

Calls are blocking (fsspec's sync API); the gateway runs them in a thread.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import IO, Any

DEFAULT_LOCAL_DIR = Path.home() / ".cache" / "shoal" / "blobs"
CLAIMS = "claims"
JOBS = "jobs"


class BlobMissing(LookupError):
    """No blob under that key."""


class BlobStore:
    def __init__(self, url: str = "", **storage_options: Any) -> None:
        # Imported here: fsspec takes ~0.15 s to import and the gateway (which must start
        # light) needs it only for its first claim-checked request.
        import fsspec

        url = url or str(DEFAULT_LOCAL_DIR)
        self.url = url
        self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        self.root = root.rstrip("/")
        self.local = "file" in _protocols(self.fs)
        if self.local:
            self.fs.makedirs(self.root, exist_ok=True)

    def path(self, key: str) -> str:
        return f"{self.root}/{key}"

    @staticmethod
    def new_key(kind: str, name: str | None = None) -> str:
        """A fresh key of `kind` that records when it was made (see `sweep`)."""
        return f"{kind}/{int(time.time())}-{name or uuid.uuid4().hex}"

    def put(self, key: str, data: bytes | memoryview) -> None:
        """Store `data` under `key`; readers never see it half-written."""
        with self.open_write(key) as f:
            f.write(data)

    def open_write(self, key: str) -> _AtomicWrite:
        """A binary file to write `key` from, in pieces; it appears whole on close, and not
        at all if the block raises."""
        return _AtomicWrite(self, key)

    def get(self, key: str) -> bytes:
        try:
            return self.fs.cat_file(self.path(key))
        except FileNotFoundError:
            raise BlobMissing(key) from None

    def open_read(self, key: str) -> IO[bytes]:
        try:
            return self.fs.open(self.path(key), "rb")
        except FileNotFoundError:
            raise BlobMissing(key) from None

    def exists(self, key: str) -> bool:
        return bool(self.fs.exists(self.path(key)))

    def size(self, key: str) -> int:
        try:
            return int(self.fs.size(self.path(key)))
        except FileNotFoundError:
            raise BlobMissing(key) from None

    def delete(self, keys: Iterable[str], recursive: bool = False) -> None:
        """Remove blobs (or, `recursive`, folders of them); missing ones are no error."""
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self.path(key), recursive=recursive)

    def sweep(self, kind: str, older_than_s: float, now: float | None = None) -> list[str]:
        """Remove the entries of `kind` made more than `older_than_s` ago; their keys."""
        cutoff = (time.time() if now is None else now) - older_than_s
        try:
            entries = self.fs.ls(self.path(kind), detail=False)
        except FileNotFoundError:
            return []
        swept = []
        for entry in entries:
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            made = _made_at(name)
            if made is None or made >= cutoff:
                continue
            key = f"{kind}/{name}"
            self.delete([key], recursive=True)
            swept.append(key)
        self.fs.invalidate_cache()
        return swept


class _AtomicWrite:
    """Write to a temporary name, move into place on success. s3 and most object stores
    publish an object only when its upload completes; a local file would be visible
    half-written, hence the move."""

    def __init__(self, store: BlobStore, key: str) -> None:
        self.store = store
        self.key = key
        self.temp = f"{key}.part-{uuid.uuid4().hex}" if store.local else key
        self.file: IO[bytes] | None = None

    def __enter__(self) -> IO[bytes]:
        path = self.store.path(self.temp)
        if self.store.local:
            self.store.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        self.file = self.store.fs.open(path, "wb")
        return self.file

    def __exit__(self, kind: object, error: object, traceback: object) -> None:
        assert self.file is not None
        discard = getattr(self.file, "discard", None)
        if error is not None and not self.store.local and discard is not None:
            discard()  # abandon the multipart upload: no partial object appears
            self.file.closed = True  # type: ignore[misc]  # close() would upload the rest
        else:
            self.file.close()
        if not self.store.local:
            return
        if error is not None:
            self.store.delete([self.temp])
        else:
            self.store.fs.mv(self.store.path(self.temp), self.store.path(self.key))


def _protocols(fs: Any) -> set[str]:
    protocol = fs.protocol
    return set(protocol) if isinstance(protocol, tuple | list) else {protocol}


def _made_at(name: str) -> int | None:
    head = name.split("-", 1)[0]
    return int(head) if head.isdigit() else None


@lru_cache(maxsize=8)
def blob_store(url: str = "") -> BlobStore:
    """The store at `url` (SHOAL_BLOB_URL), one per process."""
    return BlobStore(url)
