"""The emulated device's queue of passes, as a CUDA stream is one: a pass starts when the
one before it ends (or when it is called, if later). One process's (`Stream`), or one
that the processes of a device share through a mapped file (`SharedStream`: the replicas
`runtimes.worker_side.replicas` starts, whose environment names their device the same,
`runtimes.base.DEVICE_GROUP_ENV`). The file is this module's: named from the group (the
worker's pid first), made by the first replica to queue a pass, and left for a later
start to remove once that worker has exited.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
import struct
import tempfile
import threading
import time
from pathlib import Path

from runtimes.base import DEVICE_GROUP_ENV

QUEUE_PREFIX = "shoal-device-queue-"


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
    """This process's queue: shared with the other processes of its device group, if it
    has one (`DEVICE_GROUP_ENV`), else its own."""
    group = os.environ.get(DEVICE_GROUP_ENV, "").strip()
    if not group:
        return Stream()
    _remove_stale()
    return SharedStream(str(queue_path(group)))


def queue_path(group: str) -> Path:
    """The file a device group's queue lives in."""
    name = re.sub(r"[^0-9A-Za-z.-]", "_", group)
    return Path(tempfile.gettempdir()) / f"{QUEUE_PREFIX}{name}"


def _remove_stale() -> None:
    """Remove the queues of groups whose worker (the pid the group starts with) is gone."""
    for path in Path(tempfile.gettempdir()).glob(f"{QUEUE_PREFIX}*"):
        pid = re.match(r"(\d+)-", path.name[len(QUEUE_PREFIX):])
        if pid is None or _alive(int(pid.group(1))):
            continue
        with contextlib.suppress(OSError):
            path.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (another user's: alive)
        return True
    return True
