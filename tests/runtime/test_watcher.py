"""A runtime child that dies between batches is replaced when it dies
(`runtimes.worker_side.watcher`), and a refusal during a failed restart says how long the
replacement should take, from the starts measured (`runtimes.worker_side.start_times`).

Real child processes on tiny models; no batch is sent before the replacement is checked:
the watcher, not a batch, must have noticed the death. Each test starts its own runtime:
they kill its processes.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time

import pytest

from runtimes.base import Request
from runtimes.worker_side.process import ProcessRuntime
from runtimes.worker_side.replicas import ReplicaSet
from tests.runtime.test_spare import (
    CHILD_ENV,
    FAULTY,
    START_S,
    TINY,
    assert_all_ok,
    catalog_dir,  # noqa: F401 (a fixture)
    encode,
    listening,
    started,
    weights,  # noqa: F401 (a fixture)
)
from tests.stack import wait_for


def batch(size: int) -> list[Request]:
    return [Request(f"r{i}", "encode", encode(f"t{i}")) for i in range(size)]


def replaced(runtime: ProcessRuntime, dead: int) -> bool:
    return runtime.pid not in (None, dead) and runtime.up


@pytest.mark.parametrize("spare", [False, True], ids=["fresh-child", "spare"])
def test_an_idle_child_that_dies_is_replaced_when_it_dies(catalog_dir, spare):  # noqa: F811
    with started(catalog_dir, [FAULTY], spare=spare) as runtime:
        pid, spare_pid = runtime.pid, runtime.spare_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        # No batch is sent: only the watcher can bring the replacement up.
        wait_for(lambda: replaced(runtime, pid), START_S, "the replacement to be up")
        assert runtime.deaths_noticed == 1 and runtime.restarts == 1
        if spare:
            assert runtime.pid == spare_pid and runtime.spare_promotions == 1
        assert_all_ok(runtime.run_batch(FAULTY, batch(2)), 2)
        assert runtime.restarts == 1  # the batch found it up: no second restart


def test_an_idle_replica_that_dies_is_replaced_and_the_others_are_untouched(catalog_dir):  # noqa: F811
    def start(index: int, env: dict[str, str]) -> ProcessRuntime:
        return ProcessRuntime(catalog_dir, [TINY], threads=1, start_timeout=START_S,
                              env={**CHILD_ENV, **env})

    replicas = ReplicaSet(start, 2)
    try:
        victim, other = replicas.replicas
        victim_pid, other_pid = victim.pid, other.pid
        assert victim_pid is not None
        os.kill(victim_pid, signal.SIGKILL)
        wait_for(lambda: replaced(victim, victim_pid), START_S, "the replica's replacement")
        assert other.pid == other_pid and other.restarts == 0
        assert replicas.restarts == 1 and victim.deaths_noticed == 1
    finally:
        replicas.close()


def test_a_failed_restart_says_the_measured_start_and_is_served_once_it_listens(catalog_dir):  # noqa: F811
    """The runtime dies, then its promoted spare while it loads (held stopped, so the kill
    surely comes first); the next spare is held stopped mid-import. Batches are refused
    with the seconds the last spare took to import (not 1), `ready_in` says the same to
    the worker's pool state, and once the next spare listens the watcher brings it up
    with no batch asking."""
    with started(catalog_dir, [FAULTY, TINY], answer_while_restarting=True) as runtime:
        first, spare = runtime.pid, runtime.spare_pid
        assert first is not None and spare is not None
        held: list[int] = []
        try:
            os.kill(spare, signal.SIGSTOP)  # promoted, it cannot load before it is killed
            os.kill(first, signal.SIGKILL)
            wait_for(lambda: runtime.pid == spare, 30, "the spare's promotion", interval=0.01)
            nxt = wait_for(lambda: (p := runtime.spare_pid) not in (None, spare) and p, 30,
                           "the next spare", interval=0.01)
            os.kill(nxt, signal.SIGSTOP)
            held.append(nxt)
            assert not listening(nxt)
            os.kill(spare, signal.SIGKILL)
            wait_for(lambda: runtime.ready_in(FAULTY) is not None, 30, "the refusals")

            times = runtime._children.start_times
            assert times.spare_s is not None and times.spare_s > 1.0  # the spare's import
            expected = times.spare_s + (times.promotion_s or 0.0)
            since = time.monotonic() - runtime._children.child.started
            outcomes = runtime.run_batch(FAULTY, batch(2))
            for outcome in outcomes:
                assert outcome.error_code == "MODEL_UNAVAILABLE", outcome.error_message
                retry_after = outcome.stats["retry_after_s"]
                # What is left of the measured start (a little time passed meanwhile).
                assert retry_after == math.ceil(expected - since) or \
                    retry_after == math.ceil(expected - since) - 1, (retry_after, expected)
                assert retry_after >= 2
            assert 1.0 < runtime.ready_in(FAULTY) <= expected
        finally:
            for pid in held:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        (nxt,) = held
        wait_for(lambda: runtime.pid == nxt and runtime.up, START_S,
                 "the next spare to be brought up without a batch")
        assert runtime.ready_in(FAULTY) is None
        assert runtime.start_failures == 1 and runtime.spare_promotions == 2
        assert_all_ok(runtime.run_batch(FAULTY, batch(2)), 2)
