"""bench.broker_failover's figures from plain request records."""

from __future__ import annotations

from bench.broker_failover import Request, _percentile, _same, summarize
from bench.broker_failover_cluster import Cluster


def _request(i: int, sent: float, done: float | None, answers: int = 1, **kw) -> Request:
    return Request(i, i % 4, sent=sent, done=done, sends=1, answers=answers, **kw)


def test_a_run_counts_lost_and_twice_answered_requests_and_the_recovery():
    requests = [
        _request(0, 0.0, 0.1),
        _request(1, 0.5, 0.6),
        _request(2, 1.0, 3.0, refused=4),  # sent just before the stop at 1.2, retried
        _request(3, 1.5, 2.5),  # the first sent after the stop to be answered
        _request(4, 2.0, None, answers=0, failure="no answer"),
        _request(5, 2.2, 2.8, answers=2),
    ]
    summary = summarize(requests, fault_at=1.2, window_s=10)
    assert summary["sent"] == 6
    assert summary["answered"] == 5
    assert summary["lost"] == 1 and summary["lost_examples"] == ["no answer"]
    assert summary["answered_twice"] == 1
    assert summary["retryable_refusals"] == 4
    assert abs(summary["recover_s"] - (2.5 - 1.2)) < 1e-9
    assert abs(summary["longest_gap_s"] - 1.9) < 1e-9  # 0.6 -> 2.5
    assert summary["p99_fault_ms"] == 1000  # requests 3 and 5 were sent in the window


def test_percentiles_and_vector_comparison():
    assert _percentile([], 99) is None
    assert _percentile([float(v) for v in range(1, 101)], 99) == 99
    assert _percentile([5.0], 50) == 5.0
    assert _same([1.0, 0.0], [2.0, 0.0])
    assert not _same([1.0, 0.0], [0.0, 1.0])


def test_the_cluster_names_its_nodes_and_finds_free_ports(tmp_path):
    cluster = Cluster(tmp_path, name="shoalx")
    assert cluster.node_of("shoalx2@localhost") == 2
    assert len(set(cluster.amqp_ports + cluster.management_ports)) == 6
    assert cluster.broker_url.count(";") == 2
    assert not {5672, 15672} & set(cluster.amqp_ports + cluster.management_ports)
