"""Tracing on (OTEL_*), a stack exports its spans over OTLP/HTTP to a receiver this module
runs: one request is one connected trace across the gateway, the worker and its runtime
process, continuing the caller's `traceparent`; the members of a coalesced message each
keep their own trace, linked to the batch span they share.

One private stack (a gateway and a worker of MiniLM) for the module, a few requests."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Iterator

import httpx
import pytest

from tasks.envelope import Part, task_part
from tests.conftest import MINILM
from tests.e2e.coalesced_messages import catalog_entry, collect, delete, publish, reply_queue
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.stack import PrivateStack, http_status, private_stack, start_metered_worker, wait_for

COMPONENTS = {"gateway", "worker", "runtime"}
EXPECTED = {"POST /v1/embeddings", f"publish {MINILM}", f"queued {MINILM}", f"request {MINILM}",
            f"batch {MINILM}", f"runtime {MINILM}", "prepare", "device", "results", "reply"}


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> Iterator[tuple[PrivateStack, OtlpReceiver]]:
    receiver = OtlpReceiver().start()
    try:
        with private_stack(tmp_path_factory.mktemp("tracing"), "tracing", MINILM) as private:
            env = {"SHOAL_QUEUE_PREFIX": private.prefix, **receiver.env()}
            private.stack.gateway("traced-gateway", private.port, [MINILM], **env)
            wait_for(lambda: http_status(f"{private.url}/readyz") == 200, 60,
                     "the gateway to be ready", give_up=private.stack.exited)
            start_metered_worker(private.stack, "traced", MINILM, private.queue, 180, **env)
            yield private, receiver
    finally:
        receiver.stop()


def _new_traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [s.name for s in spans])
    return found[0]


def test_one_request_is_one_trace_across_the_processes(traced):
    private, receiver = traced
    traceparent, trace_id, caller_span = _new_traceparent()
    response = httpx.post(f"{private.url}/v1/embeddings", timeout=60,
                          json={"model": MINILM, "input": "a traced request"},
                          headers={"traceparent": traceparent})
    assert response.status_code == 200, response.text

    def complete(spans: list[ReceivedSpan]) -> list[ReceivedSpan] | None:
        mine = [s for s in spans if s.trace_id == trace_id]
        names = {s.name for s in mine}
        return mine if names >= EXPECTED else None

    spans = receiver.wait(complete, 60, "the request's spans from every process")
    assert {s.component for s in spans} == COMPONENTS
    assert len({s.resource["process.pid"] for s in spans}) == 3  # three processes
    by_id = {s.span_id: s for s in spans}
    server = _one(spans, "POST /v1/embeddings")
    publish_ = _one(spans, f"publish {MINILM}")
    queued = _one(spans, f"queued {MINILM}")
    request = _one(spans, f"request {MINILM}")
    batch = _one(spans, f"batch {MINILM}")
    runtime = _one(spans, f"runtime {MINILM}")
    # The chain of parents, from the caller's span to the runtime's stages.
    assert server.parent_id == caller_span and server.component == "gateway"
    assert publish_.parent_id == server.span_id
    assert queued.parent_id == request.parent_id == publish_.span_id
    assert request.component == "worker"
    assert batch.parent_id == request.span_id and (trace_id, request.span_id) in batch.links
    assert runtime.parent_id == batch.span_id and runtime.component == "runtime"
    for stage in ("prepare", "device", "results"):
        assert _one(spans, stage).parent_id == runtime.span_id
    assert _one(spans, "reply").parent_id == server.span_id
    assert all(s.parent_id in by_id for s in spans if s is not server)  # nothing dangles
    # What the spans say of the request.
    assert server.attributes["http.route"] == "/v1/embeddings"
    assert server.attributes["shoal.model"] == MINILM and server.attributes["shoal.items"] == 1
    assert request.attributes["shoal.outcome"] == "ok"
    assert batch.attributes["shoal.batch.requests"] == 1
    # Each span lies within its parent's time (one host: one clock).
    for s in (queued, request, batch, runtime):
        assert s.start_ns >= server.start_ns and s.end_ns <= server.end_ns


def test_an_error_answer_says_its_code_on_the_server_span(traced):
    private, receiver = traced
    traceparent, trace_id, _ = _new_traceparent()
    response = httpx.post(f"{private.url}/v1/encode/no-such-model", timeout=60,
                          json={"items": [{"text": "x"}]}, headers={"traceparent": traceparent})
    assert response.status_code == 404
    spans = receiver.wait(lambda s: [x for x in s if x.trace_id == trace_id], 30,
                          "the refused request's span")
    assert spans[0].name == "POST /v1/encode/{model}"
    assert spans[0].attributes["shoal.error_code"] == "MODEL_NOT_FOUND"


def test_coalesced_members_keep_their_traces_linked_to_a_shared_batch(traced):
    private, receiver = traced
    entry = catalog_entry(MINILM)
    members: list[Part] = []
    contexts: dict[str, tuple[str, str]] = {}  # task id -> (trace id, span id) it was sent
    for i in range(64):
        traceparent, trace_id, span_id = _new_traceparent()
        part = task_part(entry, {"model": MINILM, "items": [{"text": f"text {i}"}]}, 120_000)
        members.append(dataclasses.replace(part, annotations=dataclasses.replace(
            part.annotations, traceparent=traceparent)))
        contexts[part.task_id] = (trace_id, span_id)
    reply_to = reply_queue()
    try:
        publish(private.queue, MINILM, members, reply_to)
        replies = collect(reply_to, set(contexts), 120)
    finally:
        delete(reply_to)
    assert all(r[0]["status"] == "SUCCESS" for r in replies.values())

    def requests_of(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan] | None:
        found = {s.attributes.get("shoal.task_id"): s for s in spans
                 if s.name == f"request {MINILM}" and s.attributes.get("shoal.task_id")
                 in contexts}
        return found if len(found) == len(contexts) else None

    requests = receiver.wait(requests_of, 60, "a request span per member")
    for task_id, span in requests.items():  # each in its own trace, under its own context
        assert (span.trace_id, span.parent_id) == contexts[task_id]
    assert len({s.trace_id for s in requests.values()}) == 64
    linked = {(s.trace_id, s.span_id) for s in requests.values()}

    def batches_of(spans: list[ReceivedSpan]) -> list[ReceivedSpan] | None:
        found = [s for s in spans if s.name == f"batch {MINILM}" and linked & set(s.links)]
        covered = set().union(*(set(s.links) for s in found)) if found else set()
        return found if linked <= covered else None

    batches = receiver.wait(batches_of, 60, "batch spans linking every member")
    # Shared: fewer batches than members, each member linked from exactly one of them.
    assert len(batches) < len(members) and max(len(b.links) for b in batches) > 1
    assert sum(len(linked & set(b.links)) for b in batches) == len(members)
    for b in batches:
        assert b.attributes["shoal.batch.requests"] == len(b.links)
        if len(b.links) > 1:
            assert b.parent_id == ""  # a batch of several requests is a trace of its own
    runtimes = receiver.wait(
        lambda spans: [s for s in spans if s.name == f"runtime {MINILM}"
                       and s.parent_id in {b.span_id for b in batches}], 30,
        "the runtime's spans of those batches")
    assert {s.trace_id for s in runtimes} <= {b.trace_id for b in batches}


def test_a_traced_celery_clients_trace_goes_on_in_the_worker(traced):
    """A backend service traced with OpenTelemetry's Celery instrumentation sends its trace
    context in the task's headers (`traceparent`, as shoal's own messages carry it)."""
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.trace import SpanKind

    from tasks import tracing
    from tasks.client import encode
    from tasks.queues import model_kombu_queue
    from tasks.settings import Settings
    from tests.tracing_memory import TRACES, finished

    private, receiver = traced
    queue = model_kombu_queue(MINILM, Settings(queue_prefix=private.prefix),
                              catalog_entry(MINILM).queue_type)
    TRACES.clear()
    CeleryInstrumentor().instrument()
    try:
        with tracing.tracer().start_as_current_span("a backend's job") as job:
            result = encode.apply_async(
                kwargs={"model": MINILM, "items": [{"text": "from Celery"}]}, queue=queue,
                exchange=queue.exchange, routing_key=queue.routing_key).get(timeout=60)
    finally:
        CeleryInstrumentor().uninstrument()
    assert result["count"] == 1
    trace_id = format(job.get_span_context().trace_id, "032x")
    [sent] = [s for s in finished() if s.kind == SpanKind.PRODUCER]  # the client's publish
    [request] = receiver.wait(
        lambda spans: [s for s in spans if s.trace_id == trace_id
                       and s.name == f"request {MINILM}"], 60, "the worker's request span")
    assert request.parent_id == format(sent.context.span_id, "016x")


def test_the_gateways_redis_calls_are_spans_of_the_request(traced):
    private, receiver = traced
    traceparent, trace_id, _ = _new_traceparent()
    response = httpx.get(f"{private.url}/v1/jobs/no-such-job", timeout=60,
                         headers={"traceparent": traceparent})
    assert response.status_code == 404
    spans = receiver.wait(
        lambda s: [x for x in s if x.trace_id == trace_id] if any(
            x.trace_id == trace_id and x.name.startswith("GET /v1/jobs") for x in s) else None,
        30, "the job lookup's spans")
    server = _one(spans, "GET /v1/jobs/{id}")
    redis = [s for s in spans if "redis" in (s.attributes.get("db.system"),
                                             s.attributes.get("db.system.name"))]
    assert redis and all(s.parent_id == server.span_id for s in redis)
