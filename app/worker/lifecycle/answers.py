"""Answers: each request's result or error, published to its caller.

Every held request is settled exactly once: answered with its outcome (a split request
once, when its last part ran, or with its first part's error), refused with an error
(DEADLINE_EXCEEDED: its deadline passed, or would pass before its batch ends;
DEADLINE_TOO_SHORT: alone it is predicted to take longer than its whole deadline;
MODEL_UNAVAILABLE: its model or adapter could not load; a claim's BLOB_MISSING or
BLOB_CORRUPT), or handed back (`app.worker.lifecycle.returns`). The publishing and acking are
`app.worker.lifecycle.replies`'; this module counts the outcome and stamps the result.
"""

from __future__ import annotations

import math
import time

from app.worker import metrics
from app.worker.lifecycle import traces
from app.worker.lifecycle.drain import Drain
from app.worker.lifecycle.held import Held
from app.worker.lifecycle.loop import Identity
from app.worker.lifecycle.replies import Replier
from app.worker.lifecycle.splits import merged_result
from batching.lanes import Late
from runtimes.base import CANCELLED, Outcome
from tasks import tracing
from tasks.errors import ErrorCode
from tasks.served import stamp_delivery


def refusal_message(late: Late) -> str:
    """Why a request was refused unrun, with what the prediction rests on."""
    ahead_s = late.predicted_s - late.backing.seconds
    after = f" after {ahead_s * 1000:.0f} ms of batches ahead" if ahead_s >= 0.0005 else ""
    why = (f"the request's deadline is {late.deadline_in_s * 1000:.0f} ms away and its batch "
           f"is predicted to take {late.backing.seconds * 1000:.0f} ms{after} "
           f"({late.backing.describe()}): not started; ")
    if late.too_short:
        assert late.pending.budget_s is not None
        return why + (f"alone it is predicted to take {late.alone_s * 1000:.0f} ms, more than "
                      f"its whole {math.ceil(late.pending.budget_s * 1000)} ms deadline: send it "
                      "again with more time (X-Timeout-Ms) or fewer items")
    return why + "allow more time (X-Timeout-Ms) or send fewer items"


class Answers:
    """Settles held requests with their outcome or an error (loop thread)."""

    def __init__(self, replier: Replier, loop: Identity, drain: Drain) -> None:
        self.replier = replier
        self.loop = loop  # its hostname goes into each result
        self.drain = drain  # while it is on, answers are counted

    def answer_batch(self, model: str, held: list[Held], outcomes: list[Outcome]) -> None:
        """A batch's requests, each with its outcome, published together. What the
        successes share is paid once for the batch, not per request: the clock, the
        count of results, the drain's count (the replier reads Flower's flag and the
        results' date once too)."""
        self.replier.begin_batch()
        now = time.time()
        ok = 0
        for h, outcome in zip(held, outcomes, strict=True):
            if h.split is None and outcome.ok:
                self._succeed(model, h, outcome, now)
                ok += 1
            else:
                self.answer(model, h, outcome)
        if ok:
            metrics.RESULTS.labels(model, "ok").inc(ok)
            self._count_drain_answer(model, ok)
        self.replier.end_batch()

    def answer(self, model: str, held: Held, outcome: Outcome) -> None:
        split = held.split
        retry_after = outcome.stats.get("retry_after_s") if outcome.stats else None
        if split is not None:
            if split.answered or (outcome.ok and len(split.results) < len(split.parts)):
                return  # answered already, or more parts to run
            split.answered = True
            if outcome.ok:
                outcome = Outcome(held.task_id, result=merged_result(split))
            else:
                outcome = Outcome(held.task_id, error_code=outcome.error_code,
                                  error_message=f"{split.describe(held.part)}: "
                                                f"{outcome.error_message}")
        self._count_drain_answer(model)
        if not outcome.ok:
            metrics.RESULTS.labels(model, outcome.error_code or "error").inc()
            if outcome.error_code == ErrorCode.CANCELLED:
                metrics.CANCELLED.labels(model).inc()
            elif outcome.error_code == ErrorCode.DEADLINE_EXCEEDED:  # dropped before the device
                metrics.EXPIRED.labels(model).inc()
            if tracing.ENABLED:
                traces.settled(held, str(outcome.error_code or "error"))
            # A runtime that is restarting says when to come back (MODEL_UNAVAILABLE).
            self.replier.failure(held.delivery, held.task_id, outcome.error_code,
                                 outcome.error_message,
                                 math.ceil(retry_after) if retry_after is not None else None)
            return
        metrics.RESULTS.labels(model, "ok").inc()
        self._succeed(model, held, outcome, time.time())

    def _succeed(self, model: str, held: Held, outcome: Outcome, now: float) -> None:
        """Publish a result (`now`: epoch seconds it is answered); counted by the caller."""
        result = outcome.result
        assert result is not None
        sent = held.annotations.sent_ms
        started = held.started
        delivery = held.delivery
        stamp_delivery(result, round(max(0.0, started * 1000 - sent), 2) if sent else None,
                       None if self.replier.shares(delivery) else self.loop.hostname,
                       delivery.received, started, now)
        choices = result.get("choices")
        if choices and any(c.get("finish_reason") == CANCELLED for c in choices):
            metrics.CANCELLED.labels(model).inc()
        for latency in result.get("latency") or ():
            if "ttft_ms" in latency:
                metrics.TIME_TO_FIRST_TOKEN.labels(model).observe(latency["ttft_ms"] / 1000)
                metrics.INTER_TOKEN.labels(model).observe(latency["itl_ms"] / 1000)
        if tracing.ENABLED:
            traces.settled(held, "ok")
        self.replier.success(held.delivery, held.task_id, result, now - started)

    def refuse(self, model: str, held: Held, why: str,
                code: ErrorCode = ErrorCode.DEADLINE_EXCEEDED) -> None:
        if held.split is not None:
            if held.split.answered:
                return
            held.split.answered = True
            why = f"{held.split.describe(held.part)}: {why}"
        self._count_drain_answer(model)
        if code in (ErrorCode.DEADLINE_EXCEEDED, ErrorCode.DEADLINE_TOO_SHORT):
            metrics.EXPIRED.labels(model).inc()
        metrics.RESULTS.labels(model, code).inc()
        # Refused unrun: a client may send it again (unless parts of it ran already).
        ran = held.split is not None and bool(held.split.results)
        if tracing.ENABLED:
            traces.settled(held, str(code))
        self.replier.failure(held.delivery, held.task_id, code, why, started=ran)

    def _count_drain_answer(self, model: str, answered: int = 1) -> None:
        if self.drain.active:
            self.drain.answered += answered
            metrics.DRAIN_ANSWERED.labels(model).inc(answered)
