"""Adapters that misbehave on marker texts, for tests of the runtime process.

Catalog `adapter: dense-faulty` (encode) and `cross-encoder-faulty` (score):
the plain adapter with `Faulty` in front. Refused unless
SHOAL_ALLOW_TEST_ADAPTERS=1, since one request could otherwise take a
production worker down on purpose. The fault happens in `forward`, where a real
model fails (inference, not validation); requests without markers get what
the plain adapter gives.

Markers (anywhere in an item's text or in the query):
  @@crash@@  a real segfault (read of address 0), like a broken kernel or extension
  @@raise@@  a Python RuntimeError, like a bad shape or a CUDA error message
  @@slow@@   sleeps SHOAL_FAULTY_SLOW_S seconds (default 3) before computing
  @@slowfinish@@  computes, then sleeps as long in the results' stage (after the device)

SHOAL_FAULTY_EVERY_BATCH=<marker> makes every batch behave as if it carried
that marker: a runtime that is broken whatever the input.

So that a test acts while a slow batch is in the model, not after a sleep it
hopes is long enough: SHOAL_FAULTY_SLOW_LOG=<file> gets a line (the pid) when a
slow batch starts sleeping (tests/slow_batches.py reads it), and while the
file SHOAL_FAULTY_SLOW_HOLD names exists a slow batch sleeps on past
SHOAL_FAULTY_SLOW_S (HOLD_LIMIT_S at most, so a test that dies holding one
cannot hang a runtime for good).
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from runtimes.pytorch.adapter import Adapter
from runtimes.pytorch.cross_encoder import CrossEncoderAdapter
from runtimes.pytorch.dense import DenseAdapter
from tasks.catalog import ModelEntry
from tasks.schema import ParsedRequest

ALLOW_ENV = "SHOAL_ALLOW_TEST_ADAPTERS"
EVERY_BATCH_ENV = "SHOAL_FAULTY_EVERY_BATCH"
SLOW_LOG_ENV = "SHOAL_FAULTY_SLOW_LOG"
SLOW_HOLD_ENV = "SHOAL_FAULTY_SLOW_HOLD"
HOLD_LIMIT_S = 120.0
CRASH, RAISE, SLOW = "@@crash@@", "@@raise@@", "@@slow@@"
SLOW_FINISH = "@@slowfinish@@"
MARKERS = (CRASH, RAISE, SLOW, SLOW_FINISH)


class AdapterRefused(RuntimeError):
    pass


def refuse_unless_allowed(adapter: str) -> None:
    if os.environ.get(ALLOW_ENV) != "1":
        raise AdapterRefused(
            f"adapter '{adapter}' crashes its process on purpose and exists for tests "
            f"only; set {ALLOW_ENV}=1 to load it"
        )


def misbehave(markers: Iterable[str]) -> None:
    """Do what the markers say; return only if none of them ends the batch."""
    markers = {*markers, *filter(None, [os.environ.get(EVERY_BATCH_ENV)])}
    if CRASH in markers:
        ctypes.string_at(0)  # SIGSEGV: the process dies without unwinding
    if RAISE in markers:
        raise RuntimeError(f"faulty adapter: input contains {RAISE}")
    if SLOW in markers:
        _sleep_slowly()


def _sleep_slowly() -> None:
    if log := os.environ.get(SLOW_LOG_ENV):
        with open(log, "a") as out:  # one short append: whole lines even across processes
            out.write(f"{os.getpid()}\n")
    time.sleep(float(os.environ.get("SHOAL_FAULTY_SLOW_S", "3")))
    hold = os.environ.get(SLOW_HOLD_ENV)
    held_until = time.monotonic() + HOLD_LIMIT_S
    while hold and os.path.exists(hold) and time.monotonic() < held_until:
        time.sleep(0.01)


@dataclass(frozen=True, slots=True)
class _Marked:
    prepared: Any  # what the plain adapter's check made of the request
    markers: frozenset[str]


class Faulty(Adapter):
    """Put before a plain adapter class: its checks, then the markers' faults, then its run."""

    def __init__(self, entry: ModelEntry, ref: str, **kwargs: Any) -> None:
        refuse_unless_allowed(entry.adapter)
        super().__init__(entry, ref, **kwargs)

    def check(self, parsed: ParsedRequest) -> _Marked:
        texts = [*parsed.texts, parsed.query or ""]
        markers = frozenset(m for m in MARKERS if any(m in text for text in texts))
        return _Marked(super().check(parsed), markers)

    # The faults happen in the device stage, where a real model fails; the plain
    # adapter's `run`, where it does not split its work into stages, runs in that stage.
    def plan(self, prepared: list[_Marked]) -> tuple[frozenset[str], Any]:
        markers = frozenset(marker for p in prepared for marker in p.markers)
        return markers, super().plan([p.prepared for p in prepared])

    def forward(self, planned: tuple[frozenset[str], Any]) -> Any:
        markers, inner = planned
        misbehave(markers)
        return super().forward(inner)

    def finish(self, planned: tuple[frozenset[str], Any], output: Any) -> list[dict[str, Any]]:
        if SLOW_FINISH in planned[0]:
            _sleep_slowly()
        return super().finish(planned[1], output)


class FaultyDenseAdapter(Faulty, DenseAdapter):
    pass


class FaultyCrossEncoderAdapter(Faulty, CrossEncoderAdapter):
    pass
