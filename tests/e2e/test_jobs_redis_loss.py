"""A Redis killed in the middle of a bulk job and restarted empty (issue 41): the job is
gone (404), and so is everything of it. Its driver paused when Redis went away; when
Redis answers again it finds the job gone, revokes the parts it had out and deletes the
job's upload and part files at once, not an hour later by the sweep. No batch of the job
reaches the model after the revoke: the worker answers its parts CANCELLED, unrun, and so
does the runtime for the batch its pipeline prepared behind the one on the device; only
that one, computing when the revoke came, finishes, and its answer is dropped.

A private stack: one worker serving the faulty test model, whose `@@slow@@` texts hold a
batch in the model until the test releases it (tests/slow_batches.py), so that parts are
still running and queued when Redis goes; and a gateway whose Redis is a redis-server of
the test's own, killed and started again without persistence (tests/private_redis.py).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import FAULTY
from tests.private_redis import PrivateRedis
from tests.slow_batches import SlowBatches
from tests.stack import (
    BROKER_URL,
    MeteredWorker,
    Process,
    free_port,
    http_status,
    private_stack,
    queue_counts,
    start_metered_worker,
    wait_for,
)

pytestmark = pytest.mark.e2e
TEXTS, PER_PART, IN_FLIGHT = 3_000, 100, 8


def outcomes(worker: MeteredWorker) -> tuple[float, float]:
    """(ok, CANCELLED) answers of the worker so far (each job part is one request)."""
    ok = cancelled = 0.0
    for line in httpx.get(worker.metrics_url, timeout=10).text.splitlines():
        if line.startswith("shoal_results_total{"):
            if 'outcome="ok"' in line:
                ok += float(line.rsplit(" ", 1)[1])
            elif 'outcome="CANCELLED"' in line:
                cancelled += float(line.rsplit(" ", 1)[1])
    return ok, cancelled


def revoked_on(worker: MeteredWorker) -> set[str]:
    """The task ids the worker holds as revoked (Celery's `inspect revoked`)."""
    from tasks.celery_app import app

    app.conf.broker_url = BROKER_URL
    hostname = f"{worker.process.name}@{socket.gethostname()}"
    replies = app.control.inspect(destination=[hostname], timeout=5).revoked() or {}
    return set(replies.get(hostname, ()))


def test_a_job_lost_with_a_redis_restart_is_revoked_and_its_files_deleted_at_once(
        tmp_path: Path, slow_batches: SlowBatches) -> None:
    redis = PrivateRedis(tmp_path / "redis")
    redis.start()
    try:
        with private_stack(tmp_path, "jobs-redis", FAULTY) as private:
            worker = start_metered_worker(private.stack, "jobs-redis", FAULTY, private.queue,
                                          180, SHOAL_QUEUE_PREFIX=private.prefix,
                                          **slow_batches.env)
            port = free_port()
            gateway = private.stack.gateway(
                "gw-redis-loss", port, [FAULTY], SHOAL_QUEUE_PREFIX=private.prefix,
                SHOAL_REDIS_URL=redis.url, SHOAL_JOB_PART_ITEMS=str(PER_PART),
                SHOAL_JOB_PARTS_IN_FLIGHT=str(IN_FLIGHT))
            url = f"http://127.0.0.1:{port}"
            wait_for(lambda: http_status(f"{url}/readyz") == 200, 60, "the gateway",
                     give_up=lambda: None if gateway.alive() else "the gateway exited")

            # Every batch of the job sleeps in the model while the hold lasts: the first
            # runs (held), and the parts in flight wait, published, until Redis is gone.
            slow_batches.hold()
            ok_before, cancelled_before = outcomes(worker)
            body = b"".join(json.dumps({"text": f"@@slow@@ text {i} of the job"}).encode()
                            + b"\n" for i in range(TEXTS))
            r = httpx.post(f"{url}/v1/jobs", params={"operation": "encode", "model": FAULTY},
                           content=body, headers={"content-type": "application/x-ndjson"},
                           timeout=120)
            assert r.status_code == 202, r.text
            job_id = r.json()["id"]
            (folder,) = Path(os.environ["SHOAL_BLOB_URL"]).glob(f"jobs/*-{job_id}")
            upload = folder / "input.jsonl"
            assert upload.exists()
            slow_batches.wait_started(1)
            wait_for(lambda: httpx.get(f"{url}/v1/jobs/{job_id}", timeout=10).json()[
                "progress"]["parts_published"] == IN_FLIGHT, 60, "the parts in flight out")
            redis.kill()
            wait_for(lambda: httpx.get(f"{url}/v1/jobs/{job_id}", timeout=10).status_code
                     == 503, 30, "503 while Redis is away")
            # The driver stops for want of Redis, as for any outage (a pause)...
            wait_for(lambda: f"job {job_id} paused" in gateway.log(), 30,
                     "the driver to pause")
            redis.start()  # ...and Redis comes back empty: the job is gone
            back = time.monotonic()
            wait_for(lambda: httpx.get(f"{url}/v1/jobs/{job_id}", timeout=10).status_code
                     == 404, 30, "404 once Redis is back")
            answered_404 = time.monotonic() - back
            # Deleted at once (the sweep would take an hour: it spares younger folders).
            wait_for(lambda: not upload.exists(), 10, "the job's upload to be deleted")
            deleted = time.monotonic() - back
            parts = {f"{job_id}.{i}" for i in range(IN_FLIGHT)}
            wait_for(lambda: parts <= revoked_on(worker), 30, "the worker to hold the "
                     "job's parts as revoked")
            revoked = time.monotonic() - back
            # What the worker had handed to the model by then (the held batch, and the one
            # the runtime's pipeline prepared behind it): those batches, and their requests.
            handed = worker.metric("shoal_batch_requests_count")
            running = worker.metric("shoal_batch_requests_sum")
            print(f"after Redis came back: 404 within {answered_404:.2f} s, upload deleted "
                  f"within {deleted:.2f} s, parts revoked on the worker within "
                  f"{revoked:.2f} s")

            slow_batches.release()
            wait_for(lambda: sum(outcomes(worker)) - ok_before - cancelled_before
                     >= IN_FLIGHT, 60, "every part published answered")
            wait_for(lambda: queue_counts(private.queue)[0] == 0
                     and worker.metric("shoal_held_messages") == 0, 60, "the worker idle")
            ok, cancelled = outcomes(worker)
            ok, cancelled = ok - ok_before, cancelled - cancelled_before
            print(f"parts answered: {ok:g} ok, {cancelled:g} cancelled; batches computed: "
                  f"{slow_batches.started()} (handed to the model before the revoke: "
                  f"{handed:g}, with {running:g} requests)")
            # No batch reached the model once the worker had the revoke: only the one on the
            # device then was computed (one prepared behind it skips the device)...
            assert slow_batches.started() == 1 <= handed
            # ...and every part out was answered: those not in them CANCELLED, unrun (and a
            # part split into batches stops at its next one).
            assert ok + cancelled == IN_FLIGHT and ok <= running
            assert cancelled >= IN_FLIGHT - running >= 1
            # The held part's late answer was dropped: no part file, nothing of the job.
            assert not folder.exists()
            assert httpx.get(f"{url}/v1/jobs/{job_id}", timeout=10).status_code == 404
            import redis as redis_client

            client = redis_client.Redis.from_url(redis.url)
            try:
                assert list(client.scan_iter(f"{private.prefix}:job:{job_id}*")) == []
            finally:
                client.close()
    finally:
        redis.stop()


def test_a_job_paused_by_a_gateway_restarted_while_redis_was_away_is_still_stopped(
        tmp_path: Path, slow_batches: SlowBatches) -> None:
    """The same loss, but the gateway whose driver paused the job is killed while Redis is
    away and a new one started (issue 53): the new gateway finds the paused job in its
    folder (`paused.msgpack`), and once Redis answers, empty, revokes its parts and
    deletes its folder, as the first would have. Before, the job lived only in the first
    gateway's memory: its folder waited for the hourly sweep and its parts ran."""
    redis = PrivateRedis(tmp_path / "redis")
    redis.start()
    try:
        with private_stack(tmp_path, "jobs-restart", FAULTY) as private:
            worker = start_metered_worker(private.stack, "jobs-restart", FAULTY,
                                          private.queue, 180,
                                          SHOAL_QUEUE_PREFIX=private.prefix,
                                          **slow_batches.env)
            env = {"SHOAL_QUEUE_PREFIX": private.prefix, "SHOAL_REDIS_URL": redis.url,
                   "SHOAL_JOB_PART_ITEMS": str(PER_PART),
                   "SHOAL_JOB_PARTS_IN_FLIGHT": str(IN_FLIGHT), "SHOAL_JOB_LEASE_S": "3"}

            def start(name: str) -> tuple[Process, str]:
                port = free_port()
                gateway = private.stack.gateway(name, port, [FAULTY], **env)
                url = f"http://127.0.0.1:{port}"
                wait_for(lambda: http_status(f"{url}/readyz") == 200, 60, name,
                         give_up=lambda: None if gateway.alive() else f"{name} exited")
                return gateway, url

            first, url = start("gw-paused")
            slow_batches.hold()
            body = b"".join(json.dumps({"text": f"@@slow@@ text {i} of the job"}).encode()
                            + b"\n" for i in range(TEXTS))
            r = httpx.post(f"{url}/v1/jobs", params={"operation": "encode", "model": FAULTY},
                           content=body, headers={"content-type": "application/x-ndjson"},
                           timeout=120)
            assert r.status_code == 202, r.text
            job_id = r.json()["id"]
            (folder,) = Path(os.environ["SHOAL_BLOB_URL"]).glob(f"jobs/*-{job_id}")
            slow_batches.wait_started(1)
            wait_for(lambda: httpx.get(f"{url}/v1/jobs/{job_id}", timeout=10).json()[
                "progress"]["parts_published"] == IN_FLIGHT, 60, "the parts in flight out")
            redis.kill()
            wait_for(lambda: f"job {job_id} paused" in first.log(), 30, "the driver to pause")
            wait_for(lambda: (folder / "paused.msgpack").exists(), 30, "the pause recorded")
            first.kill()  # SIGKILL: nothing of the job is left in any gateway's memory
            first.reap(10)
            second, url = start("gw-heir")
            wait_for(lambda: f"job {job_id} was paused by a gateway before" in second.log(),
                     60, "the new gateway to find the paused job")
            redis.start()  # empty: the job is gone
            wait_for(lambda: not folder.exists(), 30, "the job's folder to be deleted")
            parts = {f"{job_id}.{i}" for i in range(IN_FLIGHT)}
            wait_for(lambda: parts <= revoked_on(worker), 30, "the worker to hold the "
                     "job's parts as revoked")
            assert httpx.get(f"{url}/v1/jobs/{job_id}", timeout=10).status_code == 404
            slow_batches.release()
            wait_for(lambda: queue_counts(private.queue)[0] == 0
                     and worker.metric("shoal_held_messages") == 0, 60, "the worker idle")
            # Only the batch on the device when Redis went was computed; the rest revoked.
            assert slow_batches.started() <= 2
            assert not folder.exists()
            second.stop()
    finally:
        redis.stop()
