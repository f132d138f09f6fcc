"""A batch's frame sent ahead by the worker's loop (`ProcessRuntime.send_ahead`): the same
results, and every failure settled as for a frame the batch's thread sent itself (crash,
hang, poison, a kill before the reply), the connection in step after a discarded one.

One real runtime process (the tiny models of test_process) is shared by the module.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import numpy as np
import pytest

from runtimes.base import Outcome, Request
from runtimes.worker_side.process import ProcessRuntime
from tests.runtime.test_process import (
    CHILD_ENV,
    FAULTY,
    SLOW,
    SLOW_S,
    TINY,
    assert_all_ok_but,
    batch,
    catalog_dir,  # noqa: F401  (a fixture)
    eight_with,
    encode,
    vectors,
)


@pytest.fixture(autouse=True)
def _no_batch_held():
    yield
    SLOW.release()


@pytest.fixture(scope="module")
def runtime(catalog_dir: Path):  # noqa: F811
    with ProcessRuntime(catalog_dir, [TINY, FAULTY], threads=1, start_timeout=60,
                        env=CHILD_ENV) as runtime:
        yield runtime


def run_ahead(runtime: ProcessRuntime, model: str, requests: list[Request]) -> list[Outcome]:
    ahead = runtime.send_ahead(model, requests)
    assert ahead is not None
    return runtime.run_batch(model, requests, ahead=ahead)


def test_a_batch_sent_ahead_gets_the_results_of_one_run_as_usual(runtime):
    requests = batch(encode("The cat sits on the mat.", "Grüße aus Köln"),
                     encode("dims", dimensions=8, normalize=False))
    usual = runtime.run_batch(TINY, requests)
    ahead = run_ahead(runtime, TINY, requests)
    assert [o.id for o in ahead] == ["r0", "r1"]
    for a, b in zip(ahead, usual, strict=True):
        np.testing.assert_allclose(vectors(a), vectors(b), rtol=1e-6)


def test_nothing_is_sent_ahead_while_a_frame_is_in_flight_or_for_a_stream(runtime):
    first = batch(encode("one"))
    ahead = runtime.send_ahead(TINY, first)
    assert ahead is not None
    # The loop never waits: with a frame in flight it sends nothing.
    assert runtime.send_ahead(TINY, [Request("r9", "encode", encode("two"))]) is None
    (outcome,) = runtime.run_batch(TINY, first, ahead=ahead)
    assert outcome.ok
    streamed = [Request("s", "encode", encode("x"), stream=True)]
    assert runtime.send_ahead(TINY, streamed) is None
    assert runtime.send_ahead(TINY, batch(encode("word " * 20_000))) is None  # too large


def test_a_batch_behind_one_sent_ahead_reads_its_own_reply(runtime):
    """Pipelining: a batch from another thread goes behind the frame sent ahead."""
    first, second = batch(encode("first")), [Request("b0", "encode", encode("second"))]
    ahead = runtime.send_ahead(TINY, first)
    assert ahead is not None
    behind: list[list[Outcome]] = []
    thread = threading.Thread(target=lambda: behind.append(runtime.run_batch(TINY, second)))
    thread.start()
    (one,) = runtime.run_batch(TINY, first, ahead=ahead)
    thread.join(30)
    assert behind and one.id == "r0" and one.ok
    assert [o.id for o in behind[0]] == ["b0"] and behind[0][0].ok


def test_a_crashing_request_sent_ahead_is_isolated_and_the_runtime_restarts(runtime):
    pid, poison = runtime.pid, runtime.poison_isolated
    outcomes = run_ahead(runtime, FAULTY, eight_with("@@crash@@", at=3))
    assert_all_ok_but(outcomes, bad=3)
    assert outcomes[3].error_code == "POISON_INPUT"
    assert runtime.pid != pid and runtime.poison_isolated == poison + 1
    assert_all_ok_but(run_ahead(runtime, FAULTY, eight_with("", at=0)), bad=None)


def test_a_kill_before_the_reply_blames_nobody(runtime):
    pid, restarts, poison = runtime.pid, runtime.restarts, runtime.poison_isolated
    requests = batch(encode("t0", "@@slow@@"), encode("t1", "x"))
    started = SLOW.started()
    SLOW.hold()
    ahead = runtime.send_ahead(FAULTY, requests)
    assert ahead is not None
    SLOW.wait_started(started + 1)  # the frame is in the child, its batch held there
    os.kill(pid, signal.SIGKILL)
    SLOW.release()
    outcomes = runtime.run_batch(FAULTY, requests, ahead=ahead)
    assert_all_ok_but(outcomes, bad=None)
    assert runtime.pid != pid and runtime.restarts == restarts + 1
    assert runtime.poison_isolated == poison


def test_a_failed_send_ahead_is_settled_by_the_batch_thread(runtime):
    """The loop's send fails (the connection broke): the batch's thread replaces the child
    and runs the batch again; the lone request's first failure is not its fault."""
    child = runtime._child
    assert child is not None and child.sock is not None
    pid, poison = runtime.pid, runtime.poison_isolated
    child.sock.close()  # the send can only fail now
    requests = batch(encode("after", "the break"))
    ahead = runtime.send_ahead(TINY, requests)
    assert ahead is not None and isinstance(ahead.error, OSError)
    (outcome,) = runtime.run_batch(TINY, requests, ahead=ahead)
    assert outcome.ok and vectors(outcome).shape == (2, 32)
    assert runtime.pid != pid and runtime.poison_isolated == poison


def test_nothing_is_sent_ahead_to_a_child_that_died_while_idle(runtime):
    child = runtime._child
    assert child is not None
    os.kill(child.pid, signal.SIGKILL)
    child.proc.wait(10)
    requests = batch(encode("after", "the kill"))
    assert runtime.send_ahead(TINY, requests) is None  # the thread's start replaces it
    (outcome,) = runtime.run_batch(TINY, requests)
    assert outcome.ok and runtime.pid != child.pid


def test_a_discarded_frame_sends_the_next_batch_to_a_fresh_child(runtime):
    pid = runtime.pid
    ahead = runtime.send_ahead(TINY, batch(encode("never read")))
    assert ahead is not None
    ahead.discard()  # its batch will not run (the worker shut down meanwhile)
    (outcome,) = runtime.run_batch(TINY, batch(encode("next")))
    assert outcome.ok and runtime.pid != pid


def test_a_hung_request_sent_ahead_is_killed_after_the_batch_timeout(catalog_dir):  # noqa: F811
    with ProcessRuntime(catalog_dir, [FAULTY], threads=1, start_timeout=60, env=CHILD_ENV,
                        batch_timeout=SLOW_S / 2) as runtime:
        pid = runtime.pid
        hung, fine = run_ahead(runtime, FAULTY, batch(encode("@@slow@@"), encode("fine")))
        assert hung.error_code == "POISON_INPUT" and "batch timeout" in hung.error_message
        assert fine.ok and runtime.pid != pid
