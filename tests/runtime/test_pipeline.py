"""Two batches in flight to one runtime process (`runtimes.child_side.pipeline`,
`runtimes.worker_side.process`).

The worker hands its runtime a second batch while the first runs; the child prepares it
meanwhile and answers both in order. A crash or a kill with both in flight must lose
nothing and blame only a poison request; each batch is bisected on its own.
"""

from __future__ import annotations

import os
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from runtimes.base import Outcome, Request
from runtimes.child_side.control import serve_control
from runtimes.child_side.host import ModelHost
from runtimes.wire.frames import CONTROL_REPLY_DECODER, Cancel, Ping, Pong
from runtimes.wire.protocol import recv_frame, send_frame
from runtimes.worker_side.process import ProcessRuntime
from tasks.catalog import Catalog
from tests.slow_batches import SlowBatches
from tests.stack import wait_for as stack_wait_for
from tests.tiny_models import build_tiny_sentence_transformer

TINY, FAULTY = "test/tiny", "test/faulty"
SLOW_S = 1.0
SLOW = SlowBatches(Path(tempfile.mkdtemp(prefix="shoal-pipeline-slow-")), SLOW_S)
CHILD_ENV = SLOW.env
WAIT_S = 120


@pytest.fixture(scope="module")
def catalog_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pipeline")
    weights = build_tiny_sentence_transformer(root / "tiny", pooling="mean", normalize=True)
    directory = root / "catalog"
    directory.mkdir()
    for name, model_id, adapter in (("tiny", TINY, "dense"), ("faulty", FAULTY, "dense-faulty")):
        entry = {"id": model_id, "adapter": adapter, "source": {"path": str(weights)}, "dims": 32}
        (directory / f"{name}.yaml").write_text(yaml.safe_dump(entry))
    return directory


@pytest.fixture(scope="module")
def runtime(catalog_dir: Path):
    with ProcessRuntime(catalog_dir, [TINY, FAULTY], threads=1, start_timeout=60,
                        env=CHILD_ENV, pipeline_depth=2) as runtime:
        yield runtime


def requests(prefix: str, texts: list[str]) -> list[Request]:
    return [Request(f"{prefix}{i}", "encode", {"items": [{"text": t}, {"text": "and more"}]})
            for i, t in enumerate(texts)]


def vectors(outcome: Outcome) -> np.ndarray:
    result = outcome.result
    assert result is not None, (outcome.error_code, outcome.error_message)
    return np.frombuffer(result["embeddings"], "<f4").reshape(result["count"], result["dims"])


class InFlight:
    """Batches run on threads of their own, as the worker's dispatcher runs them."""

    def __init__(self, runtime: ProcessRuntime) -> None:
        self.runtime = runtime
        self.threads: list[threading.Thread] = []
        self.outcomes: dict[str, list[Outcome]] = {}
        self.finished: list[str] = []  # names, in the order their answers came
        self.errors: list[BaseException] = []

    def start(self, name: str, model: str, batch: list[Request]) -> None:
        def run() -> None:
            try:
                self.outcomes[name] = self.runtime.run_batch(model, batch)
                self.finished.append(name)
            except BaseException as exc:
                self.errors.append(exc)

        thread = threading.Thread(target=run, name=f"batch-{name}")
        thread.start()
        self.threads.append(thread)

    def start_two(self, model: str, first: list[Request], second: list[Request]) -> None:
        """`first`, then `second` once the first is on the connection."""
        self.start("first", model, first)
        wait_for(lambda: self.runtime._child is not None and self.runtime._child.turns.sent >= 1)
        self.start("second", model, second)

    def join(self) -> dict[str, list[Outcome]]:
        for thread in self.threads:
            thread.join(WAIT_S)
            assert not thread.is_alive(), "run_batch did not return"
        assert not self.errors, self.errors
        return self.outcomes


def wait_for(condition, timeout: float = WAIT_S) -> None:
    stack_wait_for(condition, timeout, "the condition", interval=0.01)


def assert_all_ok_but(outcomes: list[Outcome], bad: int | None) -> None:
    for i, outcome in enumerate(outcomes):
        assert outcome.ok == (i != bad), (i, outcome.error_code, outcome.error_message)
        if i != bad:
            assert vectors(outcome).shape == (2, 32)


def test_two_batches_in_flight_get_their_own_results_in_order(runtime):
    first, second = requests("a", ["the first batch", "slow @@slow@@"]), \
        requests("b", ["the second batch", "another text"])
    alone = {r.id: vectors(o) for batch in (first, second)
             for r, o in zip(batch, runtime.run_batch(TINY, batch), strict=True)}
    flight = InFlight(runtime)
    flight.start("first", FAULTY, first)  # sleeps in the device stage
    wait_for(lambda: runtime._child is not None and runtime._child.turns.sent >= 1)
    flight.start("second", TINY, second)
    outcomes = flight.join()
    assert flight.finished == ["first", "second"]  # the child answers in the order sent
    for name, batch in (("first", first), ("second", second)):
        assert [o.id for o in outcomes[name]] == [r.id for r in batch]
        for request, outcome in zip(batch, outcomes[name], strict=True):
            np.testing.assert_allclose(vectors(outcome), alone[request.id], rtol=1e-5,
                                       atol=1e-6)


def test_a_batch_off_the_device_while_another_finishes_is_answered_after_it(runtime):
    """The device thread answers a lone batch itself (no finisher's wake-up on its path),
    but only a lone one. The first batch sleeps on the device (the second is read
    meanwhile) and then in its results' stage, on the finisher; the second leaves the
    device meanwhile, the device queue empty: it must still wait for the finisher, and
    be answered second."""
    first = requests("f", ["slow on the device @@slow@@ and then @@slowfinish@@"])
    second = requests("s", ["the second batch", "another text"])
    alone = {r.id: vectors(o) for r, o in zip(second, runtime.run_batch(TINY, second),
                                              strict=True)}
    before = SLOW.started()
    flight = InFlight(runtime)
    flight.start("first", FAULTY, first)
    SLOW.wait_started(before + 1)  # the first is on the device
    flight.start("second", TINY, second)
    outcomes = flight.join()
    assert flight.finished == ["first", "second"]
    assert SLOW.started() == before + 2  # it did sleep in its results' stage too
    assert_all_ok_but(outcomes["first"], None)
    for request, outcome in zip(second, outcomes["second"], strict=True):
        np.testing.assert_allclose(vectors(outcome), alone[request.id], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("killed", ["first", "second"])
def test_a_kill_with_two_batches_in_flight_loses_nothing(runtime, killed):
    """SIGKILL (an OOM kill) while one batch computes and another is in flight: both are
    run again on the next child, every request answered once, nobody blamed."""
    pid, restarts, poison = runtime.pid, runtime.restarts, runtime.poison_isolated
    slow = [f"t{i}" for i in range(3)] + ["@@slow@@"]
    fast = [f"u{i}" for i in range(4)]
    first, second = (slow, fast) if killed == "first" else (fast, slow)
    flight = InFlight(runtime)
    started = SLOW.started()
    SLOW.hold()
    try:
        flight.start_two(FAULTY, requests("a", first), requests("b", second))
        wait_for(lambda: runtime._child is not None and runtime._child.turns.sent >= 2)
        if killed == "second":
            wait_for(lambda: "first" in flight.finished)
        SLOW.wait_started(started + 1)  # the slow batch sleeps in the child's device stage
        os.kill(pid, signal.SIGKILL)
    finally:
        SLOW.release()  # run again on the next child, it sleeps SLOW_S only
    outcomes = flight.join()
    assert_all_ok_but(outcomes["first"], bad=None)
    assert_all_ok_but(outcomes["second"], bad=None)
    assert runtime.pid != pid and runtime.restarts == restarts + 1
    assert runtime.poison_isolated == poison


@pytest.mark.parametrize("marker", ["@@crash@@", "@@raise@@"])
@pytest.mark.parametrize("poisoned", ["first", "second"])
def test_a_poison_request_with_two_batches_in_flight_is_blamed_alone(runtime, marker,
                                                                      poisoned):
    poison = runtime.poison_isolated
    bad = [f"t{i}" if i != 2 else f"t{i} {marker}" for i in range(8)]
    good = [f"u{i}" for i in range(8)]
    first, second = (bad, good) if poisoned == "first" else (good, bad)
    flight = InFlight(runtime)
    flight.start_two(FAULTY, requests("a", first), requests("b", second))
    outcomes = flight.join()
    for name in ("first", "second"):
        assert_all_ok_but(outcomes[name], bad=2 if name == poisoned else None)
    blamed = outcomes[poisoned][2]
    assert blamed.error_code == "POISON_INPUT"
    assert runtime.poison_isolated == poison + 1
    # The runtime serves on.
    assert_all_ok_but(runtime.run_batch(TINY, requests("c", ["after"])), bad=None)


def test_a_streamless_batch_waits_for_a_probe_and_both_are_answered(runtime):
    """A probe goes alone on the connection: it waits for the batch in flight."""
    flight = InFlight(runtime)
    flight.start("slow", FAULTY, requests("a", ["@@slow@@"]))
    wait_for(lambda: runtime._child is not None and runtime._child.turns.sent >= 1)
    assert runtime.probe(TINY) is None
    assert "slow" in flight.finished  # the probe's answer came after the batch's
    assert_all_ok_but(flight.join()["slow"], bad=None)


def cancel_in_the_child(runtime: ProcessRuntime, ids: list[str]) -> None:
    """Cancel `ids`, then wait until the child has taken the cancel: its control
    connection reads frames in order, so the answer to a ping sent after it says so."""
    runtime.cancel(ids)
    assert isinstance(runtime._controls.call(Ping(), "pinging"), Pong)


@pytest.mark.parametrize("cancelled", ["all", "one"])
def test_a_revoked_batch_behind_the_device_skips_it(runtime, cancelled):
    """Issue 41: a batch prepared behind the one on the device, all of whose requests
    are revoked meanwhile, never reaches the model: its requests are answered CANCELLED.
    The batch on the device finishes. Issue 53: a batch with a request still wanted runs
    without the revoked ones (planned again without them), which never reach the model."""
    started = SLOW.started()
    first = requests("a", ["held on the device @@slow@@", "beside it"])
    second = requests("b", ["behind it @@slow@@", "another text"])
    revoked = [r.id for r in second] if cancelled == "all" else [second[0].id]
    flight = InFlight(runtime)
    SLOW.hold()
    try:
        flight.start("first", FAULTY, first)
        SLOW.wait_started(started + 1)  # the first batch sleeps in the device stage
        flight.start("second", FAULTY, second)
        wait_for(lambda: runtime._child is not None and runtime._child.turns.sent >= 2)
        # The first batch's too: it is on the device already, and finishes.
        cancel_in_the_child(runtime, [*revoked, *(r.id for r in first)])
    finally:
        SLOW.release()
    outcomes = flight.join()
    assert flight.finished == ["first", "second"]
    assert_all_ok_but(outcomes["first"], bad=None)
    assert [o.id for o in outcomes["second"]] == [r.id for r in second]
    for outcome in outcomes["second"]:
        if outcome.id in revoked:
            assert outcome.error_code == "CANCELLED", (outcome.error_code,
                                                       outcome.error_message)
            assert "before its batch reached the device" in outcome.error_message
        else:
            assert vectors(outcome).shape == (2, 32)
    assert SLOW.started() == started + 1  # its own @@slow@@ (the revoked one) never ran
    # The runtime serves on, and forgot the ids (a later batch of them runs).
    assert_all_ok_but(runtime.run_batch(TINY, requests("b", ["after"])), bad=None)


def test_a_batch_whose_deadline_passed_behind_the_device_never_reaches_it(runtime):
    """Issue 53: a batch waiting in the runtime process behind a slow one on the device is
    past its requests' deadlines when the device is free: they are answered
    DEADLINE_EXCEEDED and never computed (its @@slow@@ never runs); a request of it with
    time left runs."""
    started = SLOW.started()
    first = requests("dl-a", ["held on the device @@slow@@"])
    now_ms = time.time() * 1000
    late = Request("dl-b0", "encode", {"items": [{"text": "behind it @@slow@@"}]},
                   deadline_ms=now_ms + 300)
    kept = Request("dl-b1", "encode", {"items": [{"text": "with time"}, {"text": "left"}]},
                   deadline_ms=now_ms + 600_000)
    flight = InFlight(runtime)
    SLOW.hold()
    try:
        flight.start("first", FAULTY, first)
        SLOW.wait_started(started + 1)
        flight.start("second", FAULTY, [late, kept])
        wait_for(lambda: runtime._child is not None and runtime._child.turns.sent >= 2)
        wait_for(lambda: time.time() * 1000 > late.deadline_ms)  # held past it
    finally:
        SLOW.release()
    outcomes = flight.join()
    assert_all_ok_but(outcomes["first"], bad=None)
    dropped, ran = outcomes["second"]
    assert dropped.error_code == "DEADLINE_EXCEEDED", (dropped.error_code,
                                                       dropped.error_message)
    assert "before its batch reached the device" in (dropped.error_message or "")
    assert vectors(ran).shape == (2, 32)
    assert SLOW.started() == started + 1  # the late request's @@slow@@ never ran


def test_the_control_connection_takes_a_cancel_unanswered_and_a_batch_all_cancelled_skips(
        catalog_dir):
    """The child's side in one process: a `Cancel` on the control connection is taken
    without an answer (the next frame's is the next reply), and a batch (unpipelined:
    `ModelHost.run_batch`) whose requests were all cancelled skips its device work."""
    host = ModelHost(threads=1)
    catalog = Catalog.from_dir(catalog_dir)
    host.load(catalog.require([TINY]))
    worker, child = socket.socketpair()
    serving = threading.Thread(target=serve_control, args=(child, host, catalog))
    serving.start()
    with worker, child:
        send_frame(worker, Cancel(["c0", "c1", "d0"]))
        send_frame(worker, Ping())
        assert recv_frame(worker, CONTROL_REPLY_DECODER) == Pong(os.getpid())
        cancelled = host.run_batch(TINY, requests("c", ["one", "two"]))
        assert [o.error_code for o in cancelled] == ["CANCELLED", "CANCELLED"]
        assert host.skipped == 1
        # Only partly cancelled: it runs without the cancelled one. Then the ids are
        # forgotten.
        partly = host.run_batch(TINY, requests("d", ["one", "two"]))
        assert [o.error_code for o in partly] == ["CANCELLED", None]
        assert vectors(partly[1]).shape == (2, 32)
        assert_all_ok_but(host.run_batch(TINY, requests("c", ["again"])), bad=None)
        assert host.skipped == 1
        worker.shutdown(socket.SHUT_RDWR)
        serving.join(WAIT_S)
        assert not serving.is_alive()
