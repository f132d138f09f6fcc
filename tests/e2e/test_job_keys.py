"""API keys' jobs end to end (issue 53): the per-key limits (429 TOO_MANY_JOBS with
Retry-After on /v1/jobs and /v1/batches, another key unaffected), the fair share (one
key's many jobs do not hold back another key's one job), and a cancelled job's folder
removed at once.

A private stack with one MiniLM worker of its own and a gateway with a keys file of two
keys, A and B; parts of 16 texts, 2 in flight.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.auth.key_file import hash_key, new_key
from tests.conftest import MINILM
from tests.stack import (
    PrivateStack,
    Process,
    free_port,
    http_status,
    private_stack,
    start_metered_worker,
    wait_for,
)

pytestmark = pytest.mark.e2e
TIMEOUT = 300
PER_PART, IN_FLIGHT, JOBS_PER_KEY, TEXTS_PER_KEY = 16, 2, 4, 2_000


class Keys:
    def __init__(self, url: str, a: str, b: str) -> None:
        self.url, self.a, self.b = url, a, b


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Iterator[Keys]:
    folder = tmp_path_factory.mktemp("job-keys")
    a, b = new_key(), new_key()
    keys_file = folder / "keys.yaml"
    keys_file.write_text(yaml.safe_dump({"keys": [{"name": "A", "hash": hash_key(a)},
                                                  {"name": "B", "hash": hash_key(b)}]}))
    with private_stack(folder, "job-keys", MINILM) as private:
        start_metered_worker(private.stack, "job-keys", MINILM, private.queue, 180,
                             SHOAL_QUEUE_PREFIX=private.prefix)
        gateway, url = start_gateway(private, SHOAL_API_KEYS_FILE=str(keys_file))
        try:
            yield Keys(url, a, b)
        finally:
            gateway.stop()
            forget(private.prefix)


def start_gateway(private: PrivateStack, **env: str) -> tuple[Process, str]:
    port = free_port()
    process = private.stack.gateway(
        "gw-keys", port, [MINILM], SHOAL_QUEUE_PREFIX=private.prefix, SHOAL_JOB_LEASE_S="2",
        SHOAL_JOB_PART_ITEMS=str(PER_PART), SHOAL_JOB_PARTS_IN_FLIGHT=str(IN_FLIGHT),
        SHOAL_JOBS_PER_KEY=str(JOBS_PER_KEY), SHOAL_JOB_TEXTS_PER_KEY=str(TEXTS_PER_KEY),
        **env)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: http_status(f"{url}/readyz") == 200, 60, "the gateway to be ready",
             give_up=lambda: None if process.alive() else "the gateway exited")
    return process, url


def forget(prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(os.environ.get("SHOAL_REDIS_URL", "redis://127.0.0.1:6379/0"))
    found = list(client.scan_iter(f"{prefix}:*"))
    if found:
        client.delete(*found)
    client.close()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def jsonl(count: int, words: int = 6) -> bytes:
    return b"".join(json.dumps({"text": " ".join(f"w{(i * 7 + j) % 997}" for j in range(words))
                                + f" #{i}"}).encode() + b"\n" for i in range(count))


def post_job(url: str, key: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{url}/v1/jobs", params={"operation": "encode", "model": MINILM},
                      content=body, headers={"content-type": "application/x-ndjson",
                                             **auth(key)}, timeout=120)


def view(url: str, key: str, job_id: str) -> dict:
    r = httpx.get(f"{url}/v1/jobs/{job_id}", headers=auth(key), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def cancel(url: str, key: str, ids: list[str]) -> None:
    for job_id in ids:
        r = httpx.delete(f"{url}/v1/jobs/{job_id}", headers=auth(key), timeout=30)
        assert r.status_code == 200, r.text


def wait_all_final(url: str, key: str, ids: list[str]) -> None:
    for job_id in ids:
        wait_for(lambda j=job_id: view(url, key, j)["state"] not in ("queued", "running"),
                 TIMEOUT, f"job {job_id} to end")


def job_folder(job_id: str) -> Path | None:
    found = list(Path(os.environ["SHOAL_BLOB_URL"]).glob(f"jobs/*-{job_id}"))
    return found[0] if found else None


def test_a_key_past_its_limits_gets_429_with_retry_after_and_another_key_does_not(keys):
    slow = jsonl(400, words=120)  # 25 parts of long texts: still running when the test ends
    ids = []
    try:
        for _ in range(JOBS_PER_KEY):
            r = post_job(keys.url, keys.a, slow)
            assert r.status_code == 202, r.text
            ids.append(r.json()["id"])
        refused = post_job(keys.url, keys.a, slow)
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["code"] == "TOO_MANY_JOBS"
        assert f"'A' has {JOBS_PER_KEY} jobs queued or running" in error["message"]
        assert "DELETE /v1/jobs/{id}" in error["message"]
        assert int(refused.headers["retry-after"]) >= 1
        inline = httpx.post(f"{keys.url}/v1/jobs", headers=auth(keys.a), timeout=60, json={
            "operation": "encode", "model": MINILM, "items": [{"text": "one more"}]})
        assert inline.status_code == 429, inline.text
        # OpenAI's Batch API: the same limit, in OpenAI's error envelope.
        line = {"custom_id": "x", "method": "POST", "url": "/v1/embeddings",
                "body": {"model": MINILM, "input": "batch line"}}
        uploaded = httpx.post(f"{keys.url}/v1/files", headers=auth(keys.a), timeout=60,
                              data={"purpose": "batch"},
                              files={"file": ("b.jsonl", json.dumps(line).encode(),
                                              "application/jsonl")})
        assert uploaded.status_code == 200, uploaded.text
        batch = httpx.post(f"{keys.url}/v1/batches", headers=auth(keys.a), timeout=60, json={
            "input_file_id": uploaded.json()["id"], "endpoint": "/v1/embeddings",
            "completion_window": "24h"})
        assert batch.status_code == 429, batch.text
        assert batch.json()["error"]["type"] == "requests"
        assert batch.json()["error"]["code"] == "TOO_MANY_JOBS"
        assert "POST /v1/batches/{id}/cancel" in batch.json()["error"]["message"]
        assert int(batch.headers["retry-after"]) >= 1
        listed = httpx.get(f"{keys.url}/v1/batches", headers=auth(keys.a), timeout=30)
        assert listed.json()["data"] == []  # the refused batch left no record
        # Key B has its own count: accepted, and over its queued texts a 429 too.
        r = post_job(keys.url, keys.b, jsonl(TEXTS_PER_KEY - 100))
        assert r.status_code == 202, r.text
        ids_b = [r.json()["id"]]
        over = post_job(keys.url, keys.b, jsonl(200))
        assert over.status_code == 429 and "items queued" in over.json()["error"]["message"]
        alone_too_big = post_job(keys.url, keys.a, jsonl(TEXTS_PER_KEY + 1))
        assert alone_too_big.status_code in (413, 429)  # 429 while A is at its jobs limit
        cancel(keys.url, keys.b, ids_b)
        cancel(keys.url, keys.a, ids[:1])  # a place free again
        r = post_job(keys.url, keys.a, jsonl(10))
        assert r.status_code == 202, r.text
        ids.append(r.json()["id"])
    finally:
        cancel(keys.url, keys.a, ids)
        wait_all_final(keys.url, keys.a, ids)


def test_one_keys_many_jobs_do_not_hold_back_another_keys_job(keys):
    """Fair share: A's 4 jobs and B's one job, all of the same size. Each key has at most
    IN_FLIGHT parts out, so B's job is done when A has done about one job's worth (without
    the fair share every job had IN_FLIGHT parts out, A's posted first: B ends last)."""
    texts = PER_PART * 6
    body = jsonl(texts, words=40)
    a_ids = []
    for _ in range(JOBS_PER_KEY):
        r = post_job(keys.url, keys.a, body)
        assert r.status_code == 202, r.text
        a_ids.append(r.json()["id"])
    r = post_job(keys.url, keys.b, body)
    assert r.status_code == 202, r.text
    b_id = r.json()["id"]
    seen: dict[str, int] = {}

    def b_done() -> bool:
        state = view(keys.url, keys.b, b_id)["state"]
        seen["a"] = sum(view(keys.url, keys.a, i)["progress"]["items_done"] for i in a_ids)
        return state == "succeeded"

    try:
        wait_for(b_done, TIMEOUT, "B's job to succeed")
        # A had done at most two of its four jobs' worth when B's one job was done.
        assert seen["a"] <= 2 * texts, (seen, texts)
    finally:
        cancel(keys.url, keys.a, a_ids)
        wait_all_final(keys.url, keys.a, a_ids)


def test_a_cancelled_jobs_folder_is_removed_at_once(keys):
    r = post_job(keys.url, keys.b, jsonl(400, words=120))
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    folder = job_folder(job_id)
    assert folder is not None and (folder / "input.jsonl").exists()
    wait_for(lambda: view(keys.url, keys.b, job_id)["progress"]["parts_published"] >= 1,
             TIMEOUT, "a part out")
    cancel(keys.url, keys.b, [job_id])
    # Not left to the hourly sweep (which spares folders younger than an hour).
    wait_for(lambda: job_folder(job_id) is None, 30, "the cancelled job's folder to go")
    assert view(keys.url, keys.b, job_id)["state"] == "cancelled"
