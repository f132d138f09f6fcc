"""A request's hop trace (`gateway.calls.request_trace`) from its stamps."""

from __future__ import annotations

import pytest

from gateway.calls.request_trace import HOPS, hop_trace, parse_trace
from tasks.served import read_served, stamp_batch, stamp_delivery


def _stamped(received_s: float, started_s: float) -> dict:
    result: dict = {}
    stamp_batch([result], "m/x", [{"items": [{"text": "a"}]}], started=0.0)
    result["batch"]["inference_ms"] = 2.0
    stamp_delivery(result, 1.0, "w@h", received_s, started_s)
    return result


def test_every_hop_in_path_order_from_the_stamps():
    result = _stamped(received_s=100.0015, started_s=100.002)
    timing = read_served(result).timing
    assert timing is not None
    answered = timing["answered_us"] / 1e6  # stamped now: far after the fixed times above
    hops = parse_trace(hop_trace(arrived_s=100.0, sent_ms=100_000.5, timing=timing,
                                 replied_s=answered + 0.0008, now_s=answered + 0.001))
    assert list(hops) == list(HOPS)
    assert hops["gateway_in"] == pytest.approx(0.5)
    assert hops["to_worker"] == pytest.approx(1.0)
    assert hops["held"] == pytest.approx(0.5)
    assert hops["batch"] == pytest.approx(2.0)
    assert hops["reply"] == pytest.approx(0.8, abs=0.01)
    assert hops["gateway_out"] == pytest.approx(0.2, abs=0.01)


def test_a_result_without_the_workers_stamps_gives_the_gateways_hops_only():
    result: dict = {}
    stamp_delivery(result, None, "w@h")  # an older worker: no stamps
    hops = parse_trace(hop_trace(10.0, 10_001.0, read_served(result).timing, 10.005, 10.006))
    assert list(hops) == ["gateway_in", "worker", "gateway_out"]
    assert hops["worker"] == pytest.approx(4.0)
