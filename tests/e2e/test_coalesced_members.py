"""Members of one coalesced message stay requests of their own (issue 43): a revoked member
is answered CANCELLED and the rest their results; a poison member fails alone; members
for different LoRA adapters of one model (and for none) each get their own adapter's
answer; the worker's metrics count members, not messages, and the gateway's show the
coalescing.

One worker of this module's own serves `test/faulty` (the session's queue, behind the
session gateway) and a tiny model with LoRA adapters made here. Messages go straight to
the model queues as a shoal gateway's would (`tests.e2e.coalesced_messages`), so every
reply of each member is seen, duplicates included."""

from __future__ import annotations

import asyncio
import shutil
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from tasks.envelope import Part, task_part
from tasks.results import embedding_rows
from tasks.settings import Settings
from tasks.topology import queue_for
from tests.conftest import CATALOG_DIR, FAULTY, TINY_CLS_DIR, queue_name
from tests.e2e.coalesced_messages import (
    catalog_entry,
    collect,
    delete,
    publish,
    publish_alone,
    reply_queue,
)
from tests.slow_batches import SlowBatches
from tests.stack import (
    BROKER_URL,
    MeteredWorker,
    delete_queues,
    free_port,
    metric_sum,
    queue_counts,
    wait_for,
)

pytestmark = pytest.mark.e2e

LORA_BASE = "test/coalesced-lora"  # TINY_CLS's weights, with two LoRA adapters
LORAS = ("alpha", "beta")
SLOW, CRASH = "@@slow@@", "@@crash@@"
# The most two answers to one request may differ by (float32, batched or alone); the
# tiny random models' answers to different texts, or adapters, differ by 1e-3 or more.
SAME = 1e-5


@pytest.fixture(scope="module")
def slow_batches(tmp_path_factory: pytest.TempPathFactory) -> SlowBatches:
    return SlowBatches(tmp_path_factory.mktemp("coalesced-slow"), slow_s=0.0)


@pytest.fixture(scope="module")
def catalog(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's `test/faulty` and LORA_BASE with its adapters (random LoRAs of the
    tiny model, made with peft)."""
    from tests.tiny_lora import BERT_TARGETS, build_tiny_lora

    root = tmp_path_factory.mktemp("coalesced-lora")
    loras = {name: build_tiny_lora(TINY_CLS_DIR, root / f"lora-{name}", targets=BERT_TARGETS,
                                   seed=430 + i) for i, name in enumerate(LORAS)}
    folder = root / "catalog"
    folder.mkdir()
    shutil.copy(CATALOG_DIR / "faulty.yaml", folder / "faulty.yaml")
    (folder / "lora.yaml").write_text(yaml.safe_dump({
        "id": LORA_BASE, "adapter": "dense", "dims": 32, "source": {"path": str(TINY_CLS_DIR)},
        "loras": {name: {"path": str(path)} for name, path in loras.items()}}))
    return folder


@pytest.fixture(scope="module")
def worker(stack, slow_batches: SlowBatches, catalog: Path) -> Iterator[MeteredWorker]:
    port = free_port()
    # One batch in flight, so that a member waits, held, behind a slow batch.
    process = stack.stack.worker(f"coalesced-members-{uuid.uuid4().hex[:6]}",
                                 [FAULTY, LORA_BASE], SHOAL_CATALOG_DIR=str(catalog),
                                 SHOAL_WORKER_METRICS_PORT=str(port),
                                 SHOAL_RUNTIME_PIPELINE_DEPTH="1", SHOAL_TORCH_THREADS="1",
                                 **slow_batches.env)
    try:
        for model in (FAULTY, LORA_BASE):
            wait_for(lambda m=model: queue_counts(queue_name(m))[1] >= 1, 120,
                     f"the worker to consume {model}", give_up=lambda: not process.alive())
        yield MeteredWorker(process, port)
    finally:
        slow_batches.release()
        process.stop()
        lora_queue = queue_for(LORA_BASE, Settings())  # the session's own queues stay
        delete_queues([lora_queue.name, lora_queue.dead_letter_queue])


@pytest.fixture
def reply_to() -> Iterator[str]:
    name = reply_queue()
    yield name
    delete(name)


def _part(entry, text: str, lora: str | None = None) -> Part:
    kwargs = {"model": entry.id, "items": [{"text": text}]}
    if lora is not None:
        kwargs["options"] = {"lora": lora}
    return task_part(entry, kwargs, 120_000)


def _answered_once(reply_to: str, replies: dict[str, list[dict]], queue: str,
                   worker: MeteredWorker) -> dict[str, dict]:
    """Each request's only reply, once the worker has settled its messages (any second
    answer would be published before the ack that empties the queue and its hold)."""
    wait_for(lambda: queue_counts(queue)[0] == 0
             and worker.metric("shoal_held_messages") == 0, 30, "the messages to be settled")
    for task_id, late in collect(reply_to, set(), 0.1).items():
        replies.setdefault(task_id, []).extend(late)
    assert {t: len(r) for t, r in replies.items() if len(r) != 1} == {}
    return {t: r[0] for t, r in replies.items()}


def _error_code(reply: dict) -> str | None:
    return reply["result"]["exc_message"][0] if reply["status"] == "FAILURE" else None


def _embedding(reply: dict) -> np.ndarray:
    assert reply["status"] == "SUCCESS", reply
    (embedding,) = embedding_rows(reply["result"])
    return np.asarray(embedding, dtype=np.float32)


def _gap(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max())


def _revoked_on(worker: MeteredWorker) -> set[str]:
    """The task ids the worker holds as revoked (Celery's `inspect revoked`)."""
    from tasks.celery_app import app

    app.conf.broker_url = BROKER_URL
    hostname = f"{worker.process.name}@{socket.gethostname()}"
    replies = app.control.inspect(destination=[hostname], timeout=5).revoked() or {}
    return set(replies.get(hostname, ()))


def test_a_revoked_member_is_cancelled_and_the_others_get_their_results(
        worker: MeteredWorker, slow_batches: SlowBatches, reply_to: str):
    from tasks.celery_app import app

    faulty, queue = catalog_entry(FAULTY), queue_name(FAULTY)
    started = slow_batches.started()
    slow_batches.hold()  # the members wait behind this batch until the revoke is in
    try:
        stall = publish_alone(queue, _part(faulty, f"{SLOW} stall"), reply_to)
        slow_batches.wait_started(started + 1)
        members = [_part(faulty, f"held member {i}") for i in range(4)]
        publish(queue, FAULTY, members, reply_to)
        wait_for(lambda: worker.metric("shoal_held_messages") == len(members), 30,
                 "the members to be held")
        revoked = members[1].task_id
        app.control.revoke(revoked)
        wait_for(lambda: revoked in _revoked_on(worker), 30, "the worker to have the revoke")
    finally:
        slow_batches.release()
    want = {stall, *(m.task_id for m in members)}
    replies = _answered_once(reply_to, collect(reply_to, want, 60), queue, worker)
    assert set(replies) == want
    assert _error_code(replies[revoked]) == "CANCELLED", replies[revoked]
    assert "before it ran" in replies[revoked]["result"]["exc_message"][1]
    for member in (m for m in members if m.task_id != revoked):
        assert _embedding(replies[member.task_id]).shape == (32,)
    assert replies[stall]["status"] == "SUCCESS"


def test_a_poison_member_fails_alone_and_the_others_get_their_own_results(
        worker: MeteredWorker, reply_to: str):
    faulty, queue = catalog_entry(FAULTY), queue_name(FAULTY)
    restarts = worker.metric("shoal_runtime_restarts")
    isolated = worker.metric("shoal_poison_isolated")
    # The poison first: bisecting the batch then takes two crashes (restarts), not three.
    texts = [f"poison {CRASH} member", "the cat sits on the mat", "rivers of france"]
    members = [_part(faulty, t) for t in texts]
    poison = members[0].task_id
    publish(queue, FAULTY, members, reply_to)
    replies = _answered_once(reply_to, collect(reply_to, {m.task_id for m in members}, 180),
                             queue, worker)
    assert _error_code(replies[poison]) == "POISON_INPUT", replies[poison]
    assert worker.metric("shoal_runtime_restarts") > restarts
    assert worker.metric("shoal_poison_isolated") > isolated
    assert worker.process.alive()
    # Each good member got the embedding of its own text: the one it gets sent alone,
    # and not the other's.
    good = [(t, m) for t, m in zip(texts, members, strict=True) if m.task_id != poison]
    alone = {t: publish_alone(queue, _part(faulty, t), reply_to) for t, _ in good}
    lone = collect(reply_to, set(alone.values()), 60)
    for text, member in good:
        got = _embedding(replies[member.task_id])
        for other, _ in good:
            gap = _gap(got, _embedding(lone[alone[other]][0]))
            assert (gap <= SAME) == (other == text), (text, other, gap)


def test_members_for_different_loras_get_their_own_adapters_answers(
        worker: MeteredWorker, catalog: Path, reply_to: str):
    entry, queue = catalog_entry(LORA_BASE, catalog), queue_name(LORA_BASE)
    mix: list[tuple[str | None, str]] = [("alpha", "the cat sits"), (None, "the cat sits"),
                                         ("beta", "the cat sits"), ("alpha", "rivers of france"),
                                         (None, "rivers of france")]

    def coalesced() -> list[np.ndarray]:
        members = [_part(entry, text, lora) for lora, text in mix]
        publish(queue, LORA_BASE, members, reply_to)
        replies = _answered_once(reply_to, collect(reply_to, {m.task_id for m in members},
                                                   120), queue, worker)
        return [_embedding(replies[m.task_id]) for m in members]

    # First with no adapter loaded (the LoRA members are parked until their adapters are
    # in), then each request alone, then together again with the adapters resident.
    cold = coalesced()
    alone_ids = [publish_alone(queue, _part(entry, text, lora), reply_to) for lora, text in mix]
    lone = collect(reply_to, set(alone_ids), 120)
    alone = [_embedding(lone[t][0]) for t in alone_ids]
    warm = coalesced()
    for i, (lora, text) in enumerate(mix):
        assert _gap(cold[i], alone[i]) <= SAME, ("cold", lora, text, _gap(cold[i], alone[i]))
        assert _gap(warm[i], alone[i]) <= SAME, ("warm", lora, text, _gap(warm[i], alone[i]))
    # The adapters change the answer (else a member answered by the wrong one would pass).
    alpha, base, beta = alone[:3]
    assert min(_gap(alpha, base), _gap(beta, base), _gap(alpha, beta)) > 100 * SAME


def test_metrics_count_requests_not_messages(stack, worker: MeteredWorker, reply_to: str):
    faulty, queue = catalog_entry(FAULTY), queue_name(FAULTY)
    results = worker.metric("shoal_results_total")
    batched = worker.metric("shoal_batch_requests_sum")
    members = [_part(faulty, f"counted member {i}") for i in range(6)]
    publish(queue, FAULTY, members, reply_to)
    replies = _answered_once(reply_to, collect(reply_to, {m.task_id for m in members}, 60),
                             queue, worker)
    assert all(r["status"] == "SUCCESS" for r in replies.values())
    # One message of six requests: six answers, six requests run.
    wait_for(lambda: worker.metric("shoal_results_total") - results == len(members), 10,
             "six results counted")
    assert worker.metric("shoal_batch_requests_sum") - batched == len(members)

    # Through the gateway: bursts until some message carried several requests; the
    # gateway counts the requests its messages carried, the worker the same requests.
    metrics = f"{stack.url}/metrics"
    requests_name = "shoal_gateway_requests_per_message_sum"
    messages_name = "shoal_gateway_requests_per_message_count"
    requests, messages = metric_sum(metrics, requests_name), metric_sum(metrics, messages_name)
    results = worker.metric("shoal_results_total")
    sent, refused = 0, []

    async def burst() -> None:
        nonlocal sent
        url = f"{stack.url}/v1/encode/{FAULTY}"
        async with httpx.AsyncClient(timeout=60) as client:
            posts = [client.post(url, json={"items": [{"text": f"burst {sent} text {i}"}]})
                     for i in range(16)]
            sent += len(posts)
            answers = await asyncio.gather(*posts)
        refused.extend(a.text for a in answers if a.status_code != 200)

    def coalesced_once() -> bool:
        asyncio.run(burst())
        return metric_sum(metrics, requests_name) - requests > \
            metric_sum(metrics, messages_name) - messages

    wait_for(coalesced_once, 120, "a message carrying several requests", interval=0)
    assert refused == []
    assert metric_sum(metrics, requests_name) - requests == sent
    wait_for(lambda: worker.metric("shoal_results_total") - results == sent, 10,
             "a result counted per request")
