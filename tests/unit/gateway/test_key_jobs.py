"""An API key's jobs together (gateway.jobs.key_jobs): its limits on jobs at once and on
queued items, refused with 429 TOO_MANY_JOBS and a Retry-After from its jobs' rates, and
the parts it has out on a model over all its jobs (its fair share). The real local Redis,
under a prefix of the test's own."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.jobs import part_publisher
from gateway.jobs.driver import JobDriver
from gateway.jobs.key_jobs import RETRY_UNKNOWN_S, KeyJobs, Limits
from gateway.jobs.store import CANCELLED, Job, JobStore
from tasks.blobs import JOBS, BlobStore
from tasks.catalog import ModelEntry, Source
from tasks.errors import ShoalError
from tasks.settings import Settings
from tests.unit.gateway.test_job_driver_redis_loss import Recorder, until

HINT = "cancel one"


@pytest.fixture
def keys() -> Iterator[KeyJobs]:
    store = JobStore("redis://127.0.0.1:6379/0", f"shoal-unit-{uuid.uuid4().hex[:8]}", 60)
    yield KeyJobs(store)

    async def clean() -> None:
        found = [k async for k in store.redis.scan_iter(f"{store.prefix}:*")]
        if found:
            await store.redis.delete(*found)
        await store.close()

    store._redis = None
    asyncio.run(clean())


def run(keys: KeyJobs, coro: Any) -> Any:
    async def main() -> Any:
        try:
            return await coro
        finally:
            await keys.store.close()
            keys.store._redis = None  # a new loop per asyncio.run: a new client
            keys._scripts = None

    return asyncio.run(main())


def job(owner: str | None, items: int, model: str = "m", **fields: Any) -> Job:
    return Job(id=uuid.uuid4().hex, operation="encode", model=model, bulk=True,
               parts_total=items, items_total=items, owner=owner, **fields)


async def two_part_job(store: JobStore, blobs: BlobStore) -> str:
    """A bulk job of key "a" on model "m": 4 texts in 2 parts, created in Redis."""
    made = job("a", 4, part_items=2)
    made.parts_total, made.folder = 2, BlobStore.new_key(JOBS, made.id)
    made.input = f"{made.folder}/input.jsonl"
    blobs.put(made.input, b"".join(json.dumps({"text": f"t{i}"}).encode() + b"\n"
                                   for i in range(4)))
    await store.create(made)
    return made.id


def one_place_driver(store: JobStore, broker: Recorder, tmp_path: Any
                     ) -> tuple[JobDriver, BlobStore]:
    """A job driver of model "m" with one place in flight per key
    (SHOAL_JOB_PARTS_IN_FLIGHT=1), publishing to `broker`, and its blob store."""
    settings = Settings(queue_prefix=store.prefix, job_parts_in_flight=1, job_lease_s=60,
                        blob_url=str(tmp_path / "blobs"))
    blobs = BlobStore(settings.blob_url)
    entry = ModelEntry(id="m", adapter="dense", source=Source(path="/nowhere"), dims=4)
    return JobDriver(settings, store, broker, {"m": entry}, lambda: blobs), blobs


async def refusal(coro: Any) -> ShoalError:
    with pytest.raises(ShoalError) as caught:
        await coro
    return caught.value


def test_a_key_gets_its_jobs_limit_and_then_a_429_while_another_key_does_not(keys):
    limits = Limits(jobs=2, texts=0, owner="a", who="the API key 'a'")

    async def scenario() -> None:
        first = job("a", 10)
        await keys.create(first, limits, HINT)
        await keys.create(job("a", 10), limits, HINT)
        await keys.check(Limits(2, 0, "b", "b"), HINT)  # another key: its own count
        error = await refusal(keys.create(job("a", 10), limits, HINT))
        assert (error.code, error.status) == ("TOO_MANY_JOBS", 429)
        assert "'a' has 2 jobs queued or running" in error.message and HINT in error.message
        assert "SHOAL_JOBS_PER_KEY" in error.message
        assert error.retry_after == RETRY_UNKNOWN_S  # no job has a rate yet
        assert (await refusal(keys.check(limits, HINT))).code == "TOO_MANY_JOBS"
        # A job that ends makes room (it leaves the key's set as it is met).
        assert await keys.store.finish(first.id, CANCELLED)
        await keys.create(job("a", 10), limits, HINT)
        assert await keys.store.redis.scard(keys.store.owner_key("a")) == 2

    run(keys, scenario())


def test_queued_items_are_limited_and_a_job_over_the_whole_limit_is_a_413(keys):
    limits = Limits(jobs=0, texts=100, owner=None, who="all callers together")

    async def scenario() -> None:
        running = job(None, 60, started_at=time.time() - 10, items_done=20)  # 2 items/s
        await keys.create(running, limits, HINT)  # 40 left
        await keys.create(job(None, 50), limits, HINT)  # 90 queued now
        error = await refusal(keys.create(job(None, 20), limits, HINT))
        assert error.status == 429 and "90 items queued" in error.message
        assert getattr(error, "openai_type", None) == "tokens"
        # 10 items over: 5 s at the 2 items/s the key's running job goes at.
        assert 4 <= error.retry_after <= 6
        await keys.create(job(None, 10), limits, HINT)  # fits exactly
        too_big = await refusal(keys.create(job(None, 101), limits, HINT))
        assert too_big.status == 413 and "split it" in too_big.message

    run(keys, scenario())


def test_two_gateways_cannot_both_take_a_keys_last_place(keys):
    limits = Limits(jobs=3, texts=0, owner="a", who="a")

    async def scenario() -> None:
        results = await asyncio.gather(*(keys.create(job("a", 1), limits, HINT)
                                         for _ in range(8)), return_exceptions=True)
        assert sum(r is None for r in results) == 3
        assert all(isinstance(r, ShoalError) for r in results if r is not None)

    run(keys, scenario())


def test_parts_in_flight_count_a_keys_jobs_on_one_model_only(keys):
    async def scenario() -> None:
        store = keys.store
        for owner, model, published, done, batch in [
                ("a", "m", 5, 2, ""), ("a", "m", 8, 8, ""), ("a", "m", 64, 0, "batch_1"),
                ("a", "other", 4, 0, ""), ("b", "m", 7, 0, "")]:
            await store.create(job(owner, 100, model, published=published, parts_done=done,
                                   batch=batch))
        # 3 + 0 + 64 lines as 2 parts of 32; not the other model's nor the other key's.
        assert await keys.in_flight("a", "m", 32) == 5
        assert await keys.in_flight("b", "m", 32) == 7
        assert await keys.in_flight(None, "m", 32) == 0

    run(keys, scenario())


def test_limits_come_from_the_settings_unless_the_key_sets_its_own():
    from gateway.auth.key_file import ApiKey, hash_key, new_key, parse_key_file

    settings = Settings(jobs_per_key=4, job_texts_per_key=1000)
    off = Limits.of(settings, None)
    assert (off.jobs, off.texts, off.owner) == (4, 1000, None)
    entries = parse_key_file(f"""keys:
  - {{name: plain, hash: "{hash_key(new_key())}"}}
  - {{name: own, hash: "{hash_key(new_key())}", concurrent_jobs: 0, queued_job_texts: 50}}
""", "keys.yaml").keys
    plain, own = (Limits.of(settings, ApiKey.from_entry(e)) for e in entries)
    assert (plain.jobs, plain.texts, plain.owner) == (4, 1000, "plain")
    assert (own.jobs, own.texts, own.owner) == (0, 50, "own")  # 0: no limit on jobs


def test_a_place_of_the_keys_share_freed_by_one_job_wakes_the_keys_other_jobs(
        keys, tmp_path, monkeypatch):
    """Two jobs of one key, one place (SHOAL_JOB_PARTS_IN_FLIGHT=1): the second waits.
    When the first's part is recorded here, the second is woken at once, not at its next
    poll (made an hour long here, so that only the wake-up can move it)."""
    monkeypatch.setattr(part_publisher, "POLL_S", 3600.0)
    store = keys.store

    async def scenario() -> None:
        broker = Recorder()
        driver, blobs = one_place_driver(store, broker, tmp_path)
        ids = [await two_part_job(store, blobs) for _ in range(2)]
        try:
            for job_id in ids:
                await driver.kick(job_id)
            await until(lambda: len(broker.published) == 1, "the key's one place taken")
            first = broker.published[0].partition(".")[0]
            second = next(i for i in ids if i != first)
            assert await store.finish(first, CANCELLED)  # its place is free
            driver.notify(first)  # as part_replies does when it records a part here
            await until(lambda: any(p.startswith(second) for p in broker.published),
                        "the key's other job to take the place")
        finally:
            await driver.close()

    run(keys, scenario())


def test_jobs_of_one_key_driven_together_take_its_last_place_once(keys, tmp_path, monkeypatch):
    """Six jobs of one key kicked at once with one place (SHOAL_JOB_PARTS_IN_FLIGHT=1):
    each checks the key's parts out and publishes; the check and the record of the
    publish are one step per key and model here, so exactly one part goes out and the
    other five wait (when each job checked Redis on its own, several saw the place free
    and published: 5 parts out in 1 of 3 runs here, and a CI run's wait for "one part
    out" in the test above timed out). Waited on: every job has gone to wait (its part
    out, or no place)."""
    monkeypatch.setattr(part_publisher, "POLL_S", 3600.0)
    waiting: set[str] = set()
    sleep = part_publisher.PartPublisher._sleep

    async def recorded_sleep(self: part_publisher.PartPublisher, job_id: str) -> None:
        waiting.add(job_id)
        await sleep(self, job_id)

    monkeypatch.setattr(part_publisher.PartPublisher, "_sleep", recorded_sleep)
    store = keys.store

    async def scenario() -> None:
        broker = Recorder()
        driver, blobs = one_place_driver(store, broker, tmp_path)
        ids = [await two_part_job(store, blobs) for _ in range(6)]
        try:
            await asyncio.gather(*(driver.kick(job_id) for job_id in ids))
            await until(lambda: waiting >= set(ids), "every job waiting")
            assert len(broker.published) == 1, broker.published
        finally:
            await driver.close()

    run(keys, scenario())
