"""A result's envelope: written by the runtime and the worker, read back in one place."""

from __future__ import annotations

import time

from tasks.served import (
    batch_device_ms,
    read_served,
    reply_headers,
    stamp_batch,
    stamp_delivery,
)


def _served_batch(simulated: dict | None = None) -> list[dict]:
    results: list[dict] = [{"scores": [0.5]}, {"scores": [0.1, 0.2]}]
    requests = [{"items": [{"text": "a"}]}, {"items": [{"text": "b"}, {"text": "c"}]}]
    stamp_batch(results, "m/x", requests, time.perf_counter(), simulated)
    return results


def test_a_batch_marks_each_result_with_the_model_and_the_batch():
    first, second = _served_batch()
    for result in (first, second):
        served = read_served(result)
        assert served.model == "m/x" and served.simulated is None
        assert served.batch is not None
        assert (served.batch["requests"], served.batch["items"]) == (2, 3)
        assert served.batch["inference_ms"] >= 0
    assert "simulated" not in first and first["scores"] == [0.5]


def test_delivery_adds_queue_time_the_batchs_inference_time_and_the_worker():
    result = _served_batch({"device": "l4", "a_ms": 1.0})[0]
    stamp_delivery(result, 12, "worker@host")
    served = read_served(result)
    assert served.worker == "worker@host" and served.simulated == {"device": "l4", "a_ms": 1.0}
    assert served.timing is not None and served.batch is not None
    assert served.timing["queue_ms"] == 12
    assert served.timing["inference_ms"] == round(served.batch["inference_ms"], 3)


def test_the_gateways_headers_come_from_the_envelope():
    result = _served_batch({"device": "l4"})[0]
    stamp_delivery(result, None, "worker@host")
    headers = reply_headers(result)
    assert "X-Queue-Time-Ms" not in headers  # no sent time: no queue time either
    assert headers["X-Worker"] == "worker@host" and headers["X-Simulated"] == "l4"
    assert headers["X-Batch-Requests"] == "2" and "X-Inference-Time-Ms" in headers


def test_a_result_without_an_envelope_reads_as_empty():
    served = read_served({"scores": [1.0], "batch": "garbage"})
    assert (served.model, served.batch, served.timing, served.worker, served.simulated) == (
        None, None, None, None, None)
    assert reply_headers({"scores": [1.0]}) == {}


def test_a_batch_carries_the_devices_busy_time_when_the_runtime_tells():
    results: list[dict] = [{"scores": [0.5]}, {"scores": [0.1]}]
    stamp_batch(results, "m/x", [{"items": [1]}, {"items": [2]}], time.perf_counter(),
                device_s=0.0125)
    assert [r["batch"]["device_ms"] for r in results] == [12.5, 12.5]
    assert batch_device_ms(results) == 12.5
    assert batch_device_ms(iter(results)) == 12.5  # a generator, as the dispatcher passes
    assert "device_ms" not in _served_batch()[0]["batch"]  # None: the runtime cannot tell
    zero: list[dict] = [{}]
    stamp_batch(zero, "m/x", [{}], time.perf_counter(), device_s=0.0)
    assert batch_device_ms(zero) == 0.0  # a figure of 0, not "unknown"


def test_batch_device_ms_skips_failed_requests_and_is_none_without_a_figure():
    results: list[dict] = [{"scores": [0.5]}]
    stamp_batch(results, "m/x", [{"items": [1]}], time.perf_counter(), device_s=0.002)
    assert batch_device_ms([None, None, *results]) == 2.0  # failed ones come as None
    assert batch_device_ms([None, None]) is None  # every request failed
    assert batch_device_ms([]) is None
    assert batch_device_ms(_served_batch()) is None  # SGLang: no device figure
    assert batch_device_ms([{"scores": [1.0]}]) is None  # no envelope at all
    assert batch_device_ms([{"batch": "not a mapping"}]) is None

