"""A worker's drain on SIGTERM: which signal does what, how requests near the delivery
limit are handed back, and the drain's own state and decisions, pure (the whole drain runs
end to end in tests/e2e/test_worker_shutdown.py)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
from celery.worker import state as worker_state

from app.worker.lifecycle.decisions import GiveBack
from app.worker.lifecycle.drain import Drain
from app.worker.lifecycle.held import Held
from app.worker.lifecycle.replies import Delivery
from app.worker.lifecycle.returns import plan_returns
from app.worker.shutdown import GracefulShutdown
from tasks.envelope import Annotations
from tests.fakes import Hub, Message


def test_a_message_that_must_keep_its_delivery_count_is_republished_whole():
    fresh, worn = Delivery(Message(batch=False)), Delivery(Message(batch=False))
    helds = [Held(d, t, Annotations("m", "encode", 1, 1, 1, None, None), b"body")
             for d, t in ((fresh, "a"), (worn, "b"))]
    whole, handed_on = plan_returns(helds, renew=lambda d: d is worn)
    assert whole == [fresh]
    assert handed_on == {("encode", "gw-1", False): [helds[1]]}


@pytest.fixture
def handlers() -> Iterator[list[int]]:
    """Celery's handlers stand-in (records the signals it got); restored afterwards."""
    got: list[int] = []
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in saved:
        signal.signal(sig, lambda signum, frame: got.append(signum))
    yield got
    for sig, handler in saved.items():
        signal.signal(sig, handler)
    worker_state.should_stop = worker_state.should_terminate = None


@pytest.fixture
def no_watchdog(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    armed: list[float] = []
    monkeypatch.setattr(GracefulShutdown, "_watchdog", lambda self, s: armed.append(s))
    return armed


def _shutdown() -> tuple[GracefulShutdown, list[str]]:
    calls: list[str] = []
    graceful = GracefulShutdown(25.0, lambda: calls.append("drain"),
                                lambda why: calls.append(f"force: {why}"))
    return graceful, calls


def test_the_first_sigterm_drains_the_second_forces(handlers, no_watchdog):
    graceful, calls = _shutdown()
    hub = Hub()
    graceful.attach(hub)
    os.kill(os.getpid(), signal.SIGTERM)
    hub.run_soon()
    assert calls == ["drain"] and graceful.draining
    assert hub.later[0][0] == pytest.approx(25.0, abs=1.0)  # the grace
    assert no_watchdog == [25.0 + 4.0]
    assert handlers == []  # Celery's warm shutdown waits for the drain

    os.kill(os.getpid(), signal.SIGTERM)
    hub.run_soon()
    assert calls == ["drain", "force: a second signal (SIGTERM)"]
    assert worker_state.should_terminate == 1  # Celery's cold shutdown
    assert handlers == []


def test_a_finished_drain_hands_over_to_celerys_warm_shutdown(handlers, no_watchdog):
    graceful, calls = _shutdown()
    hub = Hub()
    graceful.attach(hub)
    os.kill(os.getpid(), signal.SIGINT)
    hub.run_soon()
    graceful.finish()
    assert handlers == [signal.SIGTERM]  # Celery's SIGTERM handler: warm, exit code 0
    graceful.force("too late")
    assert calls == ["drain"]


def test_a_signal_while_nothing_is_consumed_goes_to_celery(handlers, no_watchdog):
    graceful, calls = _shutdown()
    graceful.attach(Hub())
    graceful.detach()  # the connection was lost: nothing is held
    os.kill(os.getpid(), signal.SIGTERM)
    assert handlers == [signal.SIGTERM] and calls == [] and no_watchdog == []


# --- the drain's state and decisions (`app.worker.lifecycle.drain.Drain`), pure ------------


def _held(task_id: str, deliveries: int = 1) -> Held:
    message = Message(batch=False, headers={"x-delivery-count": deliveries - 1})
    return Held(Delivery(message), task_id, Annotations("m", "encode", 1, 1, 1, None, None),
                b"body")


def test_a_drain_gives_back_what_has_not_started_and_counts_it():
    drain = Drain({"m", "n"}, delivery_limit=4, quiet=lambda: False)
    fresh, worn = _held("a"), _held("b", deliveries=3)
    back = drain.begin({"m": [fresh, worn], "n": []})
    assert drain.active and drain.begun and drain.handed_back == 2
    assert back == [GiveBack("m", [fresh, worn], back[0].renew)]  # nothing for "n"
    # A requeue would bring "b" near the queue's delivery limit: republished instead.
    renew = back[0].renew
    assert renew is not None and not renew(fresh.delivery) and renew(worn.delivery)


def test_a_drain_is_over_once_quiet_outside_every_answering_stretch_and_says_so_once():
    quiet = [False]
    drain = Drain({"m"}, delivery_limit=-1, quiet=lambda: quiet[0])
    drained: list[bool] = []
    drain.on_drained = lambda: drained.append(True)
    quiet[0] = True
    drain.check()
    assert not drained  # not draining yet
    drain.begin({})
    with drain:  # a batch's answers going out
        with drain:  # the tick it starts
            drain.check()
        assert not drained  # the outer stretch is still answering
    assert drained == [True]  # its end checked
    drain.check()
    assert drained == [True]  # once


def test_a_message_delivered_while_draining_goes_straight_back():
    drain = Drain({"m"}, delivery_limit=-1, quiet=lambda: True)
    message = Message(headers={"shoal_model": "m"})
    drain.refuse(message)
    assert message.requeues == 1 and drain.handed_back == 1
