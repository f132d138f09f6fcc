"""Every error status of the gateway: clear code, clear message, nothing hangs."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import msgpack
import pytest

from gateway.edge.error_shapes import is_openai_path
from tests.conftest import MINILM, RERANKER, UNSERVED, queue_name
from tests.stack import delete_queues, free_port, http_status, queue_counts, wait_for

pytestmark = pytest.mark.e2e


def _error(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    msgpack_reply = r.headers["content-type"] == "application/msgpack"
    body = msgpack.unpackb(r.content) if msgpack_reply else r.json()
    assert body["error"]["code"] == code
    assert body["error"]["message"]
    return body["error"]["message"]


def post(stack, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{stack.url}{path}", timeout=30, **kwargs)


def test_unknown_model_404(stack):
    message = _error(post(stack, "/v1/encode/nobody/nothing", json={"items": [{"text": "x"}]}),
                     404, "MODEL_NOT_FOUND")
    assert MINILM in message  # says what is served
    _error(post(stack, "/v1/embeddings", json={"model": "nope", "input": "x"}),
           404, "MODEL_NOT_FOUND")


@pytest.mark.parametrize("content,ctype", [
    (b'{"items": [', "application/json"),
    (b"\xc1\xc1", "application/msgpack"),
])
def test_malformed_body_400(stack, content, ctype):
    _error(post(stack, f"/v1/encode/{MINILM}", content=content,
                headers={"content-type": ctype}), 400, "INVALID_REQUEST")


def test_unsupported_media_type_415(stack):
    _error(post(stack, f"/v1/encode/{MINILM}", content=b"x",
                headers={"content-type": "text/plain"}), 415, "UNSUPPORTED_MEDIA_TYPE")


@pytest.mark.parametrize("path,body,fragment", [
    (f"/v1/encode/{MINILM}", {"items": [{"text": 1}]}, "items[0]"),
    (f"/v1/encode/{MINILM}", {"items": []}, "non-empty"),
    (f"/v1/encode/{MINILM}", {"items": [{"text": "x"}], "options": {"dimensions": 999}},
     "dimensions"),
    (f"/v1/encode/{MINILM}", {"items": [{"text": "x"}], "options": {"colour": 1}}, "colour"),
    (f"/v1/encode/{MINILM}", {"texts": ["x"]}, "texts"),
    (f"/v1/encode/{MINILM}", ["x"], "object"),
    ("/v1/embeddings", {"model": MINILM, "input": 5}, "input"),
    ("/v1/embeddings", {"model": MINILM, "input": ["x", [1, 2]]}, "input[1]"),
    ("/v1/embeddings", {"model": MINILM, "input": ["x", ""]}, "input[1] is an empty string"),
    ("/v1/embeddings", {"model": MINILM, "input": "x", "encoding_format": "hex"},
     "encoding_format"),
    ("/v1/embeddings", {"model": MINILM, "input": "x", "dimensions": "8"}, "dimensions"),
    ("/v1/embeddings", {"input": "x"}, "model"),
    (f"/v1/score/{RERANKER}", {"query": 5, "items": [{"text": "x"}]}, "query"),
    (f"/v1/score/{RERANKER}", {"query": "q", "items": [{"text": "x"}],
                               "options": {"top_n": "2"}}, "top_n"),
])
def test_wrong_types_422_or_400_on_openai_routes(stack, path, body, fragment):
    # OpenAI answers 400 invalid_request_error (the SDK's BadRequestError); native: 422.
    openai_route = is_openai_path(path)
    r = post(stack, path, json=body)
    assert fragment in _error(r, 400 if openai_route else 422, "VALIDATION_ERROR")
    if openai_route:
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert "param" in r.json()["error"]


def test_bad_timeout_header_422(stack):
    _error(post(stack, f"/v1/encode/{MINILM}", json={"items": [{"text": "x"}]},
                headers={"x-timeout-ms": "soon"}), 422, "VALIDATION_ERROR")


def test_too_large_413(stack):
    _error(post(stack, f"/v1/encode/{MINILM}",
                json={"items": [{"text": "x" * 600_000}, {"text": "y" * 600_000}]}),
           413, "PAYLOAD_TOO_LARGE")
    message = _error(post(stack, f"/v1/encode/{MINILM}",
                          json={"items": [{"text": "x"}] * 2049}), 413, "PAYLOAD_TOO_LARGE")
    assert "2048" in message
    # OpenAI answers 400 for more inputs than it takes, naming `input`.
    r = post(stack, "/v1/embeddings", json={"model": MINILM, "input": ["x"] * 2049})
    assert "2048" in _error(r, 400, "PAYLOAD_TOO_LARGE")
    assert r.json()["error"]["param"] == "input"


def test_too_long_input_without_truncation_413(stack):
    r = post(stack, f"/v1/encode/{MINILM}",
             json={"items": [{"text": "word " * 400}], "options": {"truncate": False}})
    assert "truncate" in _error(r, 413, "INPUT_TOO_LONG")


def test_unknown_route_and_method(stack):
    _error(httpx.get(f"{stack.url}/v2/nothing"), 404, "NOT_FOUND")
    _error(httpx.get(f"{stack.url}/v1/embeddings"), 405, "METHOD_NOT_ALLOWED")


def test_deadline_504_when_no_worker_serves(stack):
    r = post(stack, f"/v1/encode/{UNSERVED}", json={"items": [{"text": "x"}]},
             headers={"x-timeout-ms": "300"})
    assert "X-Timeout-Ms" in _error(r, 504, "DEADLINE_EXCEEDED")
    # It may have been running when the gateway stopped waiting: SDKs must not send it
    # again as it is (the openai SDK would retry a 504 twice).
    assert r.headers["x-should-retry"] == "false"


def test_gateway_survives_all_of_the_above(stack):
    r = post(stack, f"/v1/encode/{MINILM}", json={"items": [{"text": "still here"}]})
    assert r.status_code == 200


def test_queue_full_429_with_retry_after(stack):
    """A gateway whose queues hold 2 messages, for a model no worker serves."""
    prefix = f"shoal-test-full-{uuid.uuid4().hex[:6]}"
    port = free_port()
    stack.stack.gateway("gateway-full", port, [UNSERVED], SHOAL_QUEUE_PREFIX=prefix,
                        SHOAL_QUEUE_MAX_LENGTH="2")
    url = f"http://127.0.0.1:{port}"
    name = f"{prefix}.model.test.unserved"
    try:
        wait_for(lambda: http_status(f"{url}/readyz") == 200, 30, "the second gateway")

        async def main() -> httpx.Response:
            # Quorum queues refuse a publish once they are *over* x-max-length,
            # so the refusal may come one message late; allow for it.
            async with httpx.AsyncClient(timeout=30) as client:
                waiting = []
                for queued in range(1, 5):
                    task = asyncio.create_task(client.post(
                        f"{url}/v1/encode/{UNSERVED}", json={"items": [{"text": "x"}]},
                        headers={"x-timeout-ms": "20000"}))
                    await asyncio.to_thread(
                        wait_for, lambda n=queued, t=task: t.done() or queue_counts(name)[0] == n,
                        10, f"message {queued} to be queued or refused")
                    if task.done():
                        for other in waiting:
                            other.cancel()
                        return task.result()
                    waiting.append(task)
                raise AssertionError("the full queue never refused a message")

        refused = asyncio.run(main())
        _error(refused, 429, "QUEUE_FULL")
        assert int(refused.headers["retry-after"]) >= 0
        assert queue_counts(name)[0] <= 3  # x-max-length 2, plus at most one
    finally:
        delete_queues([name, f"{name}.dead"])


def test_broker_down_503_with_retry_after(stack):
    port = free_port()
    stack.stack.gateway("gateway-nobroker", port, [MINILM],
                        SHOAL_BROKER_URL=f"amqp://guest:guest@127.0.0.1:{free_port()}//")
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: http_status(f"{url}/healthz") == 200, 30, "the gateway to listen")
    r = httpx.get(f"{url}/readyz")
    _error(r, 503, "BROKER_UNAVAILABLE")
    r = httpx.post(f"{url}/v1/encode/{MINILM}", json={"items": [{"text": "x"}]}, timeout=10)
    _error(r, 503, "BROKER_UNAVAILABLE")
    assert r.headers["retry-after"] == "1"


def test_msgpack_error_responses_follow_accept(stack):
    r = post(stack, "/v1/encode/nope/nope", content=msgpack.packb({"items": []}),
             headers={"content-type": "application/msgpack"})
    assert r.status_code == 404
    assert msgpack.unpackb(r.content)["error"]["code"] == "MODEL_NOT_FOUND"
    assert queue_name(MINILM)  # the session queue naming is in use
