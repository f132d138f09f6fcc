"""Jobs without a broker: input checking and part cutting, reading parts from a resume
point, part results and gathering, and job state in Redis (the real local server, under
a prefix of the test's own)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import uuid
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest

from gateway.jobs.bulk_files import (
    JSONL,
    NPY,
    PART_MAX_BYTES,
    InputCheck,
    PartReader,
    encode_part,
    gather,
    part_items,
    part_key,
)
from gateway.jobs.part_replies import parse_part_id, part_id
from gateway.jobs.store import (
    CANCELLED,
    FAILED,
    RUNNING,
    SUCCEEDED,
    Job,
    JobStore,
    view,
    warn_if_jobs_are_volatile,
)
from tasks.blobs import BlobStore
from tasks.errors import ShoalError, invalid
from tests.stack import free_port


def no_check(items: list[Any]) -> None:
    for item in items:
        if set(item) != {"text"} or not isinstance(item["text"], str):
            raise invalid("items[0] must be {\"text\": str}")


def checked(data: bytes, per_part: int = 3, chunk: int = 7) -> InputCheck:
    check = InputCheck(no_check, 50, per_part)
    for i in range(0, len(data), chunk):  # chunks that cut lines anywhere
        check.feed(data[i:i + chunk])
    check.close()
    return check


def lines(texts: list[str]) -> bytes:
    return b"".join(json.dumps({"text": t}).encode() + b"\n" for t in texts)


# --- part size -------------------------------------------------------------------------------

def test_part_items_is_eight_batches_within_bounds_unless_configured():
    assert part_items(0, 64) == 512
    assert part_items(0, 8) == 256
    assert part_items(0, 4096) == 4096
    assert part_items(100, 64) == 100


# --- input check ---------------------------------------------------------------------------

def test_input_check_counts_items_and_parts_across_chunk_boundaries():
    data = lines([f"t{i}" for i in range(10)]) + b'\n"bare string"\r\n\n' + lines(["last"])
    check = checked(data.rstrip(b"\n"))  # no newline after the last line is fine
    assert check.items == 12 and check.parts == 4 and check.lines == 14


@pytest.mark.parametrize("bad, status, words", [
    (b"not json", 400, ["line 3", "not JSON"]),
    (b"[1, 2]", 422, ["line 3", "JSON list"]),
    (b'{"txt": "x"}', 422, ["line 3", "items[0]"]),
    (json.dumps({"text": "x" * 51}).encode(), 413, ["line 3", "51 characters"]),
])
def test_input_check_names_the_bad_line(bad, status, words):
    with pytest.raises(ShoalError) as caught:
        checked(lines(["a", "b"]) + bad + b"\n" + lines(["c"]))
    assert caught.value.status == status
    assert all(w in caught.value.message for w in words), caught.value.message


def test_an_empty_input_is_refused():
    with pytest.raises(ShoalError, match="no items"):
        checked(b"\n \n")


def test_a_part_ends_at_its_byte_cap():
    long = "x" * 40
    count = PART_MAX_BYTES // 50 + 10
    check = InputCheck(lambda items: None, 100, 10**6)
    check.feed(lines([long] * count))
    check.close()
    assert check.parts == 2


# --- reading parts -------------------------------------------------------------------------

def test_part_reader_cuts_as_the_check_did_and_resumes_from_an_offset():
    texts = [f"text {i}" for i in range(11)]
    data = lines(texts[:5]) + b"\n" + lines(texts[5:])
    check = checked(data, per_part=4)
    reader = PartReader(io.BytesIO(data), 0, 4)
    parts, offsets = [], []
    while part := reader.next_part():
        parts.append([i["text"] for i in part])
        offsets.append(reader.offset)
    assert len(parts) == check.parts == 3
    assert [t for p in parts for t in p] == texts
    resumed = PartReader(io.BytesIO(data), offsets[0], 4)
    assert [i["text"] for i in resumed.next_part()] == parts[1]


# --- part results and gathering --------------------------------------------------------------

def dense(rows: np.ndarray) -> dict[str, Any]:
    return {"output": "dense", "dims": rows.shape[1], "count": rows.shape[0],
            "dtype": "float32", "embeddings": rows.astype("<f4").tobytes()}


def test_dense_parts_gather_into_one_npy_in_order(tmp_path):
    store = BlobStore(str(tmp_path))
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((n, 8)).astype(np.float32) for n in (3, 5, 2)]
    metas = []
    # Written out of order, as results arrive.
    for index in (2, 0, 1):
        kind, data, items, dims = encode_part("encode", dense(parts[index]))
        assert (kind, items, dims) == (NPY, len(parts[index]), 8)
        store.put(part_key("jobs/1-x", index), data)
    metas = [{"kind": NPY, "items": len(p), "dims": 8} for p in parts]
    key, kind = gather(store, "jobs/1-x", metas)
    assert (key, kind) == ("jobs/1-x/result.npy", NPY)
    got = np.load(io.BytesIO(store.get(key)))
    np.testing.assert_array_equal(got, np.concatenate(parts))
    assert not store.exists("jobs/1-x/parts")


def test_gather_reads_the_copy_counted_not_a_late_one(tmp_path):
    # A part published twice (a takeover) is answered twice; each answer has its own file
    # and the meta names the one counted, so the late copy cannot rewrite it midway.
    store = BlobStore(str(tmp_path))
    counted = np.ones((2, 4), dtype=np.float32)
    late = np.full((3, 4), 7, dtype=np.float32)  # not even the same size
    store.put(part_key("jobs/1-z", 0, "a1"), counted.tobytes())
    store.put(part_key("jobs/1-z", 0, "b2"), late.tobytes())
    assert part_key("jobs/1-z", 0, "a1") != part_key("jobs/1-z", 0, "b2")
    metas = [{"kind": NPY, "items": 2, "dims": 4, "file": part_key("jobs/1-z", 0, "a1")}]
    key, _ = gather(store, "jobs/1-z", metas)
    np.testing.assert_array_equal(np.load(io.BytesIO(store.get(key))), counted)
    assert not store.exists("jobs/1-z/parts")


def test_other_results_gather_into_jsonl_one_line_per_item(tmp_path):
    store = BlobStore(str(tmp_path))
    results = [{"scores": [0.5, 0.25]}, {"scores": [0.125]}]
    for index, result in enumerate(results):
        kind, data, items, _ = encode_part("score", result)
        assert kind == JSONL and items == len(result["scores"])
        store.put(part_key("jobs/1-y", index), data)
    key, kind = gather(store, "jobs/1-y", [{"kind": JSONL, "items": 2, "dims": 0},
                                           {"kind": JSONL, "items": 1, "dims": 0}])
    assert kind == JSONL
    assert [json.loads(x) for x in store.get(key).splitlines()] == \
        [{"score": 0.5}, {"score": 0.25}, {"score": 0.125}]
    sparse = encode_part("encode", {"output": "sparse", "embeddings": [{"indices": [1],
                                                                        "values": [0.5]}]})
    assert sparse[0] == JSONL and json.loads(sparse[1]) == \
        {"embedding": {"indices": [1], "values": [0.5]}}


def test_part_ids_are_deterministic_and_parse_back():
    assert part_id("abc", 7) == "abc.7" and parse_part_id("abc.7") == ("abc", 7)
    assert parse_part_id("a-plain-celery-uuid") is None


# --- state in Redis ------------------------------------------------------------------------

@pytest.fixture
def store() -> Iterator[JobStore]:
    prefix = f"shoal-unit-{uuid.uuid4().hex[:8]}"
    store = JobStore("redis://127.0.0.1:6379/0", prefix, ttl_s=60)
    asyncio.run(_ping(store))  # Redis is required (`make test` starts it): no Redis fails
    yield store

    async def clean() -> None:
        keys = [k async for k in store.redis.scan_iter(f"{prefix}:*")]
        if keys:
            await store.redis.delete(*keys)
        await store.close()

    asyncio.run(clean())


async def _ping(store: JobStore) -> None:
    await store.redis.ping()
    await store.close()
    store._redis = None  # a new loop per asyncio.run: a new client


def run(store: JobStore, coro: Any) -> Any:
    async def main() -> Any:
        try:
            return await coro
        finally:
            await store.close()
            store._redis = None

    return asyncio.run(main())


def test_a_vanished_or_finished_job_is_never_written_again(store):
    async def scenario() -> None:
        job = Job(id="gone", operation="encode", model="m", bulk=True, parts_total=3)
        await store.create(job)
        await store.redis.delete(store.key("gone"))  # lost with a Redis restart
        assert not await store.mark_running("gone")
        assert not await store.published("gone", 1, 10, 0, 2)
        assert not await store.redis.exists(store.key("gone"))
        assert not await store.redis.exists(store.ranges_key("gone"))
        done = Job(id="done", operation="encode", model="m", bulk=True, parts_total=3)
        await store.create(done)
        assert await store.mark_running("done")
        assert await store.finish("done", CANCELLED)
        assert not await store.published("done", 1, 10, 0, 2)
        assert (await store.get("done")).published == 0

    run(store, scenario())


def test_a_redis_that_keeps_nothing_over_a_restart_is_warned_of(store, caplog):
    import redis

    client = redis.Redis.from_url(store.redis_url)
    expected = (["aof"] if client.config_get("appendonly")["appendonly"] == "yes" else []) + \
        (["rdb"] if client.config_get("save")["save"].strip() else [])
    client.close()
    with caplog.at_level(logging.WARNING, logger="gateway.jobs.store"):
        kept = run(store, warn_if_jobs_are_volatile(store))
    assert kept == expected  # what this machine's Redis is set to
    warned = [r for r in caplog.records if "keeps nothing over a restart" in r.getMessage()]
    assert bool(warned) == (not expected)
    away = JobStore(f"redis://127.0.0.1:{free_port()}/0", store.prefix, ttl_s=60)
    assert run(away, warn_if_jobs_are_volatile(away)) is None  # cannot tell: no warning


def test_a_part_counts_once_and_a_job_finishes_once(store):
    async def scenario() -> None:
        job = Job(id="j1", operation="encode", model="m", bulk=True, parts_total=2,
                  items_total=5, options={"dimensions": 4})
        await store.create(job)
        assert await store.active_ids() == ["j1"]
        await store.mark_running("j1")
        started = (await store.get("j1")).started_at
        await store.mark_running("j1")  # a takeover keeps the first start
        assert (await store.get("j1")).started_at == started
        meta = msgpack.packb({"kind": NPY, "items": 3, "dims": 4})
        assert await store.record("j1", 0, meta, 3) == 1
        assert await store.record("j1", 0, meta, 3) == -2  # a duplicate: not counted
        await store.published("j1", 2, 100, 3, 2)
        assert await store.part_range("j1", 1) == ("4", "5")
        assert await store.record("j1", 1, meta, 2) == 2
        got = await store.get("j1")
        assert (got.state, got.parts_done, got.items_done, got.published, got.offset) == \
            (RUNNING, 2, 5, 2, 100)
        assert got.options == {"dimensions": 4}
        assert await store.finish("j1", SUCCEEDED, result_file="k", result_type=NPY)
        assert not await store.finish("j1", CANCELLED)  # final stays final
        assert await store.record("j1", 1, meta, 2) == -1  # late results of a final job
        done = await store.get("j1")
        assert done.state == SUCCEEDED and done.finished_at >= done.started_at
        assert await store.active_ids() == []
        assert 0 < await store.redis.ttl(store.key("j1")) <= 60
        shown = view(done)
        assert shown["result_url"] == "/v1/jobs/j1/result" and shown["progress"]["items_done"] == 5

    run(store, scenario())


def test_a_failed_job_shows_its_error_and_takes_no_more_parts(store):
    async def scenario() -> None:
        await store.create(Job(id="j2", operation="encode", model="m", parts_total=1))
        assert await store.finish("j2", FAILED, error={"code": "X", "message": "part 0"})
        shown = view(await store.get("j2"))
        assert shown["state"] == FAILED and shown["error"] == {"code": "X", "message": "part 0"}
        assert "result" not in shown and "result_url" not in shown
        assert await store.record("j2", 0, b"x", 1) == -1

    run(store, scenario())


def test_leases_are_exclusive_renewed_by_their_owner_only(store):
    async def scenario() -> None:
        assert await store.acquire("j3", "a", 5)
        assert not await store.acquire("j3", "b", 5)
        assert await store.renew("j3", "a", 5)
        assert not await store.renew("j3", "b", 5)
        await store.release("j3", "b")  # not b's to release
        assert not await store.acquire("j3", "b", 5)
        await store.release("j3", "a")
        assert await store.acquire("j3", "b", 5)

    run(store, scenario())


def test_only_an_absent_service_is_worth_another_try():
    import redis.exceptions

    from gateway.jobs.store import transient

    assert transient(redis.exceptions.ConnectionError()) and transient(ConnectionError())
    assert transient(redis.exceptions.TimeoutError())
    assert transient(ShoalError("QUEUE_FULL", "full"))
    assert not transient(KeyError("embeddings")) and not transient(ShoalError("INTERNAL", "x"))
