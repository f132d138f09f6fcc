"""Which request of a failed batch is to blame (`runtimes.worker_side.bisection`), with no runtime
process: each attempt is a function of the requests it is given."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from runtimes.base import Outcome, Request, RuntimeUnhealthy
from runtimes.worker_side.bisection import Failure, bisect

CRASH = Failure("crash", "killed by SIGSEGV")


def _requests(n: int) -> list[Request]:
    return [Request(f"r{i}", "encode", {"text": f"text {i}"}) for i in range(n)]


class _Runtime:
    """Attempts that fail when `fails(requests)`; each call recorded."""

    def __init__(self, fails: Callable[[list[Request]], Failure | None],
                 probe: str | None = None) -> None:
        self.fails = fails
        self.attempts: list[list[str]] = []
        self.probes = 0
        self.probe_answer = probe
        self.poisoned: list[str] = []

    def attempt(self, requests: list[Request]) -> list[Outcome] | Failure:
        self.attempts.append([r.id for r in requests])
        failure = self.fails(requests)
        if failure is not None:
            return failure
        return [Outcome(r.id, {"echo": r.kwargs["text"]}) for r in requests]

    def probe(self) -> str | None:
        self.probes += 1
        return self.probe_answer

    def bisect(self, requests: list[Request], failure: Failure = CRASH) -> list[Outcome]:
        return bisect("m", requests, failure, self.attempt, self.probe,
                      lambda request, why: self.poisoned.append(request.id))


def _poison(*ids: str) -> Callable[[list[Request]], Failure | None]:
    return lambda requests: CRASH if any(r.id in ids for r in requests) else None


def _codes(outcomes: list[Outcome]) -> dict[str, str | None]:
    return {o.id: o.error_code for o in outcomes}


def test_one_bad_request_among_n_is_blamed_and_the_rest_get_their_results():
    requests = _requests(8)
    runtime = _Runtime(_poison("r5"))
    outcomes = runtime.bisect(requests)
    assert [o.id for o in outcomes] == [r.id for r in requests]
    assert _codes(outcomes) == {r.id: "POISON_INPUT" if r.id == "r5" else None
                                for r in requests}
    assert all(o.result == {"echo": f"text {i}"} for i, o in enumerate(outcomes) if o.ok)
    assert "crashed the model runtime (killed by SIGSEGV)" in outcomes[5].error_message
    assert "failed alone, after failing its batch" in outcomes[5].error_message
    assert runtime.poisoned == ["r5"]
    # log2(8) more failures after the first: halves of 4, 2, then r5 alone; no whole retry.
    failed = [a for a in runtime.attempts if "r5" in a]
    assert failed == [["r4", "r5", "r6", "r7"], ["r4", "r5"], ["r5"]]
    assert runtime.probes == 0  # the other halves showed that the runtime works


def test_two_bad_requests_are_both_blamed():
    requests = _requests(6)
    runtime = _Runtime(_poison("r0", "r4"))
    outcomes = runtime.bisect(requests)
    assert _codes(outcomes) == {"r0": "POISON_INPUT", "r1": None, "r2": None, "r3": None,
                                "r4": "POISON_INPUT", "r5": None}
    assert runtime.poisoned == ["r0", "r4"]


def test_when_every_request_fails_the_probe_decides_and_a_failed_probe_blames_nobody():
    runtime = _Runtime(lambda requests: CRASH, probe="crash: killed by SIGKILL")
    with pytest.raises(RuntimeUnhealthy, match=r"fails even on a known-good request "
                                               r"\(crash: killed by SIGKILL\); request r0"):
        runtime.bisect(_requests(4))
    assert runtime.poisoned == [] and runtime.probes == 1


def test_when_every_request_fails_but_the_probe_is_answered_each_is_blamed():
    runtime = _Runtime(lambda requests: Failure("exception", "ValueError('bad')"))
    outcomes = runtime.bisect(_requests(4), Failure("exception", "ValueError('bad')"))
    assert set(_codes(outcomes).values()) == {"POISON_INPUT"}
    assert all("inference failed on this request: ValueError('bad')" in o.error_message
               for o in outcomes)
    assert runtime.poisoned == ["r0", "r1", "r2", "r3"]
    assert runtime.probes == 4  # nothing else worked: each blame asks the probe


def test_a_batch_of_one_is_retried_once_before_it_is_blamed():
    runtime = _Runtime(_poison("r0"))
    (outcome,) = runtime.bisect(_requests(1), Failure("hang", "no answer within 2s"))
    assert outcome.error_code == "POISON_INPUT"
    assert "hung the model runtime (no answer within 2s)" not in outcome.error_message
    assert "crashed the model runtime" in outcome.error_message  # the retry's failure
    assert runtime.attempts == [["r0"]]
    assert runtime.probes == 1  # no other request showed that the runtime works


def test_a_flaky_failure_that_does_not_repeat_blames_nobody():
    requests = _requests(5)
    runtime = _Runtime(lambda requests: None)  # the external kill is over: all succeed
    outcomes = runtime.bisect(requests)
    assert all(o.ok for o in outcomes) and [o.id for o in outcomes] == [r.id for r in requests]
    assert runtime.attempts == [["r0", "r1"], ["r2", "r3", "r4"]]  # the halves, once each
    assert runtime.poisoned == [] and runtime.probes == 0
    single = _Runtime(lambda requests: None)
    (outcome,) = single.bisect(_requests(1))
    assert outcome.ok and single.attempts == [["r0"]]


def test_streamed_requests_are_interrupted_and_only_the_rest_run_again():
    requests = _requests(4)
    runtime = _Runtime(lambda requests: None)
    failure = Failure("crash", "killed by SIGKILL", streamed=frozenset({"r1"}))
    outcomes = runtime.bisect(requests, failure)
    assert _codes(outcomes) == {"r0": None, "r1": "STREAM_INTERRUPTED", "r2": None, "r3": None}
    assert "after part of this request's output was streamed" in outcomes[1].error_message
    assert runtime.attempts == [["r0", "r2", "r3"]]  # the rest together, not split first


def test_what_the_attempt_raises_goes_through():
    def attempt(requests: list[Request]) -> list[Outcome] | Failure:
        raise RuntimeError("the runtime was closed")

    with pytest.raises(RuntimeError, match="closed"):
        bisect("m", _requests(2), CRASH, attempt, lambda: None)
