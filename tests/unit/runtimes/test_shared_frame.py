"""A batch's outcomes frame (issue 54): what its results share (model, batch, simulated)
goes once, and the worker reads each result whole again."""

from __future__ import annotations

import copy
import socket
import time

from runtimes.base import Outcome, failed
from runtimes.child_side.pipeline import outcomes_reply
from runtimes.wire import frames, protocol
from tasks.errors import ErrorCode
from tasks.served import give_shared, stamp_batch


def _sent_and_received(outcomes: list[Outcome]) -> tuple[int, frames.Outcomes]:
    a, b = socket.socketpair()
    with a, b:
        payload = protocol.encode_frame(outcomes_reply(outcomes))
        a.sendall(payload)
        reply = protocol.recv_frame(b, frames.BATCH_REPLY_DECODER)
    assert isinstance(reply, frames.Outcomes)
    return len(payload), reply


def _batch(n: int, bad: int | None = None) -> list[Outcome]:
    results = [{"count": 1, "dims": 2, "embeddings": bytes(8), "usage": {"tokens": i}}
               for i in range(n) if i != bad]
    stamp_batch(results, "test/m", [{"items": [{"text": "x"}]}] * len(results),
                time.perf_counter(), {"device": "h100", "a_ms": 1.0}, device_s=0.002)
    ok = iter(results)
    return [failed(f"r{i}", ErrorCode.VALIDATION_ERROR, "bad") if i == bad
            else Outcome(f"r{i}", result=next(ok)) for i in range(n)]


def test_the_batch_facts_travel_once_and_each_result_is_whole_again():
    outcomes = _batch(4, bad=1)
    whole = [copy.deepcopy(o.result) for o in outcomes]
    _, reply = _sent_and_received(outcomes)
    assert reply.shared is not None and set(reply.shared) == {"model", "batch", "simulated"}
    assert all(o.result is None or "batch" not in o.result for o in reply.outcomes)
    give_shared((o.result for o in reply.outcomes), reply.shared)
    assert [o.result for o in reply.outcomes] == whole
    assert reply.outcomes[1].error_code == ErrorCode.VALIDATION_ERROR


def test_the_frame_is_smaller_per_result():
    one, _ = _sent_and_received(_batch(1))
    many, _ = _sent_and_received(_batch(9))
    whole = sum(len(protocol.encode_frame(frames.Outcomes([frames.RunOutcome(
        o.id, o.result)]))) for o in _batch(9))
    assert many < whole - 8 * 100
    assert one < whole / 9 + 20
