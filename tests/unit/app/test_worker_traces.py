"""The worker's spans (`app.worker.lifecycle.traces`), tracing on, read from the SDK's
in-memory exporter: the dispatcher of tests/unit/app/test_dispatcher.py (fake hub, fake
runtime, no broker) takes traced messages; each request continues its own trace, a batch
span links them all, and the runtime is handed the batch's context."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from batching.latency_model import CostModel
from runtimes.base import Outcome, Request
from tasks import tracing
from tasks.envelope import Annotations, Part, coalesce, task_body, task_headers
from tasks.names import ENCODE
from tests.fakes import Message
from tests.tracing_memory import TRACES, finished
from tests.unit.app.test_dispatcher import MODEL, Fixture, Runtime, _kwargs

SENT_MS = 1_700_000_000_000.0


def _context(n: int) -> tuple[str, str, str]:
    trace_id, span_id = f"{n:032x}", f"{n:016x}"
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


class TracingRuntime(Runtime):
    """The fake runtime, keeping the trace context each batch's requests carry."""

    def __init__(self) -> None:
        super().__init__()
        self.traces: list[set[str | None]] = []

    def run_batch(self, model: str, requests: list[Request], on_deltas: Any) -> list[Outcome]:
        self.traces.append({r.trace for r in requests})
        return super().run_batch(model, requests, on_deltas)


@pytest.fixture
def traced(monkeypatch) -> Iterator[Fixture]:
    monkeypatch.setattr(tracing, "ENABLED", True)
    TRACES.clear()
    fixture = Fixture(1, 8, CostModel(0.001, 0.0, 0.0), TracingRuntime())
    yield fixture
    fixture.runtime.go.set()
    fixture.view.close()


def _annotations(traceparent: str | None) -> Annotations:
    return Annotations(MODEL, "encode", 1, 10, 10, None, SENT_MS, traceparent=traceparent)


def test_coalesced_members_keep_their_traces_and_share_a_linked_batch_span(traced):
    f = traced
    contexts = {f"t{n}": _context(n) for n in (1, 2, 3)}
    members = [Part(task_id, _annotations(tp), task_body(_kwargs(1)))
               for task_id, (tp, _, _) in contexts.items()]
    message = coalesce(MODEL, "encode", members, "gw")
    f.runtime.fail = {"t3"}
    f.runtime.go.clear()  # the batch runs until `finish_batch`
    f.deliver(Message(headers=message.headers, body=message.body))
    f.finish_batch()
    spans = finished()
    requests = {s.attributes["shoal.task_id"]: s for s in spans if s.name == f"request {MODEL}"}
    assert set(requests) == set(contexts)
    for task_id, (_, trace_id, span_id) in contexts.items():
        span = requests[task_id]
        assert format(span.context.trace_id, "032x") == trace_id
        assert format(span.parent.span_id, "016x") == span_id  # the member's own context
    assert requests["t1"].attributes["shoal.outcome"] == "ok"
    assert requests["t3"].attributes["shoal.outcome"] == "POISON_INPUT"
    assert not requests["t3"].status.is_ok
    [batch] = [s for s in spans if s.name == f"batch {MODEL}"]
    assert batch.parent is None  # several requests: a trace of its own...
    assert {link.context.span_id for link in batch.links} == {  # ...linked to each
        s.context.span_id for s in requests.values()}
    assert batch.attributes["shoal.batch.requests"] == 3
    assert batch.attributes["shoal.batch.failed"] == 1
    for span in requests.values():  # each request's hold ends where the batch starts
        [event] = span.events
        assert event.name == "batch started" and event.timestamp == batch.start_time
        assert event.attributes["shoal.hold_ms"] >= 0
    queued = [s for s in spans if s.name == f"queued {MODEL}"]
    assert len(queued) == 3 and all(q.start_time == int(SENT_MS * 1e6) for q in queued)
    # The runtime was handed the batch span's context, the same for every request.
    [[handed]] = f.runtime.traces
    assert handed.split("-")[1:3] == [format(batch.context.trace_id, "032x"),
                                      format(batch.context.span_id, "016x")]


def test_a_lone_requests_batch_is_its_child(traced):
    f = traced
    traceparent, trace_id, _ = _context(9)
    headers = task_headers("lone", ENCODE, _annotations(traceparent), "gw")
    f.runtime.go.clear()
    f.deliver(Message(headers=headers, body=task_body(_kwargs(1))))
    f.finish_batch()
    spans = finished()
    [request] = [s for s in spans if s.name == f"request {MODEL}"]
    [batch] = [s for s in spans if s.name == f"batch {MODEL}"]
    assert batch.parent.span_id == request.context.span_id
    assert format(batch.context.trace_id, "032x") == trace_id


def test_a_request_without_a_context_starts_its_own_trace(traced):
    f = traced
    headers = task_headers("untraced", ENCODE, _annotations(None), "gw")
    f.runtime.go.clear()
    f.deliver(Message(headers=headers, body=task_body(_kwargs(1))))
    f.finish_batch()
    [request] = [s for s in finished() if s.name == f"request {MODEL}"]
    assert request.parent is None and request.attributes["shoal.outcome"] == "ok"


def test_a_request_its_sender_did_not_sample_records_nothing(traced):
    f = traced
    traceparent = _context(7)[0][:-2] + "00"  # sampled flag off
    headers = task_headers("unsampled", ENCODE, _annotations(traceparent), "gw")
    f.runtime.go.clear()
    f.deliver(Message(headers=headers, body=task_body(_kwargs(1))))
    f.finish_batch()
    assert [s.name for s in finished()] == [f"batch {MODEL}"]  # a batch is its own trace
    assert f.replies()["unsampled"]["status"] == "SUCCESS"
