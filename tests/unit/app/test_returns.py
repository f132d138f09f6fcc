"""How a worker gives requests back when some of them came in one coalesced message."""

from __future__ import annotations

from app.worker.lifecycle.held import Held
from app.worker.lifecycle.replies import Delivery
from app.worker.lifecycle.returns import plan_returns
from tasks.envelope import Annotations
from tests.fakes import Message


def _held(delivery: Delivery, task_id: str, op: str = "encode") -> Held:
    return Held(delivery, task_id, Annotations("m", op, 1, 1, 1, None, None), b"body")


def test_a_message_whose_every_request_is_returned_goes_back_whole():
    delivery = Delivery(Message(), 3)
    helds = [_held(delivery, f"t{i}") for i in range(3)]
    whole, handed_on = plan_returns(helds)
    assert whole == [delivery] and handed_on == {}


def test_part_of_a_message_is_republished_never_requeued():
    delivery = Delivery(Message(), 3)
    helds = [_held(delivery, f"t{i}") for i in range(3)]
    whole, handed_on = plan_returns(helds[1:])  # t0 stays: it is running, or held
    assert whole == []
    assert handed_on == {("encode", "gw-1", True): helds[1:]}


def test_a_message_with_a_settled_request_is_republished_not_recomputed():
    message = Message()
    delivery = Delivery(message, 2)
    helds = [_held(delivery, "t0"), _held(delivery, "t1")]
    delivery.settle()  # t0 was answered; t1 is returned
    whole, handed_on = plan_returns(helds[1:])
    assert whole == [] and handed_on == {("encode", "gw-1", True): helds[1:]}
    assert message.acks == 0  # the message waits for t1's republish to be confirmed
    delivery.settle()
    assert message.acks == 1


def test_returns_are_grouped_by_caller_and_operation():
    a, b = Delivery(Message("gw-a"), 3), Delivery(Message("gw-b", batch=False), 2)
    helds = [_held(a, "a0"), _held(a, "a1", op="score"), _held(b, "b0"), _held(b, "b1")]
    whole, handed_on = plan_returns([helds[0], helds[1], helds[2]])
    assert whole == []
    assert handed_on == {("encode", "gw-a", True): [helds[0]],
                         ("score", "gw-a", True): [helds[1]],
                         ("encode", "gw-b", False): [helds[2]]}


def test_a_delivery_is_acked_once_and_never_after_a_requeue():
    message = Message()
    delivery = Delivery(message, 2)
    delivery.requeue()
    delivery.settle()
    delivery.settle()
    delivery.requeue()
    assert (message.acks, message.requeues, message.dead) == (0, 1, 0)
    single = Message()
    one = Delivery(single)
    one.settle()
    one.requeue()
    assert (single.acks, single.requeues) == (1, 0)
