"""gateway.broker.pool_view: the workers' latest pool states, kept, checked and forgotten when
stale."""

from __future__ import annotations

import msgpack
import pytest

from gateway.broker.pool_view import PoolView, worker_rows
from tasks.pool_state import STALE_AFTER_INTERVALS, encode_state


def _state(worker: str = "w1@host", interval_s: float | None = 2.0, **model) -> bytes:
    entry = {"id": "m/a", "state": "resident", "pinned": False, "bytes": 100, "loras": ["x"]}
    entry.update(model)
    state = {"worker": worker, "at": 0.0, "budget_bytes": 1000, "used_bytes": 100,
             "models": [entry, {"id": "m/b", "state": "cold", "pinned": False, "bytes": None}]}
    if interval_s is not None:
        state["interval_s"] = interval_s
    return encode_state(state)


def test_keeps_the_latest_state_per_worker():
    pool = PoolView(default_interval_s=5.0)
    pool.update(_state("w1", state="loading"), now=0.0)
    pool.update(_state("w2"), now=0.5)
    pool.update(_state("w1"), now=1.0)  # replaces w1's earlier one
    placements = pool.placements("m/a", now=1.0)
    assert [(p.worker, p.state) for p in placements] == [("w1", "resident"), ("w2", "resident")]
    assert pool.serves("m/b", now=1.0)
    assert not pool.serves("m/c", now=1.0)


def test_forgets_a_worker_after_stale_after_intervals_of_its_own_interval():
    pool = PoolView(default_interval_s=5.0)
    pool.update(_state("fast", interval_s=1.0), now=0.0)
    pool.update(_state("default", interval_s=None), now=0.0)  # the gateway's setting: 5 s
    assert len(pool.fresh(now=STALE_AFTER_INTERVALS * 1.0)) == 2
    assert [s.worker for s in pool.fresh(now=STALE_AFTER_INTERVALS * 1.0 + 0.01)] == ["default"]
    assert pool.fresh(now=STALE_AFTER_INTERVALS * 5.0 + 0.01) == []
    assert not pool.serves("m/a", now=100.0)


def test_serves_answers_again_when_a_state_arrives_or_the_worker_goes_stale():
    pool = PoolView(default_interval_s=1.0)
    pool.update(_state("w1", interval_s=1.0), now=0.0)
    assert pool.serves("m/a", now=0.5)  # the answer is kept...
    assert pool.serves("m/a", now=STALE_AFTER_INTERVALS * 1.0)
    assert not pool.serves("m/a", now=STALE_AFTER_INTERVALS * 1.0 + 0.01)  # ...until stale
    pool.update(_state("w1", interval_s=1.0), now=10.0)
    assert pool.serves("m/a", now=10.5)
    pool.update(encode_state({"worker": "w1", "models": []}), now=11.0)  # farewell
    assert not pool.serves("m/a", now=11.0)


@pytest.mark.parametrize("body", [
    b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"worker": "w"}),
    msgpack.packb({"worker": 5, "models": []}),
    _state(interval_s=0), _state(interval_s=-1), _state(interval_s=float("nan")),
    _state(interval_s="5"), _state(interval_s=True),
    _state(state="hot"), _state(id=5), _state(bytes="big"), _state(bytes=1.5),
    _state(pinned="yes"), _state(loras="x"), _state(loras=[1]),
    encode_state({"worker": "w", "models": ["m/a"]}),
])
def test_a_malformed_state_is_refused_and_nothing_is_kept(body):
    pool = PoolView(default_interval_s=5.0)
    pool.update(_state("w1"), now=0.0)
    with pytest.raises(ValueError):
        pool.update(body, now=0.1)
    assert [s.worker for s in pool.fresh(now=0.1)] == ["w1"]  # the earlier one stands


def test_worker_rows_for_a_model_and_for_its_loras():
    pool = PoolView(default_interval_s=5.0)
    pool.update(_state("w1"), now=0.0)
    pool.update(_state("w2", loras=[]), now=0.0)
    pool.update(_state("w3", state="loading"), now=0.0)
    placements = pool.placements("m/a", now=0.0)
    assert worker_rows(placements) == [
        {"worker": "w1", "state": "resident", "bytes": 100, "pinned": False, "loras": ["x"],
         "device_busy": None},
        {"worker": "w2", "state": "resident", "bytes": 100, "pinned": False, "loras": [],
         "device_busy": None},
        {"worker": "w3", "state": "loading", "bytes": 100, "pinned": False, "loras": ["x"],
         "device_busy": None},
    ]
    assert [(r["worker"], r["state"]) for r in worker_rows(placements, "x")] == [
        ("w1", "resident"), ("w2", "cold"), ("w3", "loading")]


def test_a_workers_device_busy_fraction_is_kept_per_row_and_checked():
    pool = PoolView(default_interval_s=5.0)
    body = encode_state({"worker": "w9", "at": 0.0, "interval_s": 2.0, "device_busy": 0.5,
                         "models": [{"id": "m/a", "state": "resident", "pinned": False,
                                     "bytes": 1}]})
    pool.update(body, now=0.0)
    (row,) = worker_rows(pool.placements("m/a", now=0.0))
    assert row["device_busy"] == 0.5
    for wrong in (-0.1, "busy", True, float("nan")):
        with pytest.raises(ValueError, match="device_busy"):
            pool.update(encode_state({"worker": "w9", "device_busy": wrong, "models": []}),
                        now=0.1)
