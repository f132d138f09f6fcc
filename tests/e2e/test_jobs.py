"""Jobs end to end: POST /v1/jobs (inline and bulk), progress, results, cancel, a gateway
killed mid-job, bad input refused before anything is queued, and `shoal embed`.

A private stack (queue prefix, Redis keys, jobs' reply queue) with one MiniLM worker
of its own, whose Prometheus counters tell how many requests (parts) it ran; each
test starts the gateways it needs on that prefix.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import MINILM
from tests.stack import (
    REPO,
    MeteredWorker,
    PrivateStack,
    Process,
    delete_queues,
    free_port,
    http_status,
    private_stack,
    queue_counts,
    start_metered_worker,
    wait_for,
)

pytestmark = pytest.mark.e2e
TIMEOUT = 300


@pytest.fixture(scope="module")
def jobs_stack(tmp_path_factory) -> Iterator[tuple[PrivateStack, MeteredWorker]]:
    with private_stack(tmp_path_factory.mktemp("jobs"), "jobs", MINILM) as private:
        worker = start_metered_worker(private.stack, "jobs", MINILM, private.queue, 180,
                                      SHOAL_QUEUE_PREFIX=private.prefix)
        try:
            yield private, worker
        finally:
            delete_queues([f"{private.prefix}.jobs.replies"])
            forget_jobs(private.prefix)


def forget_jobs(prefix: str) -> None:
    """The Redis keys of this stack's jobs (finished ones would expire; running ones not)."""
    import redis

    client = redis.Redis.from_url(os.environ.get("SHOAL_REDIS_URL", "redis://127.0.0.1:6379/0"))
    keys = list(client.scan_iter(f"{prefix}:*"))
    if keys:
        client.delete(*keys)
    client.close()


def start_gateway(private: PrivateStack, name: str, **env: str) -> tuple[Process, str]:
    port = free_port()
    process = private.stack.gateway(name, port, [MINILM], SHOAL_QUEUE_PREFIX=private.prefix,
                                    SHOAL_JOB_LEASE_S="2", **env)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: http_status(f"{url}/readyz") == 200, 60, f"{name} to be ready",
             give_up=lambda: None if process.alive() else f"{name} exited")
    return process, url


@pytest.fixture
def gateway(jobs_stack, request) -> Iterator[str]:
    process, url = start_gateway(jobs_stack[0], f"gw-{request.node.name[:20]}")
    yield url
    process.stop()


def texts(n: int, words: int = 6) -> list[str]:
    return [" ".join(f"w{(i * 7 + j) % 997}" for j in range(words)) + f" #{i}" for i in range(n)]


def jsonl(items: list[str]) -> bytes:
    return b"".join(json.dumps({"text": t}).encode() + b"\n" for t in items)


def post_bulk(url: str, body: bytes, **params: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/jobs", params={"operation": "encode", "model": MINILM, **params},
                      content=body, headers={"content-type": "application/x-ndjson"},
                      timeout=120)


def job(url: str, job_id: str) -> dict:
    r = httpx.get(f"{url}/v1/jobs/{job_id}", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def wait_final(url: str, job_id: str, timeout: float = TIMEOUT) -> dict:
    return wait_for(lambda: (j := job(url, job_id))["state"] not in ("queued", "running")
                    and j, timeout, f"job {job_id} to finish")


def sync_vectors(url: str, items: list[str]) -> np.ndarray:
    r = httpx.post(f"{url}/v1/encode/{MINILM}", json={"items": [{"text": t} for t in items]},
                   timeout=120)
    assert r.status_code == 200, r.text
    return np.array(r.json()["embeddings"], dtype=np.float32)


def result_array(url: str, view: dict) -> np.ndarray:
    r = httpx.get(f"{url}{view['result_url']}", timeout=120)
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-npy"
    return np.load(io.BytesIO(r.content))


def results_ok(worker: MeteredWorker) -> float:
    """Requests the worker ran to a result (each job part is one)."""
    return sum(float(line.rsplit(" ", 1)[1])
               for line in httpx.get(worker.metrics_url, timeout=10).text.splitlines()
               if line.startswith("shoal_results_total{") and 'outcome="ok"' in line)


def idle(private: PrivateStack, worker: MeteredWorker) -> bool:
    return queue_counts(private.queue)[0] == 0 and worker.metric("shoal_held_messages") == 0


def start_slow_job(private: PrivateStack, worker: MeteredWorker, url: str
                   ) -> tuple[str, float]:
    """On an idle worker, a bulk job of 30 parts of long texts (slow enough to stop midway),
    once its first part is done: its id, and the worker's results before it."""
    wait_for(lambda: idle(private, worker), 60, "the worker to be idle")
    before = results_ok(worker)
    r = post_bulk(url, jsonl(texts(32 * 30, words=120)))
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    wait_for(lambda: job(url, job_id)["progress"]["parts_done"] >= 1, TIMEOUT,
             "a first part to be done")
    return job_id, before


# --- tests -----------------------------------------------------------------------------------

def test_inline_job_answers_202_and_its_result_equals_the_sync_routes(gateway):
    request = {"items": [{"text": "The cat sits on the mat."}, {"text": "Grüße 東京"}],
               "options": {"dimensions": 64}}
    r = httpx.post(f"{gateway}/v1/jobs", json={"operation": "encode", "model": MINILM,
                                               **request}, timeout=30)
    assert r.status_code == 202, r.text
    view = r.json()
    assert r.headers["location"] == f"/v1/jobs/{view['id']}"
    assert view["state"] in ("queued", "running") and view["progress"]["items_total"] == 2
    done = wait_final(gateway, view["id"])
    assert done["state"] == "succeeded", done
    assert done["progress"] == {"parts_done": 1, "parts_total": 1, "items_done": 2,
                                "items_total": 2, "parts_published": 1}
    assert done["created_at"] <= done["started_at"] <= done["finished_at"]
    sync = httpx.post(f"{gateway}/v1/encode/{MINILM}", json=request, timeout=30).json()
    result = done["result"]
    assert {k: result[k] for k in ("model", "output", "dims", "dtype")} == \
        {k: sync[k] for k in ("model", "output", "dims", "dtype")}
    np.testing.assert_allclose(result["embeddings"], sync["embeddings"], atol=1e-6)

    # Prefer: respond-async turns the sync route's request into a job.
    r = httpx.post(f"{gateway}/v1/encode/{MINILM}", json=request,
                   headers={"prefer": "respond-async"}, timeout=30)
    assert r.status_code == 202 and r.headers["location"].startswith("/v1/jobs/"), r.text
    done = wait_final(gateway, r.json()["id"])
    np.testing.assert_allclose(done["result"]["embeddings"], sync["embeddings"], atol=1e-6)

    missing = httpx.get(f"{gateway}/v1/jobs/nope", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "JOB_NOT_FOUND"


@pytest.mark.timeout(600)  # ~70-300 texts/s on this shared 2-core CPU
def test_bulk_job_of_5120_texts_equals_the_sync_api(gateway):
    # Ten parts are enough to join in order; 20,000 texts took two minutes of CI.
    items = texts(5_120, words=4)
    r = post_bulk(gateway, jsonl(items))
    assert r.status_code == 202, r.text
    view = r.json()
    assert view["progress"]["items_total"] == 5_120
    assert view["progress"]["parts_total"] == 10  # 512 per part: 8 batches of 64 (cpu profile)
    done = wait_final(gateway, view["id"], 500)
    assert done["state"] == "succeeded", done
    assert done["progress"]["items_done"] == 5_120
    vectors = result_array(gateway, done)
    assert vectors.shape == (5_120, 384) and vectors.dtype == np.float32
    sample = [0, 1, 511, 512, 513, 2_559, 2_560, 5_118, 5_119]
    reference = sync_vectors(gateway, [items[i] for i in sample])
    np.testing.assert_allclose(vectors[sample], reference, atol=1e-5)


def test_cancel_stops_the_parts_not_yet_run(jobs_stack):
    private, worker = jobs_stack
    # One part out at a time, each a few batches of long texts: slow enough to cancel midway.
    process, url = start_gateway(private, "gw-cancel", SHOAL_JOB_PART_ITEMS="32",
                                 SHOAL_JOB_PARTS_IN_FLIGHT="2")
    try:
        job_id, before = start_slow_job(private, worker, url)
        r = httpx.delete(f"{url}/v1/jobs/{job_id}", timeout=30)
        assert r.status_code == 200 and r.json()["state"] == "cancelled", r.text
        published = r.json()["progress"]["parts_published"]
        wait_for(lambda: idle(private, worker), 60, "the worker to finish what it holds")
        view = job(url, job_id)
        assert view["state"] == "cancelled"
        assert view["progress"]["parts_published"] <= published + 1  # one may have been mid-publish
        ran = results_ok(worker) - before
        # Parts published before the cancel ran or were revoked; none after it ran.
        assert 1 <= ran <= view["progress"]["parts_published"] < 30
        assert httpx.get(f"{url}/v1/jobs/{job_id}/result", timeout=10).status_code == 409
    finally:
        process.stop()


def test_a_job_whose_redis_record_vanishes_stops_and_deletes_its_files(jobs_stack):
    """Redis restarted without persistence loses a running job: its gateway stops
    publishing its parts, revokes those out, deletes its upload and never writes the
    record again (no state-less hash without a TTL)."""
    import redis

    private, worker = jobs_stack
    process, url = start_gateway(private, "gw-vanish", SHOAL_JOB_PART_ITEMS="32",
                                 SHOAL_JOB_PARTS_IN_FLIGHT="2")
    client = redis.Redis.from_url(os.environ.get("SHOAL_REDIS_URL",
                                                 "redis://127.0.0.1:6379/0"))
    try:
        job_id, before = start_slow_job(private, worker, url)
        uploads = list(Path(os.environ["SHOAL_BLOB_URL"]).glob(f"jobs/*-{job_id}/input.jsonl"))
        assert len(uploads) == 1
        # What a Redis restarted empty does to the job: every key of it gone at once.
        keys = list(client.scan_iter(f"{private.prefix}:job:{job_id}*"))
        with client.pipeline(transaction=True) as pipe:
            pipe.delete(*keys)
            pipe.srem(f"{private.prefix}:jobs:active", job_id)
            pipe.execute()
        wait_for(lambda: not uploads[0].exists(), 60, "the job's upload to be deleted")
        wait_for(lambda: idle(private, worker), 60, "the worker to finish what it holds")
        assert not client.exists(f"{private.prefix}:job:{job_id}")  # not written again
        assert httpx.get(f"{url}/v1/jobs/{job_id}", timeout=10).status_code == 404
        assert results_ok(worker) - before < 30  # the parts after it never ran
    finally:
        client.close()
        process.stop()


def test_a_job_refused_for_want_of_its_store_leaves_nothing_in_the_blob_store(jobs_stack):
    private, _ = jobs_stack
    nowhere = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    process, url = start_gateway(private, "gw-no-redis", SHOAL_REDIS_URL=nowhere)
    jobs_dir = Path(os.environ["SHOAL_BLOB_URL"]) / "jobs"
    try:
        before = set(jobs_dir.glob("*/*"))
        inline = httpx.post(f"{url}/v1/jobs", json={"operation": "encode", "model": MINILM,
                                                    "items": [{"text": "refused"}]},
                            timeout=60)
        upload = post_bulk(url, jsonl(["refused"] * 10))
        for r in (inline, upload):
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "JOB_STORE_UNAVAILABLE"
        assert set(jobs_dir.glob("*/*")) - before == set()
    finally:
        process.stop()


def test_a_gateway_killed_mid_job_loses_nothing(jobs_stack):
    private, _ = jobs_stack
    first, url = start_gateway(private, "gw-doomed", SHOAL_JOB_PART_ITEMS="100")
    items = texts(1_200, words=20)  # 12 parts: 9 or more still to do at the kill
    r = post_bulk(url, jsonl(items))
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    wait_for(lambda: job(url, job_id)["progress"]["parts_done"] >= 3, TIMEOUT,
             "some parts to be done")
    first.kill()  # SIGKILL: no lease released, replies unacked, a publish maybe half done
    first.reap(10)
    second, url = start_gateway(private, "gw-heir", SHOAL_JOB_PART_ITEMS="100")
    try:
        assert job(url, job_id)["state"] == "running"
        done = wait_final(url, job_id)
        assert done["state"] == "succeeded", done
        assert done["progress"]["items_done"] == 1_200 and done["progress"]["parts_done"] == 12
        vectors = result_array(url, done)
        assert vectors.shape == (1_200, 384)
        sample = [0, 99, 100, 101, 299, 600, 1_199]
        np.testing.assert_allclose(vectors[sample],
                                   sync_vectors(url, [items[i] for i in sample]), atol=1e-5)
    finally:
        second.stop()


def test_bad_input_is_refused_before_anything_is_queued(jobs_stack, gateway):
    private, worker = jobs_stack
    wait_for(lambda: idle(private, worker), 60, "the worker to be idle")
    before = results_ok(worker)
    folders = job_folders()
    ok = jsonl(["fine"] * 3)

    def refused(r: httpx.Response, status: int, code: str, *words: str) -> None:
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["code"] == code and all(w in error["message"] for w in words), error

    refused(post_bulk(gateway, ok + b"this is not json\n" + ok), 400, "INVALID_REQUEST",
            "line 4", "not JSON")
    refused(post_bulk(gateway, ok + b"[1, 2]\n"), 422, "VALIDATION_ERROR", "line 4")
    refused(post_bulk(gateway, ok + b'{"txt": "typo"}\n'), 422, "VALIDATION_ERROR", "line 4")
    refused(post_bulk(gateway, ok + jsonl(["x" * 100_001])), 413, "PAYLOAD_TOO_LARGE",
            "line 4", "100001 characters")
    refused(post_bulk(gateway, ok, model="no/such-model"), 404, "MODEL_NOT_FOUND")
    refused(post_bulk(gateway, ok, options='{"dimensions": 9999}'), 422, "VALIDATION_ERROR",
            "dimensions")
    refused(post_bulk(gateway, b"\n\n"), 422, "VALIDATION_ERROR", "no items")
    refused(httpx.post(f"{gateway}/v1/jobs", json={"operation": "encode", "model": MINILM,
                                                   "items": [{"text": "x" * 100_001}]}),
            413, "PAYLOAD_TOO_LARGE")
    refused(httpx.post(f"{gateway}/v1/jobs", json={"operation": "embed", "model": MINILM,
                                                   "items": []}), 422, "VALIDATION_ERROR")
    refused(httpx.post(f"{gateway}/v1/jobs", json={"operation": "encode", "model": MINILM,
                                                   "input": "jobs/none/input.jsonl"}),
            404, "NOT_FOUND")
    # Nothing reached the model's queue nor the worker, and no upload was left behind.
    assert queue_counts(private.queue)[0] == 0
    assert results_ok(worker) == before
    assert job_folders() == folders


def job_folders() -> set[str]:
    jobs = Path(os.environ["SHOAL_BLOB_URL"]) / "jobs"
    return {p.name for p in jobs.iterdir()} if jobs.exists() else set()


def test_shoal_embed_uploads_follows_and_downloads(gateway, tmp_path):
    items = texts(700)
    source = tmp_path / "input.jsonl"
    source.write_bytes(b"".join(json.dumps(t).encode() + b"\n" for t in items))  # bare strings
    out = tmp_path / "vectors.npy"
    run = subprocess.run([sys.executable, "-m", "app.cli", "embed", "--model", MINILM,
                          str(source), "-o", str(out), "--url", gateway],
                         cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT)
    assert run.returncode == 0, run.stderr
    assert "700 items" in run.stderr
    vectors = np.load(out)
    assert vectors.shape == (700, 384)
    sample = [0, 255, 256, 699]
    np.testing.assert_allclose(vectors[sample], sync_vectors(gateway, [items[i] for i in sample]),
                               atol=1e-5)
