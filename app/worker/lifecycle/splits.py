"""Requests too big for one batch, run as parts.

A request too big for one batch of its model is split into budget-sized parts
(`tasks.split`) that run one after another: the next part joins the backlog when the
previous one ends, so requests that arrived meanwhile go first and nobody waits behind
one long batch. The caller is answered once, with the parts' results joined in order (or
the first part's error). The record of a split request (`Split`) lives beside `Held`
(`app.worker.lifecycle.held`), which points at it; this module cuts and joins.
"""

from __future__ import annotations

import math
import time
from typing import Any

from app.worker.lifecycle.held import Held, Split
from batching.lanes import Lane
from batching.parts import items_per_part
from batching.shapes import BatchShape
from runtimes.base import Outcome
from tasks.envelope import Annotations, EstimatingEntry, decode_body, task_body
from tasks.served import read_served, stamp_parts
from tasks.split import SPLITTABLE, merge_results, split_kwargs

# The deadline a refused split request is told to send: its predicted time with room for
# the batches of other callers its parts interleave with.
ENOUGH_MARGIN = 1.5


def split_request(held: Held, lane: Lane, entry: EstimatingEntry | None,
                  part_target_s: float | None) -> Split | None:
    """The parts of a request too big for one batch of its model, or None."""
    a = held.annotations
    if a.op not in SPLITTABLE or a.items <= 1 or entry is None:
        return None
    bulk_slice = lane.limits.bulk_slice_s if a.bulk and \
        lane.callers_active(time.monotonic()) else None
    target = min((t for t in (part_target_s, lane.limits.latency_target_s,
                              bulk_slice) if t is not None), default=None)
    per_part = items_per_part(a.items, a.longest, a.cost, lane.limits, lane.cost, target)
    if per_part >= a.items:
        return None
    try:
        kwargs = decode_body(held.body)
    except ValueError:
        return None  # runs whole, and is answered INVALID_REQUEST
    parts = []
    alone_s = 0.0
    for part in split_kwargs(kwargs, per_part):
        items, cost, longest = entry.estimate(part)
        parts.append((Annotations(a.model, a.op, items, cost, longest, a.deadline_ms,
                                  a.sent_ms, a.lora, bulk=a.bulk), task_body(part)))
        alone_s += lane.cost.admission(BatchShape(items, longest, cost)).seconds
    return Split(parts, alone_s=alone_s)


def too_long_for(split: Split, budget_s: float | None) -> str | None:
    """Why a split request cannot finish within its whole deadline, or None: its parts
    alone are predicted to take longer than all of it, so it is refused before any part
    runs (sent again with the same deadline, it would be refused again), with the
    deadline that would do."""
    if budget_s is None or split.alone_s <= budget_s:
        return None
    enough_s = math.ceil(split.alone_s * ENOUGH_MARGIN)
    items = sum(a.items for a, _ in split.parts)
    return (f"its {items} items, run as {len(split.parts)} parts, are predicted to take "
            f"{split.alone_s:.1f} s alone, more than its whole {budget_s:.1f} s deadline: "
            f"not started; send it with X-Timeout-Ms: {enough_s * 1000} (or more), or "
            "fewer items per request")


def next_parts(helds: list[Held], outcomes: list[Outcome]) -> list[Held]:
    """Keep each split request's part result; the next parts to run (they join the
    backlog behind what arrived meanwhile)."""
    following: list[Held] = []
    for held, outcome in zip(helds, outcomes, strict=True):
        split = held.split
        if split is None or split.answered or not outcome.ok:
            continue
        assert outcome.result is not None
        split.results.append(outcome.result)
        split.inference_ms += (read_served(outcome.result).batch or {}).get(
            "inference_ms", 0.0)
        if len(split.results) < len(split.parts):
            following.append(split.part_held(held, len(split.results)))
    return following


def merged_result(split: Split) -> dict[str, Any]:
    """A split request's result: its parts' joined; the inference time it reports is that
    of all its parts' batches."""
    result = merge_results(split.results)
    stamp_parts(result, split.inference_ms, len(split.parts))
    return result
