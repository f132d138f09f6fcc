"""The worker's metrics: `labels(...)` is a dict lookup once a label set was seen (the
loop calls it per request), and still the one child prometheus_client exports."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from app.worker.metrics import Counter, Histogram
from tasks.errors import ErrorCode


def _exported(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def test_a_label_set_seen_before_gives_the_same_child_and_counts_once():
    registry = CollectorRegistry()
    results = Counter("t_results", "requests answered", ["model", "outcome"],
                      registry=registry)
    child = results.labels("m", ErrorCode.INTERNAL)
    assert results.labels("m", "INTERNAL") is child  # an ErrorCode is its string
    assert results.labels(model="m", outcome="INTERNAL") is child
    child.inc()
    results.labels("m", "ok").inc(3)
    text = _exported(registry)
    assert 't_results_total{model="m",outcome="INTERNAL"} 1.0' in text
    assert 't_results_total{model="m",outcome="ok"} 3.0' in text


def test_a_removed_label_set_comes_back_as_a_new_child():
    registry = CollectorRegistry()
    waits = Histogram("t_wait", "queue wait", ["model"], buckets=(1.0,), registry=registry)
    waits.labels("m").observe(0.5)
    waits.remove("m")
    assert 't_wait_count{model="m"}' not in _exported(registry)
    waits.labels("m").observe(0.5)  # exported again, counted from zero
    assert 't_wait_count{model="m"} 1.0' in _exported(registry)
    waits.clear()
    assert 't_wait_count{model="m"}' not in _exported(registry)
    waits.labels("m").observe(2.0)
    assert 't_wait_bucket{le="+Inf",model="m"} 1.0' in _exported(registry)
