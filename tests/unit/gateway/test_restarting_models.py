"""gateway.broker.restarting_models: a model is refused by the gateway itself only while
every worker that serves it is restarting its runtime, until the soonest should serve."""

from __future__ import annotations

import time

import pytest

from gateway.broker.pool_view import PoolView
from gateway.broker.restarting_models import RestartingModels
from tasks.pool_state import encode_state

MODEL = "m/a"


def _state(worker: str, ready_in_s: float | None = None, models: tuple[str, ...] = (MODEL,)
           ) -> bytes:
    entries = []
    for model in models:
        entry = {"id": model, "state": "resident", "pinned": False, "bytes": 100}
        if ready_in_s is not None:
            entry["ready_in_s"] = ready_in_s
        entries.append(entry)
    return encode_state({"worker": worker, "interval_s": 5.0, "models": entries})


def _heard(pool: PoolView, restarting: RestartingModels, body: bytes, now: float) -> None:
    restarting.heard_state(pool.update(body, now))


def test_a_lone_worker_restarting_refuses_until_its_ready_in_then_publishes():
    pool, restarting = PoolView(5.0), RestartingModels()
    _heard(pool, restarting, _state("w1"), now=0.0)
    assert not restarting
    _heard(pool, restarting, _state("w1", ready_in_s=4.0), now=1.0)
    assert restarting.refusal(MODEL, pool.placements(MODEL, 2.0), now=2.0) == pytest.approx(3.0)
    assert restarting.refusal("m/other", pool.placements("m/other", 2.0), now=2.0) is None
    # The time has passed: published again (the worker refuses with a new estimate if late).
    assert restarting.refusal(MODEL, pool.placements(MODEL, 5.0), now=5.0) is None
    assert not restarting


def test_a_state_saying_it_serves_again_ends_the_refusals_at_once():
    pool, restarting = PoolView(5.0), RestartingModels()
    _heard(pool, restarting, _state("w1", ready_in_s=30.0), now=0.0)
    assert restarting.refusal(MODEL, pool.placements(MODEL, 1.0), now=1.0) is not None
    _heard(pool, restarting, _state("w1"), now=2.0)
    assert restarting.refusal(MODEL, pool.placements(MODEL, 2.0), now=2.0) is None
    assert not restarting


def test_a_peer_that_still_serves_keeps_every_request_published():
    pool, restarting = PoolView(5.0), RestartingModels()
    _heard(pool, restarting, _state("w1", ready_in_s=10.0), now=0.0)
    _heard(pool, restarting, _state("w2"), now=0.0)
    assert restarting.refusal(MODEL, pool.placements(MODEL, 1.0), now=1.0) is None
    # Both restarting: the soonest says when to come back.
    _heard(pool, restarting, _state("w2", ready_in_s=3.0), now=1.0)
    assert restarting.refusal(MODEL, pool.placements(MODEL, 2.0), now=2.0) == pytest.approx(2.0)


def test_a_refusal_marks_the_worker_only_when_it_is_the_only_one_serving():
    pool, restarting = PoolView(5.0), RestartingModels()
    _heard(pool, restarting, _state("w1"), now=0.0)
    _heard(pool, restarting, _state("w2"), now=0.0)
    restarting.heard_refusal(MODEL, pool.placements(MODEL, 1.0), 5, now=1.0)
    assert not restarting  # which of the two refused is not known
    pool.update(encode_state({"worker": "w2", "models": []}), now=1.0)  # w2 leaves
    restarting.heard_refusal(MODEL, pool.placements(MODEL, 1.0), 5, now=1.0)
    assert restarting.refusal(MODEL, pool.placements(MODEL, 2.0), now=2.0) == pytest.approx(4.0)


def test_a_worker_that_no_longer_lists_the_model_is_no_longer_marked():
    pool, restarting = PoolView(5.0), RestartingModels()
    _heard(pool, restarting, _state("w1", ready_in_s=10.0, models=(MODEL, "m/b")), now=0.0)
    _heard(pool, restarting, _state("w1", ready_in_s=10.0, models=("m/b",)), now=1.0)
    assert restarting.refusal(MODEL, pool.placements(MODEL, 1.0), now=1.0) is None
    assert restarting.refusal("m/b", pool.placements("m/b", 1.0), now=1.0) is not None


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), True, "3"])
def test_a_malformed_ready_in_drops_the_state(bad):
    with pytest.raises(ValueError, match="ready_in_s"):
        PoolView(5.0).update(_state("w1", ready_in_s=bad), now=0.0)


def _refusal(retry_after: int) -> dict:
    from tasks.errors import ErrorCode, ShoalError

    return {"status": "FAILURE", "result": ShoalError(
        ErrorCode.MODEL_UNAVAILABLE, "the model runtime is restarting", retry_after
    ).as_celery_failure()}


def test_a_refusal_says_retry_at_once_while_a_peer_serves_the_model():
    """A restarting worker's Retry-After (its measured start) would keep a polite caller
    away from a peer that serves now: the gateway makes it 1 s. With no peer it stands."""
    from gateway.broker.queue_declarations import ModelQueues
    from gateway.broker.served_models import ServedModels
    from tasks.settings import Settings

    settings = Settings()
    served = ServedModels(settings, ModelQueues(settings, {MODEL: None}), "pool")
    now = time.monotonic()  # what heard_reply reads
    served.restarting.heard_state(served.pool.update(_state("w1", ready_in_s=20.0), now))
    alone = _refusal(20)
    served.heard_reply(MODEL, alone)
    assert alone["result"]["retry_after"] == 20
    served.restarting.heard_state(served.pool.update(_state("w2"), now))
    with_peer = _refusal(20)
    served.heard_reply(MODEL, with_peer)
    assert with_peer["result"]["retry_after"] == 1
