"""The HTTP API end to end: gateway -> RabbitMQ -> worker -> model -> reply."""

from __future__ import annotations

import asyncio
import base64
import time

import httpx
import msgpack
import numpy as np
import pytest
from openai import OpenAI

from gateway.calls.request_trace import HOPS, parse_trace
from runtimes.pytorch.dense import DenseEncoder
from tests.conftest import MINILM, TINY_CLS
from tests.tiny_models import MINILM_DIR

pytestmark = pytest.mark.e2e
TEXTS = ["The cat sits on the mat.", "", "Grüße aus Köln 東京 🚀", "word " * 400]


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    return DenseEncoder(str(MINILM_DIR)).encode(TEXTS)


def test_native_json(stack, reference):
    r = httpx.post(f"{stack.url}/v1/encode/{MINILM}",
                   json={"items": [{"text": t} for t in TEXTS]}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == MINILM and body["dims"] == 384
    got = np.array(body["embeddings"], dtype=np.float32)
    assert got.shape == (4, 384)
    assert (got * reference).sum(axis=1).min() >= 0.9999
    assert body["usage"]["tokens"] > 256  # the long text counts its 256 truncated tokens
    for header in ("x-request-id", "x-queue-time-ms", "x-inference-time-ms", "x-total-time-ms"):
        assert header in r.headers


def test_a_traced_request_says_where_its_time_went(stack):
    untraced = httpx.post(f"{stack.url}/v1/encode/{MINILM}",
                          json={"items": [{"text": "x"}]}, timeout=30)
    assert untraced.status_code == 200 and "x-shoal-trace" not in untraced.headers
    started = time.perf_counter()
    r = httpx.post(f"{stack.url}/v1/encode/{MINILM}", json={"items": [{"text": "x"}]},
                   headers={"x-shoal-trace": "1"}, timeout=30)
    elapsed_ms = (time.perf_counter() - started) * 1000
    assert r.status_code == 200, r.text
    hops = parse_trace(r.headers["x-shoal-trace"])
    assert list(hops) == list(HOPS)  # every hop, in path order: the worker stamped its part
    # One clock on one host: no hop is negative beyond float rounding, and together they
    # fit inside what the client waited.
    assert min(hops.values()) > -0.01, hops
    assert sum(hops.values()) <= elapsed_ms
    assert hops["batch"] == pytest.approx(float(r.headers["x-inference-time-ms"]), abs=0.1)


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8", "binary"])
def test_json_vectors_read_back_as_the_exact_values_msgpack_carries(stack, dtype):
    # JSON writes float32 in its shortest form: parsed back and cast to float32 it must be
    # the very value (msgpack carries the same rows as plain numbers).
    body = {"items": [{"text": t} for t in TEXTS[:3]], "options": {"dtype": dtype}}
    as_json = httpx.post(f"{stack.url}/v1/encode/{MINILM}", json=body, timeout=30)
    as_msgpack = httpx.post(f"{stack.url}/v1/encode/{MINILM}", json=body, timeout=30,
                            headers={"accept": "application/msgpack"})
    assert as_json.status_code == as_msgpack.status_code == 200, as_json.text
    rows = msgpack.unpackb(as_msgpack.content)["embeddings"]
    got = as_json.json()["embeddings"]
    assert len(got) == len(rows) == 3
    kind = {"float32": np.float32, "float16": np.float16}.get(dtype, np.int64)
    np.testing.assert_array_equal(np.array(got, dtype=kind), np.array(rows, dtype=kind))
    assert np.array(got).dtype == (np.float64 if dtype.startswith("float") else np.int64)


def test_native_msgpack_both_ways(stack, reference):
    r = httpx.post(
        f"{stack.url}/v1/encode/{MINILM}",
        content=msgpack.packb({"items": [{"text": t} for t in TEXTS],
                               "options": {"dimensions": 16}}),
        headers={"content-type": "application/msgpack", "x-request-id": "abc-123"},
        timeout=30,
    )
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/msgpack"
    assert r.headers["x-request-id"] == "abc-123"
    body = msgpack.unpackb(r.content)
    got = np.array(body["embeddings"], dtype=np.float32)
    assert got.shape == (4, 16)
    expected = reference[:, :16] / np.linalg.norm(reference[:, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_accept_header_picks_the_response_type(stack):
    r = httpx.post(f"{stack.url}/v1/encode/{MINILM}", json={"items": [{"text": "x"}]},
                   headers={"accept": "application/x-msgpack"}, timeout=30)
    assert r.status_code == 200
    assert len(msgpack.unpackb(r.content)["embeddings"][0]) == 384


def test_openai_client_float_and_base64(stack, reference):
    client = OpenAI(base_url=f"{stack.url}/v1", api_key="unused")
    # The client asks for base64 by default and decodes it itself. OpenAI's API refuses
    # an empty string (tests/e2e/test_token_ids.py): the rest of TEXTS.
    kept = [i for i, t in enumerate(TEXTS) if t]
    default = client.embeddings.create(model=MINILM, input=[TEXTS[i] for i in kept])
    assert [d.index for d in default.data] == [0, 1, 2]
    got = np.array([d.embedding for d in default.data], dtype=np.float32)
    np.testing.assert_allclose(got, reference[kept], atol=1e-6)
    floats = client.embeddings.create(model=MINILM, input="The cat sits on the mat.",
                                      encoding_format="float", dimensions=32)
    assert len(floats.data) == 1 and len(floats.data[0].embedding) == 32
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0


def test_openai_base64_is_little_endian_float32(stack, reference):
    r = httpx.post(f"{stack.url}/v1/embeddings",
                   json={"model": MINILM, "input": TEXTS[0], "encoding_format": "base64"},
                   timeout=30)
    vector = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(vector, reference[0], atol=1e-6)


def test_tiny_model_served_by_the_same_worker(stack):
    r = httpx.post(f"{stack.url}/v1/encode/{TINY_CLS}", json={"items": [{"text": "a"}]},
                   timeout=30)
    assert r.status_code == 200 and r.json()["dims"] == 32


def test_models_and_health(stack):
    models = httpx.get(f"{stack.url}/v1/models", params={"all": "true"}).json()["data"]
    by_id = {m["id"]: m for m in models}
    assert by_id[MINILM]["dims"] == 384 and by_id[MINILM]["tasks"] == ["encode"]
    assert by_id[MINILM]["max_seq_length"] == 256  # its sentence_bert_config.json's
    assert httpx.get(f"{stack.url}/healthz").status_code == 200
    assert httpx.get(f"{stack.url}/readyz").status_code == 200
    metrics = httpx.get(f"{stack.url}/metrics").text
    assert "shoal_gateway_requests_total" in metrics


def test_concurrent_clients_share_batches(stack, reference):
    """32 clients at once: the worker must put several requests in one batch."""

    async def one_client(client: httpx.AsyncClient, i: int) -> tuple[int, np.ndarray]:
        sizes = []
        for _ in range(5):
            r = await client.post(f"{stack.url}/v1/encode/{MINILM}",
                                  json={"items": [{"text": TEXTS[i % 3]}]})
            assert r.status_code == 200, r.text
            sizes.append(int(r.headers["x-batch-requests"]))
            vector = np.array(r.json()["embeddings"][0], dtype=np.float32)
            assert vector @ reference[i % 3] >= 0.9999  # no mix-up between requests
        return max(sizes)

    async def main() -> list[int]:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=32)) as c:
            return await asyncio.gather(*(one_client(c, i) for i in range(32)))

    largest = max(asyncio.run(main()))
    assert largest > 1, "no batch held more than one request"
