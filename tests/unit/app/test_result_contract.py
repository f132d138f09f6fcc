"""Result contract 2 (issue 54): what a batch's results share (model, batch, simulated,
worker) travels once per reply message to a sender that said it reads it so, and every
reader still sees whole results; any other sender gets whole results on the wire."""

from __future__ import annotations

import copy
import time
from typing import Any

import msgpack

from app.worker.lifecycle.replies import Delivery, Replier
from tasks.envelope import (
    H_MULTI,
    H_RESULT_CONTRACT,
    Annotations,
    Part,
    coalesce,
    decode_results,
    single_message,
)
from tasks.served import (
    RESULT_CONTRACT,
    give_shared,
    read_served,
    stamp_batch,
    stamp_delivery,
    stamp_parts,
    take_shared,
)
from tests.fakes import Message

MODEL = "test/m"
SIMULATED = {"device": "h100", "a_ms": 1.0, "b_us": 2.0, "c_ns": 3.0, "speed": 1.0}


class Channel:
    def __init__(self) -> None:
        self.events: dict[str, set] = {"basic_ack": set(), "basic_nack": set()}
        self.published: list[tuple[str, Any]] = []

    def confirm_select(self) -> None:
        pass

    def basic_publish(self, message: Any, exchange: str, routing_key: str) -> None:
        self.published.append((routing_key, message))


class Connection:
    def __init__(self) -> None:
        self.opened = Channel()

    def channel(self) -> Channel:
        return self.opened


class Consumer:
    hostname = "celery@w1"
    event_dispatcher = None


def _results(n: int, contract: int = 1) -> list[dict[str, Any]]:
    """A batch's results as the runtime and the worker stamp them (`Answers._succeed`:
    without the worker where the reply message says it, contract 2)."""
    results = [{"output": "dense", "dims": 2, "count": 1, "dtype": "float32",
                "embeddings": bytes(8), "usage": {"tokens": 3 + i}} for i in range(n)]
    stamp_batch(results, MODEL, [{"items": [{"text": "x"}]}] * n, time.perf_counter(),
                SIMULATED, device_s=0.001)
    now = time.time()
    for i, result in enumerate(results):
        stamp_delivery(result, 0.5 + i, Consumer.hostname if contract == 1 else None,
                       now - 0.01, now - 0.005, now)
    return results


def _whole(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**copy.deepcopy(r), "worker": Consumer.hostname} for r in results]


def _answer(headers: dict[str, Any] | list[dict[str, Any]], results: list[dict[str, Any]]
            ) -> tuple[Any, int]:
    """`results` answered in one batch to senders of messages with `headers` (each its
    own, given a list): the one reply message published, and its size."""
    connection = Connection()
    replier = Replier(Consumer())
    replier.open(connection)
    replier.begin_batch()
    for i, result in enumerate(results):
        delivery = Delivery(Message(headers=headers[i] if isinstance(headers, list)
                                    else headers))
        replier.success(delivery, f"t{i}", result, 0.01)
    replier.end_batch()
    ((routing_key, message),) = connection.opened.published
    assert routing_key == "gw-1"
    assert message.properties["application_headers"].get(H_MULTI)
    return message, len(message.body)


def test_a_sender_reading_contract_2_gets_the_shared_facts_once_and_whole_results():
    results = _results(3, contract=2)
    whole = _whole(results)
    message, _ = _answer({H_RESULT_CONTRACT: 2}, results)
    raw = msgpack.unpackb(message.body, raw=False)
    assert set(raw["shared"]) == {"model", "batch", "simulated", "worker"}
    assert set(raw["envelope"]) == {"traceback", "children", "date_done"}
    for entry in raw["results"]:
        assert set(entry) == {"task_id", "status", "result"}
        assert not {"model", "batch", "simulated", "worker"} & set(entry["result"])
        assert "timing" in entry["result"]  # its own: queue time and clocks differ
    decoded = decode_results(message.body, multi=True)
    assert [r["result"] for r in decoded] == whole
    assert all(r["traceback"] is None and r["children"] == []
               and r["date_done"] == raw["envelope"]["date_done"] for r in decoded)
    served = read_served(decoded[1]["result"])
    assert served.model == MODEL and served.worker == Consumer.hostname
    assert served.batch is not None and served.batch["requests"] == 3
    assert served.simulated == SIMULATED and served.timing["queue_ms"] == 1.5


def test_a_sender_without_the_version_gets_every_result_whole():
    """A Celery client, an older gateway: no H_RESULT_CONTRACT, today's dicts."""
    results = _results(3)
    whole = copy.deepcopy(results)
    message, _ = _answer({}, results)
    raw = msgpack.unpackb(message.body, raw=False)
    assert "shared" not in raw
    assert [entry["result"] for entry in raw["results"]] == whole


def test_the_reply_is_smaller_with_the_facts_once():
    """Per result, the facts leave it; a reply of one result is sent whole (it shares
    nothing, and "shared" would only add its key)."""
    _, old = _answer({}, _results(1))
    _, new = _answer({H_RESULT_CONTRACT: 2}, _results(1, contract=2))
    _, old8 = _answer({}, _results(8))
    _, new8 = _answer({H_RESULT_CONTRACT: 2}, _results(8, contract=2))
    assert new == old
    assert (old8 - new8) / 7 > 150  # model, batch, simulated, worker, rpc envelope


def test_a_fact_one_result_has_otherwise_stays_in_it():
    """A split request's joined result has its own batch (all its parts')."""
    results = _results(3, contract=2)
    stamp_parts(results[2], 12.5, 2)
    whole = _whole(results)
    message, _ = _answer({H_RESULT_CONTRACT: 2}, results)
    raw = msgpack.unpackb(message.body, raw=False)
    assert set(raw["shared"]) == {"model", "simulated", "worker"}
    assert all("batch" in entry["result"] for entry in raw["results"])
    decoded = decode_results(message.body, multi=True)
    assert [r["result"] for r in decoded] == whole
    assert read_served(decoded[2]["result"]).batch["parts"] == 2


def test_a_malformed_shared_field_is_ignored_not_a_crash():
    body = msgpack.packb({"results": [{"task_id": "a", "status": "SUCCESS",
                                       "result": {"count": 1}}], "shared": [1, 2]})
    (result,) = decode_results(body, multi=True)
    assert result["result"] == {"count": 1}


def test_gateway_messages_ask_for_the_contract_and_celery_headers_do_not():
    part = Part("t1", Annotations(MODEL, "encode", 1, 10, 10, None, None), b"")
    assert single_message(part, "gw").headers[H_RESULT_CONTRACT] == RESULT_CONTRACT
    assert coalesce(MODEL, "encode", [part], "gw").headers[H_RESULT_CONTRACT] == \
        RESULT_CONTRACT
    # A worker handing back an older gateway's members keeps what that gateway reads.
    assert H_RESULT_CONTRACT not in coalesce(MODEL, "encode", [part], "w", contract=1).headers
    assert Delivery(Message()).contract == 1
    assert Delivery(Message(headers={H_RESULT_CONTRACT: "2"})).contract == 1


def test_only_what_every_result_has_alike_is_taken_out():
    batch = {"requests": 2, "items": 2, "inference_ms": 1.0}
    lacks = [{"model": MODEL, "batch": batch, "n": 1}, {"model": MODEL, "n": 2}]
    assert take_shared(lacks) == {"model": MODEL}
    assert lacks == [{"batch": batch, "n": 1}, {"n": 2}]
    equal = [{"model": MODEL, "batch": batch}, {"model": MODEL, "batch": dict(batch)}]
    assert take_shared(equal) == {"model": MODEL, "batch": batch} and equal == [{}, {}]
    other = [{"model": MODEL}, {"model": "test/other"}]
    assert take_shared(other) is None and other == [{"model": MODEL}, {"model": "test/other"}]
    assert take_shared([{"model": MODEL}]) is None  # one result: sent whole
    given = [{"n": 1}, {"n": 2, "model": "mine"}, "not a result"]
    give_shared(given, {"model": MODEL, "injected": 1})
    assert given == [{"n": 1, "model": MODEL}, {"n": 2, "model": "mine"}, "not a result"]


def test_senders_of_both_contracts_on_one_reply_queue_each_read_whole_results():
    """The jobs' reply queue is every gateway's: while two versions run, one reply message
    may answer both; an older gateway's results stay whole on the wire."""
    old, new = _results(2), _results(3, contract=2)
    stamp_batch(old + new, MODEL, [{"items": [{"text": "x"}]}] * 5, time.perf_counter(),
                SIMULATED, device_s=0.001)  # one batch
    whole = copy.deepcopy(old) + _whole(new)
    message, _ = _answer([{}, {}, {H_RESULT_CONTRACT: 2}, {H_RESULT_CONTRACT: 2},
                          {H_RESULT_CONTRACT: 2}], old + new)
    raw = msgpack.unpackb(message.body, raw=False)
    assert all({"model", "batch", "worker", "date_done"} <= {*e, *e["result"]}
               for e in raw["results"][:2])
    assert all("batch" not in e["result"] for e in raw["results"][2:])
    assert [r["result"] for r in decode_results(message.body, multi=True)] == whole
