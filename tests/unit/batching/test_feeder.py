"""The continuous runtime's feeder: room, order, deadlines, returns to peers."""

from __future__ import annotations

from batching.feeder import Feeder, Load, Waiting, room


def waiting(name: str, at: float = 0.0, deadline: float | None = None,
            deliveries: int = 1) -> Waiting:
    return Waiting(name, at, deadline, deliveries)


def test_room_counts_free_slots_and_what_was_handed_over():
    assert room(Load(running=2, waiting=0, max_running=8), in_flight=0) == 6
    # Handed over but not reported yet: counted.
    assert room(Load(running=2, waiting=0, max_running=8), in_flight=5) == 3
    assert room(Load(running=8, waiting=3, max_running=8), in_flight=0) == 0
    # A full KV cache takes nothing, whatever the slots.
    assert room(Load(running=1, waiting=0, max_running=8, tokens=4096, max_tokens=4096), 1) == 0


def test_take_hands_over_the_oldest_first_within_room():
    feeder = Feeder(return_after_s=0.2, delivery_limit=20)
    for name in "abcd":
        feeder.add("m", waiting(name))
    taken = feeder.take("m", Load(running=0, waiting=0, max_running=3))
    assert [w.handle for w in taken] == ["a", "b", "c"]
    for w in taken:
        feeder.started("m", w.handle, w.handle)
    assert feeder.take("m", Load(running=3, waiting=0, max_running=3)) == []
    feeder.done("m", "a")
    assert [w.handle for w in feeder.take("m", Load(running=2, waiting=0, max_running=3))] == ["d"]
    assert feeder.counts() == {"m": 2}  # b and c handed over; d taken, not yet started


def test_expired_requests_leave_and_the_next_deadline_wakes():
    feeder = Feeder(return_after_s=10, delivery_limit=20)
    feeder.add("m", waiting("late", deadline=1.0))
    feeder.add("m", waiting("soon", deadline=5.0))
    assert feeder.wake_in(0.0, {}) == 1.0
    assert [(m, w.handle) for m, w in feeder.expired(2.0)] == [("m", "late")]
    assert feeder.wake_in(2.0, {}) == 3.0


def test_returns_only_to_peers_after_the_wait_and_within_the_delivery_limit():
    feeder = Feeder(return_after_s=0.2, delivery_limit=20)
    feeder.add("m", waiting("old", at=0.0))
    feeder.add("m", waiting("worn", at=0.0, deliveries=11))
    feeder.add("m", waiting("new", at=0.15))
    assert feeder.returns("m", 1.0, peers=1) == []  # nobody else to take them
    assert feeder.wake_in(0.0, {"m": 2}) == 0.2
    assert [w.handle for w in feeder.returns("m", 0.25, peers=2)] == ["old"]
    assert [w.handle for w in feeder.waiting["m"]] == ["worn", "new"]


def test_drop_and_clear():
    feeder = Feeder(return_after_s=0.2, delivery_limit=-1)
    feeder.add("m", waiting("a"))
    feeder.started("m", "b", "b")
    assert [w.handle for w in feeder.drop("m")] == ["a"]
    feeder.clear()
    assert feeder.counts() == {}


def test_a_request_with_the_id_of_one_in_flight_waits_for_it():
    feeder = Feeder(return_after_s=0.2, delivery_limit=20)
    feeder.add("m", Waiting("first", 0.0, None, 1, key="t1"))
    feeder.add("m", Waiting("copy", 0.1, None, 1, key="t1"))
    feeder.add("m", Waiting("other", 0.2, None, 1, key="t2"))
    load = Load(running=0, waiting=0, max_running=8)
    assert [w.handle for w in feeder.take("m", load)] == ["first", "other"]
    feeder.started("m", "t1", "first")
    feeder.started("m", "t2", "other")
    assert feeder.take("m", load) == []  # t1 still runs
    feeder.done("m", "t1")
    assert [w.handle for w in feeder.take("m", load)] == ["copy"]
