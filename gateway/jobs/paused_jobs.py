"""Paused jobs recorded where a gateway that starts finds them: a small file in the job's
folder in the blob store.

A driver that stops for want of Redis (or of the broker, or the blob store) pauses its
job and keeps what it knows of it (`KnownJob`) in memory (`gateway.jobs.orphans`) until
Redis says whether the job is still there. A gateway restarted meanwhile would forget it:
nothing in Redis may list it any more (a Redis that comes back empty), the hourly sweep
spares folders younger than an hour, and its parts out would run for nobody. So the pause
also writes `paused.msgpack` into the job's folder (`PausedRecords.write`: the job's id,
folder and parts published, and the stack's queue prefix, which namespaces its Redis
keys), and every gateway reads its stack's records when it starts
(`read_all`, again until the blob store answers) and watches the jobs as its own orphans:
a job Redis still has goes back to the scan and its record is removed; a job Redis lost
has its parts revoked and its folder (the record with it) deleted.

Only msgpack is read back, never pickle; a record that does not parse is logged and left
to the sweep.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import msgpack

log = logging.getLogger(__name__)

RECORD = "paused.msgpack"
WRITE_TIMEOUT_S = 10.0  # a blob store that hangs does not hold the driver's pause longer


@dataclasses.dataclass(slots=True)
class KnownJob:
    """What a driver knows of its job without Redis: enough to stop it if Redis comes back
    without it. `published` is counted as parts go out, since the count in Redis misses a
    part published just before Redis went away."""

    job_id: str
    folder: str  # all of the job's files (its upload, parts, result); not a caller's input
    published: int


def record_key(folder: str) -> str:
    return f"{folder}/{RECORD}"


class PausedRecords:
    """The paused jobs' records in the blob store (`blobs()`: the store)."""

    def __init__(self, blobs: Callable[[], Any], prefix: str) -> None:
        self.blobs = blobs
        self.prefix = prefix  # the stack's (SHOAL_QUEUE_PREFIX): its Redis keys' too

    async def write(self, known: KnownJob) -> None:
        """Record a paused job in its folder; a blob store away is logged (the job is then
        known to this gateway only, as before)."""
        data = msgpack.packb({"job": known.job_id, "folder": known.folder,
                              "published": known.published, "paused_at": time.time(),
                              "prefix": self.prefix})
        try:
            await asyncio.wait_for(asyncio.to_thread(self.blobs().put,
                                                     record_key(known.folder), data),
                                   WRITE_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("could not record paused job %s in the blob store (%s): a gateway "
                        "restarted before Redis answers again will not know of it",
                        known.job_id, exc)

    async def remove(self, known: KnownJob) -> None:
        """The job is Redis's again (or finished): its record goes."""
        try:
            await asyncio.to_thread(self.blobs().delete, [record_key(known.folder)])
        except Exception as exc:  # the sweep takes it with its folder
            log.info("could not remove the pause record of job %s: %s", known.job_id, exc)

    async def read_all(self) -> list[KnownJob]:
        """Every paused job recorded in the blob store by this stack (its queue prefix: a
        blob store shared by stacks on other prefixes holds theirs too, whose jobs this
        stack's Redis does not know); raises if the store is away."""
        from tasks.blobs import JOBS

        blobs = self.blobs()

        def scan() -> list[KnownJob]:
            found = []
            for path in blobs.fs.glob(blobs.path(f"{JOBS}/*/{RECORD}")):
                try:
                    record = msgpack.unpackb(blobs.fs.cat_file(path), raw=False)
                    if record.get("prefix") != self.prefix:
                        continue
                    found.append(KnownJob(str(record["job"]), str(record["folder"]),
                                          int(record["published"])))
                except FileNotFoundError:
                    continue  # removed since it was listed
                except (ValueError, KeyError, TypeError, AttributeError) as exc:
                    log.warning("ignoring the pause record %s, which does not parse: %s",
                                path, exc)
            return found

        return await asyncio.to_thread(scan)
