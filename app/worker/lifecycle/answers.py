"""Answers: each request's result or error, published to its caller.

Every held request is settled exactly once: answered with its outcome (a split request
once, when its last part ran, or with its first part's error), refused with an error
(DEADLINE_EXCEEDED: its deadline passed, or would pass before its batch ends;
DEADLINE_TOO_SHORT: alone it is predicted to take longer than its whole deadline;
MODEL_UNAVAILABLE: its model or adapter could not load; a claim's BLOB_MISSING or
BLOB_CORRUPT), or handed back (`app.worker.lifecycle.returns`). The publishing and acking are
`app.worker.lifecycle.replies`'; this module decides what each caller is sent (`reply_to`,
`refusal`: a `Reply`, pure), counts it and stamps the result.
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple

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


class Reply(NamedTuple):
    """What a request's caller is sent: its outcome (a result, or an error), when to come
    back (whole seconds: a restarting runtime says), and for a refusal whether any of it
    ran (a caller may send a request refused unrun again)."""

    outcome: Outcome
    retry_after: int | None = None
    refused: bool = False
    ran: bool = False


def reply_to(held: Held, outcome: Outcome) -> Reply | None:
    """What a request that ran is answered with: its outcome; a split request's once, its
    parts' results joined when the last ran, or its first failure with the part named;
    None: nothing now (more parts to run, or answered already)."""
    split = held.split
    if split is not None:
        if split.answered or (outcome.ok and len(split.results) < len(split.parts)):
            return None
        split.answered = True
        if outcome.ok:
            outcome = Outcome(held.task_id, result=merged_result(split))
        else:
            outcome = Outcome(held.task_id, error_code=outcome.error_code,
                              error_message=f"{split.describe(held.part)}: "
                                            f"{outcome.error_message}")
    if outcome.ok:
        return Reply(outcome)
    retry_after = outcome.stats.get("retry_after_s") if outcome.stats else None
    return Reply(outcome, math.ceil(retry_after) if retry_after is not None else None)


def refusal(held: Held, why: str, code: ErrorCode) -> Reply | None:
    """What a request refused unrun is answered with (a split request's names its part, and
    whether parts of it ran); None: answered already."""
    split = held.split
    if split is not None:
        if split.answered:
            return None
        split.answered = True
        why = f"{split.describe(held.part)}: {why}"
    return Reply(Outcome(held.task_id, error_code=code, error_message=why), refused=True,
                 ran=split is not None and bool(split.results))


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
        """Answer a request with its outcome (`reply_to` decides what its caller gets)."""
        reply = reply_to(held, outcome)
        if reply is not None:
            self.publish(model, held, reply)

    def refuse(self, model: str, held: Held, why: str,
               code: ErrorCode = ErrorCode.DEADLINE_EXCEEDED) -> None:
        """Answer a request with an error, unrun (`refusal` decides what its caller gets)."""
        reply = refusal(held, why, code)
        if reply is not None:
            self.publish(model, held, reply)

    def publish(self, model: str, held: Held, reply: Reply) -> None:
        """Count a reply and publish it to the request's caller."""
        self._count_drain_answer(model)
        outcome = reply.outcome
        if outcome.ok:
            metrics.RESULTS.labels(model, "ok").inc()
            self._succeed(model, held, outcome, time.time())
            return
        code = outcome.error_code or "error"
        metrics.RESULTS.labels(model, code).inc()
        if reply.refused:
            if code in (ErrorCode.DEADLINE_EXCEEDED, ErrorCode.DEADLINE_TOO_SHORT):
                metrics.EXPIRED.labels(model).inc()
        elif code == ErrorCode.CANCELLED:
            metrics.CANCELLED.labels(model).inc()
        elif code == ErrorCode.DEADLINE_EXCEEDED:  # dropped before the device
            metrics.EXPIRED.labels(model).inc()
        if tracing.ENABLED:
            traces.settled(held, str(code))
        self.replier.failure(held.delivery, held.task_id, outcome.error_code,
                             outcome.error_message, reply.retry_after,
                             reply.ran if reply.refused else None)

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

    def _count_drain_answer(self, model: str, answered: int = 1) -> None:
        if self.drain.active:
            self.drain.answered += answered
            metrics.DRAIN_ANSWERED.labels(model).inc(answered)
