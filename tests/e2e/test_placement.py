"""Models placed by the queue: warm workers first, lazy loads, LRU evictions, operators.

Simulated workers (SHOAL_RUNTIME=sim: real Celery workers, real RabbitMQ, batches and
loads that sleep as the profile says) under a private queue prefix. Which worker
answered is read from X-Worker; what each worker holds from the pool-state messages
it publishes (`tasks.pool_state`) and from Celery's remote control.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
from kombu import Connection, Exchange, Queue

from app.tuning.stack import prefix_queues
from tasks.pool_state import COLD, RESIDENT, decode_state, pool_exchange
from tests.conftest import MINILM
from tests.stack import (
    BROKER_URL,
    delete_queues,
    free_port,
    http_status,
    model_loads,
    private_stack,
    queue_counts,
    wait_for,
)

pytestmark = pytest.mark.e2e
E5, GTE = "intfloat/e5-small-v2", "thenlper/gte-small"
MB = 2**20


async def _post_all(url: str, model: str, n: int, concurrency: int,
                    items: int = 1) -> list[httpx.Response]:
    limit = asyncio.Semaphore(concurrency)

    async def post(client: httpx.AsyncClient, i: int) -> httpx.Response:
        body = {"items": [{"text": f"item {j} of request {i}"} for j in range(items)]}
        async with limit:
            return await client.post(f"{url}/v1/encode/{model}", json=body,
                                     headers={"x-timeout-ms": "60000"})

    async with httpx.AsyncClient(timeout=90) as client:
        return list(await asyncio.gather(*(post(client, i) for i in range(n))))


@contextlib.contextmanager
def pool_states(prefix: str) -> Iterator[list[dict]]:
    """The pool-state messages workers publish, collected while the block runs (call
    `drain` by reading the list after `wait_for`)."""
    states: list[dict] = []
    with Connection(BROKER_URL) as conn:
        exchange = Exchange(pool_exchange(prefix), type="fanout", durable=True)
        queue = Queue(f"{prefix}.test-states.{uuid.uuid4().hex[:6]}", exchange,
                      exclusive=True, auto_delete=True)
        with conn.Consumer([queue], callbacks=[lambda body, m: (states.append(
                decode_state(m.body)), m.ack())], accept=["msgpack", "application/x-msgpack"]):
            states.append({"_drain": lambda: _drain(conn)})
            yield states


def _drain(conn: Connection) -> None:
    with contextlib.suppress(TimeoutError, OSError):
        conn.drain_events(timeout=0.2)


def _latest(states: list[dict], worker_prefix: str) -> dict | None:
    states[0]["_drain"]()
    mine = [s for s in states[1:] if s["worker"].startswith(worker_prefix)]
    return mine[-1] if mine else None


def _model_state(states: list[dict], worker_prefix: str, model: str) -> str | None:
    latest = _latest(states, worker_prefix)
    if latest is None:
        return None
    return next((m["state"] for m in latest["models"] if m["id"] == model), None)


def test_the_warm_worker_takes_the_traffic_and_the_cold_one_takes_the_overflow(tmp_path):
    with private_stack(tmp_path, "placement", MINILM) as private:
        prefix, stack, port = private.prefix, private.stack, private.port
        common = {"SHOAL_QUEUE_PREFIX": prefix, "SHOAL_RUNTIME": "sim", "SHOAL_DEVICE": "cpu",
                  "SHOAL_WORKER_METRICS_PORT": "0", "SHOAL_POOL_STATE_INTERVAL_S": "1"}
        warm, cold = f"warm-{prefix}", f"cold-{prefix}"
        with pool_states(prefix) as states:
            stack.worker(warm, [MINILM], **common)  # pinned: named without a glob
            stack.worker(cold, [MINILM], SHOAL_PIN="", **common)
            stack.gateway("placement-gateway", port, None, SHOAL_QUEUE_PREFIX=prefix)
            wait_for(lambda: http_status(f"{private.url}/readyz") == 200, 20, "the gateway")
            wait_for(lambda: queue_counts(private.queue)[1] >= 2, 30, "both workers")
            wait_for(lambda: _model_state(states, cold, MINILM) == COLD, 20,
                     "the cold worker to say MiniLM is cold")
            assert _model_state(states, warm, MINILM) == RESIDENT

            # A load the warm worker carries: two clients, one request each at a time.
            light = asyncio.run(_post_all(private.url, MINILM, 80, concurrency=2))
            assert [r.status_code for r in light] == [200] * 80
            served = Counter(r.headers["x-worker"].split("@")[0] for r in light)
            assert served[warm] >= 0.95 * 80, served
            assert _model_state(states, cold, MINILM) == COLD  # never needed it

            stack.stop_all()
        # Saturated: restarted on a slow device, the warm worker holds more than a load's
        # time (1 s) of work, so the cold one loads and takes the overflow.
        slow = {**common, "SHOAL_SIM_COST_A_MS": "100", "SHOAL_SIM_COST_B_US": "200",
                "SHOAL_SIM_COST_C_NS": "0"}
        with pool_states(prefix) as states:
            stack.worker(f"{warm}-2", [MINILM], **slow)
            stack.worker(f"{cold}-2", [MINILM], SHOAL_PIN="", **slow)
            stack.gateway("placement-gateway-2", port, None, SHOAL_QUEUE_PREFIX=prefix)
            wait_for(lambda: http_status(f"{private.url}/readyz") == 200, 20, "the gateway")
            wait_for(lambda: queue_counts(private.queue)[1] >= 2, 30, "both workers")
            heavy = asyncio.run(_post_all(private.url, MINILM, 64, concurrency=32, items=32))
            assert [r.status_code for r in heavy] == [200] * 64
            served = Counter(r.headers["x-worker"].split("@")[0] for r in heavy)
            assert served[f"{cold}-2"] > 0, served
            wait_for(lambda: _model_state(states, f"{cold}-2", MINILM) == RESIDENT, 10,
                     "the cold worker to report MiniLM loaded")


def test_lazy_loads_evict_the_least_recently_used_and_operators_see_and_steer(tmp_path):
    models = [MINILM, E5, GTE]
    with private_stack(tmp_path, "evict", MINILM) as private:
        prefix, stack, port = private.prefix, private.stack, private.port
        worker, metrics_port = f"pool-{prefix}", free_port()
        try:
            with pool_states(prefix) as states:
                stack.worker(worker, models, SHOAL_PIN="", SHOAL_QUEUE_PREFIX=prefix,
                             SHOAL_RUNTIME="sim", SHOAL_DEVICE="cpu",
                             SHOAL_WORKER_METRICS_PORT=str(metrics_port),
                             SHOAL_POOL_STATE_INTERVAL_S="1", SHOAL_PLACEMENT="lru",
                             # three 100 MB models, room for two
                             SHOAL_DEVICE_MEMORY_BYTES=str(250 * MB))
                stack.gateway("evict-gateway", port, None, SHOAL_QUEUE_PREFIX=prefix)
                wait_for(lambda: http_status(f"{private.url}/readyz") == 200, 20, "gateway")
                wait_for(lambda: _latest(states, worker), 30, "the worker's pool state")
                assert {m["state"] for m in _latest(states, worker)["models"]} == {COLD}

                for model in models:  # each loads on its first request
                    (r,) = asyncio.run(_post_all(private.url, model, 1, 1))
                    assert r.status_code == 200, r.text
                    # the load's wait shows in the queue time (sim loads take 1 s)
                    assert float(r.headers["x-queue-time-ms"]) >= 900
                    assert model_loads(metrics_port, model) == 1
                wait_for(lambda: _model_state(states, worker, GTE) == RESIDENT, 10, "GTE")
                latest = _latest(states, worker)
                by_id = {m["id"]: m for m in latest["models"]}
                assert by_id[MINILM]["state"] == COLD  # least recently used: evicted
                assert by_id[E5]["state"] == RESIDENT and by_id[E5]["bytes"] == 100 * MB
                assert latest["used_bytes"] == 200 * MB <= latest["budget_bytes"]

                # A resident model answers without a load.
                (r,) = asyncio.run(_post_all(private.url, E5, 1, 1))
                assert r.status_code == 200 and model_loads(metrics_port, E5) == 1

                # Operators: inspect, unload, load.
                from app.celery import app as celery_app

                celery_app.conf.broker_url = BROKER_URL
                destination = [worker_name(celery_app, worker)]
                inspect = celery_app.control.inspect(destination=destination, timeout=5)
                (report,) = inspect._request("shoal_models").values()
                assert {m["id"]: m["state"] for m in report["models"]}[E5] == RESIDENT
                (reply,) = celery_app.control.broadcast(
                    "shoal_unload", arguments={"model": E5}, destination=destination,
                    reply=True, timeout=5)
                assert "ok" in next(iter(reply.values())), reply
                (reply,) = celery_app.control.broadcast(
                    "shoal_load", arguments={"model": MINILM}, destination=destination,
                    reply=True, timeout=5)
                assert "ok" in next(iter(reply.values())), reply
                wait_for(lambda: _model_state(states, worker, MINILM) == RESIDENT, 10,
                         "MiniLM loaded by the operator")
                assert _model_state(states, worker, E5) == COLD
        finally:
            delete_queues(prefix_queues(prefix, models))


def worker_name(celery_app, prefix: str) -> str:
    """The full Celery hostname of the worker whose name starts with `prefix`."""
    return wait_for(lambda: next(
        (name for name in (celery_app.control.ping(timeout=1) and
                           [k for d in celery_app.control.ping(timeout=1) for k in d])
         if name.startswith(prefix)), None), 20, f"worker {prefix} to answer a ping")


def test_a_model_that_cannot_fit_is_answered_503_and_the_worker_keeps_serving(tmp_path):
    with private_stack(tmp_path, "nofit", MINILM) as private:
        prefix, stack, port = private.prefix, private.stack, private.port
        try:
            stack.worker(f"nofit-{prefix}", [MINILM, E5], SHOAL_PIN=MINILM,
                         SHOAL_QUEUE_PREFIX=prefix, SHOAL_RUNTIME="sim", SHOAL_DEVICE="cpu",
                         SHOAL_WORKER_METRICS_PORT="0",
                         # MiniLM (pinned, 100 MB) fills it: E5 cannot fit
                         SHOAL_DEVICE_MEMORY_BYTES=str(150 * MB))
            stack.gateway("nofit-gateway", port, None, SHOAL_QUEUE_PREFIX=prefix)
            wait_for(lambda: http_status(f"{private.url}/readyz") == 200, 20, "gateway")
            wait_for(lambda: queue_counts(private.queue)[1] >= 1, 30, "the worker")
            (r,) = asyncio.run(_post_all(private.url, E5, 1, 1))
            assert r.status_code == 503, r.text
            error = r.json()["error"]
            assert error["code"] == "MODEL_UNAVAILABLE" and "does not fit" in error["message"]
            (r,) = asyncio.run(_post_all(private.url, MINILM, 1, 1))
            assert r.status_code == 200
        finally:
            delete_queues(prefix_queues(prefix, [MINILM, E5]))
