"""The emulated device's queue of passes, as a CUDA stream is one: a pass starts when the
one before it ends (or when it is called, if later). One process's (`Stream`), or one
that the processes of a device share through a mapped file (`SharedStream`: the replicas
`runtimes.worker_side.replicas` starts, `EMULATED_QUEUE_ENV` naming the file).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import threading
import time

from runtimes.base import EMULATED_QUEUE_ENV


def wait_until(deadline: float) -> None:
    """Sleep (GIL released) until `time.perf_counter()` reaches `deadline`; never less."""
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(left)


class Stream:
    """The emulated device's queue of passes: when it is free again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free_at = 0.0

    def queue(self, called: float, seconds: float) -> float:
        """Queue a pass of `seconds` called at `called`; when it ends."""
        with self._lock:
            self._free_at = max(called, self._free_at) + seconds
            return self._free_at


class SharedStream:
    """`Stream` in a file that several processes map: the replicas of one device
    (`runtimes.worker_side.replicas`) queue their passes on one emulated device, as their kernels
    would on one GPU. perf_counter is CLOCK_MONOTONIC on Linux: one clock for all."""

    def __init__(self, path: str) -> None:
        self._lock = threading.Lock()
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        if os.fstat(self._fd).st_size < _FREE_AT.size:
            os.ftruncate(self._fd, _FREE_AT.size)  # zeros: free since the epoch
        self._map = mmap.mmap(self._fd, _FREE_AT.size)

    def queue(self, called: float, seconds: float) -> float:
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                (free_at,) = _FREE_AT.unpack_from(self._map)
                free_at = max(called, free_at) + seconds
                _FREE_AT.pack_into(self._map, 0, free_at)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            return free_at


_FREE_AT = struct.Struct("d")


def make_stream() -> Stream | SharedStream:
    path = os.environ.get(EMULATED_QUEUE_ENV)
    return SharedStream(path) if path else Stream()
