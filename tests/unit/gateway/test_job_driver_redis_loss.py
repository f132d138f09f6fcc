"""A job driver that loses Redis mid-job (issue 41). Redis comes back empty (restarted
without persistence): the driver revokes the parts it had published and deletes the job's
files as soon as Redis answers, and writes nothing of the job again. Redis comes back with
the job (appendonly): nothing is revoked or deleted, and the job is driven again.

A real Redis of the test's own, killed and started again (tests/private_redis.py); in place
of the gateway's broker link, a recorder of the parts the driver publishes and revokes
(the broker's side of a revoke is tests/e2e/test_jobs_redis_loss.py's)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.jobs.driver import JobDriver
from gateway.jobs.part_replies import part_id
from gateway.jobs.store import Job, JobStore
from tasks.blobs import JOBS, BlobStore
from tasks.catalog import ModelEntry, Source
from tasks.envelope import Part
from tasks.settings import Settings
from tests.private_redis import PrivateRedis
from tests.stack import wait_for

PARTS, PER_PART, IN_FLIGHT = 5, 2, 2


class Recorder:
    """What the driver asks of the broker: parts published (their ids), parts revoked."""

    def __init__(self) -> None:
        self.published: list[str] = []
        self.cancelled: list[str] = []

    async def publish_part(self, model: str, part: Part, timeout_s: float,
                           reply_to: str) -> None:
        self.published.append(part.task_id)

    async def cancel(self, task_ids: list[str]) -> None:
        self.cancelled.extend(task_ids)


async def until(condition: Callable[[], Any], what: str, timeout: float = 30) -> None:
    """tests.stack.wait_for off the event loop, so that the driver runs meanwhile."""
    await asyncio.to_thread(wait_for, condition, timeout, what)


async def started_job(redis: PrivateRedis, tmp_path: Path
                      ) -> tuple[JobDriver, Recorder, JobStore, Path, str]:
    """A bulk job of PARTS parts whose driver has published IN_FLIGHT of them (nobody
    answers them, so it waits for room)."""
    prefix = f"shoal-unit-{uuid.uuid4().hex[:8]}"
    settings = Settings(redis_url=redis.url, queue_prefix=prefix, job_lease_s=1.5,
                        job_parts_in_flight=IN_FLIGHT, blob_url=str(tmp_path / "blobs"))
    store = JobStore(redis.url, prefix, ttl_s=60)
    blobs = BlobStore(settings.blob_url)
    job_id = uuid.uuid4().hex
    folder = BlobStore.new_key(JOBS, job_id)
    blobs.put(f"{folder}/input.jsonl", b"".join(
        json.dumps({"text": f"text {i}"}).encode() + b"\n" for i in range(PARTS * PER_PART)))
    await store.create(Job(id=job_id, operation="encode", model="m", bulk=True, folder=folder,
                           input=f"{folder}/input.jsonl", part_items=PER_PART,
                           parts_total=PARTS, items_total=PARTS * PER_PART))
    entry = ModelEntry(id="m", adapter="dense", source=Source(path="/nowhere"), dims=4)
    broker = Recorder()
    driver = JobDriver(settings, store, broker, {"m": entry}, lambda: blobs)
    driver.start()
    await driver.kick(job_id)
    await until(lambda: len(broker.published) == IN_FLIGHT, "the first parts published")
    return driver, broker, store, Path(blobs.path(folder)), job_id


@dataclass
class Running:
    """A started job (see `started_job`) on a Redis of the test's own."""

    redis: PrivateRedis
    driver: JobDriver
    broker: Recorder
    store: JobStore
    folder: Path
    job_id: str


def run_job(tmp_path: Path, persist: bool,
            scenario: Callable[[Running], Coroutine[Any, Any, None]]) -> None:
    """Start a private Redis and a job on it, run `scenario`, then stop them all."""
    redis = PrivateRedis(tmp_path / "redis", persist=persist)
    redis.start()

    async def main() -> None:
        driver, broker, store, folder, job_id = await started_job(redis, tmp_path)
        try:
            await scenario(Running(redis, driver, broker, store, folder, job_id))
        finally:
            await driver.close()
            await store.close()

    try:
        asyncio.run(main())
    finally:
        redis.stop()


def test_a_job_gone_with_redis_is_revoked_and_its_files_deleted_when_redis_returns(tmp_path):
    async def scenario(job: Running) -> None:
        driver, broker, store, folder, job_id = (job.driver, job.broker, job.store,
                                                 job.folder, job.job_id)
        job.redis.kill()
        # Its driver stops for want of Redis (a pause, as for any outage) and keeps
        # the job in memory; nothing is revoked while Redis cannot say it is gone.
        await until(lambda: job_id in driver._orphans, "the driver to pause")
        assert broker.cancelled == [] and folder.exists()
        job.redis.start()  # empty: the job, its lease and its counts are gone
        await until(lambda: not folder.exists(), "the job's files to be deleted")
        assert broker.cancelled == [part_id(job_id, i) for i in range(IN_FLIGHT)]
        assert broker.published == broker.cancelled  # nothing published after
        assert not driver._orphans and job_id not in driver._driving
        assert await store.redis.keys(f"{store.prefix}:*") == []  # never written again

    run_job(tmp_path, False, scenario)


def test_a_job_redis_kept_over_its_restart_is_driven_again_not_deleted(tmp_path):
    async def scenario(job: Running) -> None:
        driver, job_id = job.driver, job.job_id
        job.redis.kill()
        await until(lambda: job_id in driver._orphans, "the driver to pause")
        job.redis.start()  # with the job (appendonly)
        # Taken back once the lease it could not release lapses (SHOAL_JOB_LEASE_S).
        await until(lambda: job_id in driver._driving and not driver._orphans,
                    "the job to be driven again")
        stored = await job.store.get(job_id)
        assert stored is not None and stored.state == "running" \
            and stored.published == IN_FLIGHT
        assert job.broker.cancelled == [] and job.folder.exists()

    run_job(tmp_path, True, scenario)
