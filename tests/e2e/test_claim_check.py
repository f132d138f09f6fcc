"""Large images through the claim check: HTTP -> blob store + RabbitMQ -> worker -> runtime.

A 10 MB image for the tiny CLIP model goes to the blob store, the broker carries
only its claim, and the worker fetches, checks and deletes it. Also: a worker
killed after fetching, a blob deleted or altered before the fetch, orphans swept
by the CLI and the gateway, and the same over s3 (moto's server).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import msgpack
import numpy as np
import pytest
import torch
from kombu import Connection
from PIL import Image

from tasks.blobs import CLAIMS, BlobStore
from tasks.claims import claim_of
from tasks.envelope import H_CLAIMS, decode_body
from tests.conftest import CLIP, MINILM, family_dir
from tests.stack import (
    BROKER_URL,
    REPO,
    MeteredWorker,
    PrivateStack,
    free_port,
    http_status,
    metric_sum,
    private_stack,
    queue_counts,
    start_metered_worker,
    wait_for,
)

pytestmark = pytest.mark.e2e
TEN_MB = 10 * 1024 * 1024
MSGPACK = {"content-type": "application/msgpack"}
# The module's private gateway sweeps often, but only blobs older than an hour.
SWEEP = {"SHOAL_BLOB_SWEEP_INTERVAL_S": "0.2", "SHOAL_BLOB_TTL_S": "3600"}


def store() -> BlobStore:
    return BlobStore(os.environ["SHOAL_BLOB_URL"])


def claim_keys(blobs: BlobStore) -> set[str]:
    """The claim blobs there now (complete ones: uploads in progress have a .part name)."""
    blobs.fs.invalidate_cache()
    try:
        names = blobs.fs.ls(blobs.path(CLAIMS), detail=False)
    except FileNotFoundError:
        return set()
    return {f"{CLAIMS}/{n.rstrip('/').rsplit('/', 1)[-1]}" for n in names if ".part-" not in n}


def noise_png(seed: int = 0) -> bytes:
    """A PNG of random noise (it does not compress) of at least 10 MB."""
    pixels = np.random.default_rng(seed).integers(0, 256, (1900, 1900, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG", compress_level=1)
    data = out.getvalue()
    assert len(data) >= TEN_MB
    return data


def small_png(colour: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (40, 40), colour).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def big_png() -> bytes:
    return noise_png()


@pytest.fixture(scope="module")
def expected(big_png: bytes, families) -> np.ndarray:
    """The tiny CLIP's unit vector of `big_png`, computed in this process."""
    from transformers import AutoImageProcessor, AutoModel

    model = AutoModel.from_pretrained(family_dir(CLIP)).eval()
    processor = AutoImageProcessor.from_pretrained(family_dir(CLIP))
    image = Image.open(io.BytesIO(big_png)).convert("RGB")
    with torch.inference_mode():
        features = model.get_image_features(**processor(images=[image], return_tensors="pt"))
    features = getattr(features, "pooler_output", features)
    return torch.nn.functional.normalize(features, dim=-1).numpy()[0]


def encode(url: str, images: list[bytes], timeout_ms: int = 60_000) -> httpx.Response:
    body = msgpack.packb({"items": [{"image": image} for image in images]})
    return httpx.post(f"{url}/v1/encode/{CLIP}", content=body, timeout=timeout_ms / 1000 + 30,
                      headers={**MSGPACK, "x-timeout-ms": str(timeout_ms)})


def vectors(r: httpx.Response) -> np.ndarray:
    assert r.status_code == 200, r.text
    return np.array(msgpack.unpackb(r.content)["embeddings"], dtype=np.float32)


def error_code(r: httpx.Response) -> tuple[int, str, str]:
    error = msgpack.unpackb(r.content)["error"]  # answered in the request's msgpack
    return r.status_code, error["code"], error["message"]


def assert_same(got: np.ndarray, expected: np.ndarray) -> None:
    assert float(got @ expected) >= 0.9999


# --- through the session's stack --------------------------------------------------------------

def test_a_10mb_image_goes_through_the_claim_check(families, big_png, expected):
    blobs = store()
    before = claim_keys(blobs)
    r = encode(families.url, [big_png, small_png((200, 30, 30))])
    got = vectors(r)
    assert got.shape == (2, 16)
    assert_same(got[0], expected)
    metrics = f"{families.url}/metrics"
    assert metric_sum(metrics, "shoal_gateway_claims_total") >= 1
    assert metric_sum(metrics, "shoal_gateway_claim_bytes_total") >= len(big_png)
    # Deleted once the worker acked the message.
    wait_for(lambda: not claim_keys(blobs) - before, 30, "the claim blob to be deleted")
    # Routes of text-only models keep SHOAL_MAX_BODY_BYTES (1 MiB in tests).
    r = httpx.post(f"{families.url}/v1/encode/{MINILM}", timeout=60,
                   json={"items": [{"text": "x" * (2 * 1024 * 1024)}]})
    assert r.status_code == 413


def test_a_jobs_large_image_goes_through_the_claim_check(families, big_png, expected):
    """A job's request is claim-checked too: uploaded before its part is published."""
    blobs = store()
    before = claim_keys(blobs)
    metrics = f"{families.url}/metrics"
    claimed = metric_sum(metrics, "shoal_gateway_claim_bytes_total")
    body = msgpack.packb({"operation": "encode", "model": CLIP,
                          "items": [{"image": big_png}]})
    r = httpx.post(f"{families.url}/v1/jobs", content=body, headers=MSGPACK, timeout=60)
    assert r.status_code == 202, r.text
    job_url = f"{families.url}{r.headers['location']}"
    job = wait_for(lambda: (j := httpx.get(job_url, timeout=10).json())["state"] not in
                   ("queued", "running") and j, 120, "the job to finish")
    assert job["state"] == "succeeded", job
    assert_same(np.array(job["result"]["embeddings"][0], dtype=np.float32), expected)
    assert metric_sum(metrics, "shoal_gateway_claim_bytes_total") - claimed >= len(big_png)
    wait_for(lambda: not claim_keys(blobs) - before, 30, "the job's claim blob to be deleted")
    # A job for a text-only model keeps SHOAL_MAX_BODY_BYTES (1 MiB in tests).
    r = httpx.post(f"{families.url}/v1/jobs", timeout=60, json={
        "operation": "encode", "model": MINILM, "items": [{"text": "x" * (2 * 1024 * 1024)}]})
    assert r.status_code == 413, r.text


def test_the_cli_sweeps_orphans_older_than_the_ttl(tmp_path):
    blobs = BlobStore(str(tmp_path / "blobs"))
    orphan, fresh = f"{CLAIMS}/{int(time.time()) - 7200}-orphan", BlobStore.new_key(CLAIMS)
    for key in (orphan, fresh):
        blobs.put(key, b"x")
    out = subprocess.run([sys.executable, "-m", "app.cli", "blobs", "sweep", "--older-than",
                          "3600"], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "SHOAL_BLOB_URL": str(tmp_path / "blobs")})
    assert out.returncode == 0, out.stderr
    assert "swept 1 claim blobs" in out.stdout
    assert not blobs.exists(orphan) and blobs.exists(fresh)


# --- a private stack of CLIP: its gateway, and the workers each test starts -------------------

@pytest.fixture(scope="module")
def clip_stack(families, tmp_path_factory) -> Iterator[PrivateStack]:
    with private_stack(tmp_path_factory.mktemp("claims"), "claims", CLIP) as private:
        private.stack.gateway("claims-gateway", private.port, [CLIP],
                              SHOAL_QUEUE_PREFIX=private.prefix, **SWEEP)
        wait_for(lambda: http_status(f"{private.url}/readyz") == 200, 60,
                 "the gateway to be ready", give_up=private.stack.exited)
        yield private


def clip_worker(private: PrivateStack, name: str, **env: str) -> MeteredWorker:
    return start_metered_worker(private.stack, name, CLIP, private.queue, 120,
                                SHOAL_QUEUE_PREFIX=private.prefix, **env)


def stop(worker: MeteredWorker, private: PrivateStack) -> None:
    worker.process.stop()
    wait_for(lambda: queue_counts(private.queue)[1] == 0, 30, "the worker to stop consuming")


def new_key(blobs: BlobStore, known: set[str]) -> str:
    """The one claim blob that appeared since `known` (it is added to `known`)."""
    keys = wait_for(lambda: claim_keys(blobs) - known, 30, "a claim blob to be uploaded")
    assert len(keys) == 1, keys
    known |= keys
    return keys.pop()


def test_the_message_carries_the_claim_not_the_bytes(clip_stack, big_png, expected):
    private, blobs = clip_stack, store()
    known = claim_keys(blobs)
    with ThreadPoolExecutor(1) as pool:
        # No worker consumes yet: the request waits in the queue (SHOAL_GATEWAY_UNSERVED=wait).
        call = pool.submit(encode, private.url, [big_png], 120_000)
        wait_for(lambda: queue_counts(private.queue)[0] == 1, 30, "the request to be queued")
        key = new_key(blobs, known)
        with Connection(BROKER_URL) as conn:
            channel = conn.default_channel
            message = channel.basic_get(private.queue, no_ack=False)
            assert message is not None
            body = bytes(message.body)
            headers = message.headers
            channel.basic_reject(message.delivery_tag, requeue=True)
        assert headers[H_CLAIMS] == 1
        assert len(body) < 1000 and big_png[:4096] not in body
        claim = claim_of(decode_body(body)["items"][0]["image"])
        assert claim is not None and claim.key == key and claim.size == len(big_png)
        assert claim.sha256 == hashlib.sha256(big_png).hexdigest()
        assert blobs.get(key) == big_png
        # A worker that starts now runs it, and deletes the blob once the message is acked.
        worker = clip_worker(private, "claims-late")
        try:
            assert_same(vectors(call.result(150))[0], expected)
            wait_for(lambda: not blobs.exists(key), 30, "the claim blob to be deleted")
            assert worker.metric("shoal_claims_fetched_total") >= 1
            assert worker.metric("shoal_claims_deleted_total") >= 1
        finally:
            stop(worker, private)


def test_a_worker_killed_after_fetching_leaves_the_claim_for_its_successor(
        clip_stack, big_png, expected):
    private, blobs = clip_stack, store()
    first = clip_worker(private, "claims-killed")
    vectors(encode(private.url, [small_png((0, 90, 0))]))  # the model is loaded
    # Its runtime stops: the worker fetches the claim, then its batch cannot end.
    runtime = first.child_pid(b"runtimes.child_side.server")
    os.kill(runtime, signal.SIGSTOP)
    known = claim_keys(blobs)
    with ThreadPoolExecutor(1) as pool:
        call: Future = pool.submit(encode, private.url, [big_png], 120_000)
        key = new_key(blobs, known)
        wait_for(lambda: first.metric("shoal_claims_fetched_total") >= 1, 60,
                 "the first worker to fetch the claim")
        first.process.kill(signal.SIGKILL)
        first.process.reap(10)
        # A stopped runtime never sees its worker die (it would exit on its own): end it,
        # or it outlives the test session, stopped, holding its memory.
        with contextlib.suppress(ProcessLookupError):
            os.kill(runtime, signal.SIGKILL)
        assert blobs.exists(key)  # unacked: the redelivered message still needs it
        second = clip_worker(private, "claims-successor")
        try:
            assert_same(vectors(call.result(150))[0], expected)
            wait_for(lambda: not blobs.exists(key), 30, "the claim blob to be deleted")
        finally:
            stop(second, private)


def test_a_missing_or_altered_blob_fails_only_its_request(clip_stack, big_png, expected):
    private, blobs = clip_stack, store()
    known = claim_keys(blobs)
    with ThreadPoolExecutor(4) as pool:
        calls: dict[str, Future] = {}
        keys: dict[str, str] = {}
        # Queued one by one while no worker consumes, so each blob is known to be its own.
        for name in ("missing", "corrupt", "good"):
            calls[name] = pool.submit(encode, private.url, [big_png], 120_000)
            keys[name] = new_key(blobs, known)
        calls["inline"] = pool.submit(encode, private.url, [small_png((5, 5, 200))], 120_000)
        wait_for(lambda: queue_counts(private.queue)[0] == 4, 30, "the requests to be queued")
        blobs.delete([keys["missing"]])
        blobs.put(keys["corrupt"], big_png[:-1] + bytes([big_png[-1] ^ 0xFF]))
        worker = clip_worker(private, "claims-checks", SHOAL_CLAIM_UPLOAD_TIMEOUT_S="1")
        try:
            status, code, message = error_code(calls["missing"].result(150))
            assert (status, code) == (422, "BLOB_MISSING")
            assert "item 0's image" in message and keys["missing"] in message
            status, code, message = error_code(calls["corrupt"].result(150))
            assert (status, code) == (422, "BLOB_CORRUPT") and "sha256" in message
            assert_same(vectors(calls["good"].result(150))[0], expected)
            assert vectors(calls["inline"].result(150)).shape == (1, 16)
            # Answered (either way) and acked: the blobs are deleted.
            wait_for(lambda: not any(blobs.exists(k) for k in keys.values()), 30,
                     "the claim blobs to be deleted")
            assert worker.metric("shoal_claims_fetched_total") >= 3
        finally:
            stop(worker, private)


def test_the_gateway_sweeps_orphans_older_than_the_ttl(clip_stack):
    blobs = store()
    orphan, fresh = f"{CLAIMS}/{int(time.time()) - 7200}-orphan", BlobStore.new_key(CLAIMS)
    for key in (orphan, fresh):
        blobs.put(key, b"x")
    try:
        wait_for(lambda: not blobs.exists(orphan), 30, "the gateway to sweep the orphan")
        assert blobs.exists(fresh)
        assert metric_sum(f"{clip_stack.url}/metrics", "shoal_gateway_blobs_swept_total") >= 1
    finally:
        blobs.delete([fresh])


# --- s3 (moto's server) ----------------------------------------------------------------------

BUCKET = "shoal-claims"


@pytest.fixture(scope="module")
def s3(tmp_path_factory) -> Iterator[dict[str, str]]:
    """moto's S3 server on a free port; the env that points s3fs and botocore at it."""
    port = free_port()
    log = (tmp_path_factory.mktemp("moto") / "moto.log").open("wb")
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-p", str(port)],
                              stdout=log, stderr=subprocess.STDOUT)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    try:
        wait_for(lambda: http_status(f"http://127.0.0.1:{port}/moto-api/") == 200, 60,
                 "moto's server", give_up=lambda: server.poll() is not None and "it exited")
        import boto3

        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                     aws_access_key_id="testing", aws_secret_access_key="testing"
                     ).create_bucket(Bucket=BUCKET)
        yield env
    finally:
        server.terminate()
        server.wait(10)
        log.close()


def test_the_claim_check_over_s3(s3, families, big_png, expected, tmp_path):
    url = f"s3://{BUCKET}/shoal"
    blobs = BlobStore(url, client_kwargs={"endpoint_url": s3["AWS_ENDPOINT_URL"]},
                      key="testing", secret="testing")
    with private_stack(tmp_path, "claims-s3", CLIP) as private:
        env = {"SHOAL_QUEUE_PREFIX": private.prefix, "SHOAL_BLOB_URL": url, **s3}
        private.stack.gateway("s3-gateway", private.port, [CLIP], **env)
        wait_for(lambda: http_status(f"{private.url}/readyz") == 200, 60,
                 "the gateway to be ready", give_up=private.stack.exited)
        start_metered_worker(private.stack, "claims-s3", CLIP, private.queue, 120, **env)
        assert_same(vectors(encode(private.url, [big_png]))[0], expected)
        assert metric_sum(f"{private.url}/metrics", "shoal_gateway_claims_total") == 1
        # Uploaded to the bucket, fetched from it, deleted from it once acked.
        wait_for(lambda: not claim_keys(blobs), 30, "the claim object to be deleted")
    # The store itself on s3: atomic puts, reads, sweeping.
    key = f"{CLAIMS}/{int(time.time()) - 7200}-orphan"
    blobs.put(key, b"old")
    assert blobs.get(key) == b"old" and blobs.size(key) == 3
    assert blobs.sweep(CLAIMS, 3600) == [key] and not blobs.exists(key)

