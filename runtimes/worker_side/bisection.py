"""Which request of a failed batch is to blame: bisection, as a function of its attempts.

When a batch fails (its runtime process died, hung, or replied that the batch raised),
it is split in halves and each half is run again (after a restart if the process
died), recursively. A request is blamed, with POISON_INPUT, only when it fails *run
alone after a batch containing it failed*: two failures, the second with nothing else
in the batch. So:

* an external kill (OOM killer, SIGKILL) during a batch costs one restart and
  the halves then succeed: every request gets its normal result. A lone
  request gets the same chance: its first failure is retried once.
* a poison request costs log2(batch) + 1 failures (restarts, for crashes),
  with no separate whole-batch retry: the halves already are the retry.
* a batch too big for device memory is split until it fits.

Before blaming a request, the runtime must have shown that it works: some
part of the batch succeeded after the first failure, or else the model's
probe is answered. The probe is a small request of the model's own
operation that its adapter must answer whenever it works
(`Adapter.probe`, sent as a probe frame, see `runtimes.child_side.server`). If it
fails too, or is refused, the runtime is not shown to work whatever the
input, and `bisect` raises `RuntimeUnhealthy` rather than blaming
anyone. (Usually the other parts are the evidence, so the batch's replies
need not wait for the last restart.)

A request whose output has begun to go out (a stream) is never run again after a
failure (its caller would read the beginning twice): it is answered
STREAM_INTERRUPTED, and only the rest of the batch is bisected.

Nothing here knows processes or sockets: `bisect` is given the failed batch, how it
failed, and `attempt` (run some requests again: their outcomes, or how that failed) and
`probe`; `runtimes.worker_side.process` gives it its child's round trips
(`runtimes.worker_side.batch_channel`'s attempts).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from runtimes.base import Outcome, Request, RuntimeUnhealthy
from tasks.errors import ErrorCode

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Failure:
    """How an attempt at a batch failed. `streamed`: its requests whose output had begun
    to go out (they are not run again)."""

    kind: Literal["crash", "hang", "exception"]
    detail: str
    streamed: frozenset[str] = frozenset()


# Run these requests (again): their outcomes, in order, or how the attempt failed.
Attempt = Callable[[list[Request]], "list[Outcome] | Failure"]
# Run the model's probe: None when it was answered, else what went wrong.
Probe = Callable[[], "str | None"]
# Told of each request blamed, with the reason (a runtime counts them).
OnPoison = Callable[[Request, str], None]


def bisect(model: str, requests: list[Request], failure: Failure, attempt: Attempt,
           probe: Probe, on_poison: OnPoison | None = None) -> list[Outcome]:
    """The outcomes of `requests` (in order), whose run together just failed with
    `failure`: the culprits blamed POISON_INPUT, streamed requests STREAM_INTERRUPTED,
    the others their results from `attempt`s of parts of the batch. Raises
    RuntimeUnhealthy (from `probe`) when nothing shows the runtime still works; whatever
    `attempt` or `probe` raise goes through."""
    return _Bisection(model, attempt, probe, on_poison).settle(requests, failure,
                                                               failed_before=False)


class _Bisection:
    """One failed batch's bisection: whether some part worked after its first failure."""

    def __init__(self, model: str, attempt: Attempt, probe: Probe,
                 on_poison: OnPoison | None) -> None:
        self.model = model
        self.attempt = attempt
        self.probe = probe
        self.on_poison = on_poison
        self.works_after_failure = False  # part of it succeeded after a failure; see blame

    def run(self, requests: list[Request]) -> list[Outcome]:
        """Run part of the batch again (after a failure)."""
        result = self.attempt(requests)
        if not isinstance(result, Failure):
            if any(o.ok for o in result):
                self.works_after_failure = True
            return result
        return self.settle(requests, result, failed_before=True)

    def settle(self, requests: list[Request], failure: Failure, failed_before: bool
               ) -> list[Outcome]:
        """The outcomes of `requests`, which just failed together."""
        if failure.streamed.intersection(r.id for r in requests):
            return self.interrupted(requests, failure)
        if len(requests) > 1:
            log.warning("batch of %d requests for %s failed (%s: %s); splitting it",
                        len(requests), self.model, failure.kind, failure.detail)
            mid = len(requests) // 2
            return self.run(requests[:mid]) + self.run(requests[mid:])
        if not failed_before:
            # A lone request's first failure may not be its fault (an OOM kill): once more.
            log.warning("request %s for %s failed alone (%s: %s); retrying it once",
                        requests[0].id, self.model, failure.kind, failure.detail)
            return self.run(requests)
        return [self.blame(requests[0], failure)]

    def interrupted(self, requests: list[Request], failure: Failure) -> list[Outcome]:
        """A failed batch in which some requests had streamed: they end here, the rest
        run again (bisected, as any failed batch)."""
        outcomes: dict[str, Outcome] = {}
        rest = []
        for request in requests:
            if request.id in failure.streamed:
                outcomes[request.id] = Outcome(
                    request.id, error_code=str(ErrorCode.STREAM_INTERRUPTED),
                    error_message=f"the model runtime failed ({failure.kind}: "
                                  f"{failure.detail}) after part of this request's output "
                                  "was streamed; that part stands, the rest will not come "
                                  "(retry the request)")
            else:
                rest.append(request)
        if rest:
            outcomes.update((o.id, o) for o in self.run(rest))
        return [outcomes[r.id] for r in requests]

    def blame(self, request: Request, failure: Failure) -> Outcome:
        problem = None if self.works_after_failure else self.probe()
        if problem is not None:
            raise RuntimeUnhealthy(
                f"the model runtime for {self.model} fails even on a known-good request "
                f"({problem}); request {request.id} is not blamed"
            )
        if failure.kind == "crash":
            message = f"this request crashed the model runtime ({failure.detail})"
        elif failure.kind == "hang":
            message = f"this request hung the model runtime ({failure.detail})"
        else:
            message = f"inference failed on this request: {failure.detail}"
        log.error("request %s for %s isolated as poison: %s", request.id, self.model, message)
        if self.on_poison is not None:
            self.on_poison(request, message)
        return Outcome(
            request.id, error_code=str(ErrorCode.POISON_INPUT),
            error_message=f"{message}; it failed alone, after failing its batch, and is not "
                          "retried (the other requests of the batch were run without it)",
        )
