"""The result contract both ways (issue 54): a sender that asks for contract 2 (a shoal
gateway) gets what a reply message's results share once and reads every result whole; a
Celery client, or a sender that does not ask (an older gateway), gets whole results."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import msgpack
import pytest
from kombu import Connection

from tasks.envelope import H_MULTI, coalesce, decode_results, task_part
from tasks.served import read_served
from tests.conftest import MINILM, queue_name
from tests.e2e.coalesced_messages import catalog_entry, delete, reply_queue, send
from tests.stack import BROKER_URL, wait_for

pytestmark = pytest.mark.e2e

FACTS = {"model", "batch", "worker"}


def _whole(result: dict) -> None:
    """A result with its envelope, as `tasks.served` promises it."""
    served = read_served(result)
    assert served.model == MINILM and served.worker
    assert served.batch is not None and served.batch["requests"] >= 1 \
        and served.batch["items"] >= 1 and served.batch["inference_ms"] > 0
    assert served.timing is not None and "queue_ms" in served.timing
    assert result["count"] >= 1 and result["dims"] == 384


def test_a_celery_client_gets_the_whole_result(stack):
    from tasks.client import app, encode

    via_task = encode.apply_async(kwargs={"model": MINILM, "items": [{"text": "a"}]})
    via_send = app.send_task("shoal.encode", kwargs={"model": MINILM,
                                                     "items": [{"text": "b"}, {"text": "c"}]})
    _whole(via_task.get(timeout=30))
    _whole(via_send.get(timeout=30))


@pytest.fixture
def reply_to(stack) -> Iterator[str]:
    name = reply_queue()
    yield name
    delete(name)


def _replies(reply_to: str, want: int) -> list[dict]:
    """Each reply message on `reply_to`, raw (msgpack) with its header, until `want`
    results came."""
    raw: list[tuple[dict, bool]] = []
    with Connection(BROKER_URL) as conn:
        channel = conn.default_channel

        def drain() -> bool:
            while (message := channel.basic_get(reply_to, no_ack=True)) is not None:
                multi = bool((message.headers or {}).get(H_MULTI))
                raw.append((message.body, multi))
            return sum(len(decode_results(b, m)) for b, m in raw) >= want

        wait_for(drain, 60, f"{want} results")
    return [{"body": body, "multi": multi, "raw": msgpack.unpackb(body)}
            for body, multi in raw]


@pytest.mark.parametrize("contract", [2, 1])
def test_coalesced_members_each_get_their_result_with_the_shared_facts(stack, reply_to,
                                                                      contract):
    """Eight members of one message, answered in one batch: with contract 2 the facts come
    once per reply message, without it in each result; either way every member's result
    reads whole."""
    entry = catalog_entry(MINILM)
    parts = [task_part(entry, {"model": MINILM, "items": [{"text": f"member {i}"}]}, 60_000)
             for i in range(8)]
    send(queue_name(MINILM), coalesce(MINILM, "encode", parts, "test", reply_batch=True,
                                      contract=contract), reply_to)
    messages = _replies(reply_to, len(parts))
    results = {r["task_id"]: r for m in messages for r in decode_results(m["body"], m["multi"])}
    assert set(results) == {p.task_id for p in parts}
    for result in results.values():
        assert result["status"] == "SUCCESS" and result["date_done"]
        _whole(result["result"])
    shared = [m for m in messages if len(m["raw"].get("results", ())) > 1]
    assert shared, "the members were answered one message each"
    for message in shared:
        carried = [set(r["result"]) for r in message["raw"]["results"]]
        if contract == 2:
            assert set(message["raw"]["shared"]) >= FACTS
            assert all(not FACTS & keys for keys in carried)
        else:
            assert "shared" not in message["raw"] and "envelope" not in message["raw"]
            assert all(keys >= FACTS for keys in carried)


def test_the_gateway_reads_the_shared_facts_into_its_headers(stack):
    """Concurrent one-text requests (answered several to a reply message) each get the
    headers the gateway derives from its result's facts."""
    url = f"{stack.url}/v1/encode/{MINILM}"

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(client.post(url, json={"items": [{"text": f"t{i}"}]})
                                          for i in range(16)))

    for response in asyncio.run(burst()):
        assert response.status_code == 200, response.text
        assert response.headers["X-Worker"] and int(response.headers["X-Batch-Requests"]) >= 1
        assert float(response.headers["X-Inference-Time-Ms"]) >= 0
