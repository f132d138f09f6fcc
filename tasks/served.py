"""The envelope of a successful result: what it carries beside its operation's fields.

Written in two places, read in one:
- the runtime that computed it (`runtimes/child_side/host.py`, `runtimes/doubles/sim`) adds
  `model`, `batch` (the batch it ran in) and, for the sim, `simulated`
  (`stamp_batch`);
- the worker that answered it (`app/worker/lifecycle/dispatcher.py`) adds `timing` and `worker`
  (`stamp_delivery`);
- whoever awaits it reads them back with `read_served` (the gateway turns them
  into response headers with `reply_headers`, bench counts device time with it).
Celery clients get the same dict, so these keys are part of the result contract.

What every result of a batch shares (`SHARED`: model, batch, simulated, worker) travels
once per message where both ends know it (result contract 2, `RESULT_CONTRACT`): once per
runtime frame (`runtimes.wire.frames.Outcomes.shared`) and once per reply message to a
gateway that asked for it (`tasks.envelope.H_RESULT_CONTRACT`); `take_shared` takes the
facts out of the results, `give_shared` puts them back, so every reader sees whole dicts.
A sender that did not ask (a Celery client, an older gateway) gets whole results.
"""

from __future__ import annotations

import functools
import operator
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict

MODEL = "model"
BATCH = "batch"
SIMULATED = "simulated"  # the sim's device and constants; absent for a real model
TIMING = "timing"
WORKER = "worker"  # the Celery hostname that answered
# The facts all results of one batch (and one worker) share: sent once per message.
SHARED = (MODEL, BATCH, SIMULATED, WORKER)
# 1: every result carries SHARED itself; 2: a multi-result reply may carry them once,
# under "shared" (`take_shared`), for a reader that said it reads them there.
RESULT_CONTRACT = 2


class BatchStats(TypedDict):
    """The batch a result was computed in (every result of the batch has the same)."""

    requests: int
    items: int
    inference_ms: float
    # The device's busy time in the batch's forward passes (CUDA events on a GPU, the
    # forward's wall time on CPU); absent where the runtime cannot tell (SGLang).
    device_ms: NotRequired[float]
    parts: NotRequired[int]  # a request run in parts: how many (their summed inference_ms)


class Timing(TypedDict):
    queue_ms: float | None  # sent to the start of its batch; None without a sent time
    inference_ms: float  # its batch's
    # Epoch microseconds along the worker's part of the path, for a gateway's trace of a
    # request (`X-Shoal-Trace`): the worker took its message, its batch started, its
    # result was handed to the reply publisher. Absent in an older worker's results.
    received_us: NotRequired[int]
    started_us: NotRequired[int]
    answered_us: NotRequired[int]


@dataclass(frozen=True, slots=True)
class Served:
    """A result's envelope, read back; a field is None where the result lacks it."""

    model: str | None
    batch: BatchStats | None
    timing: Timing | None
    worker: str | None
    simulated: dict[str, Any] | None  # set only when a `sim` runtime answered


def stamp_batch(results: Iterable[dict[str, Any]], model: str,
                kwargs: Iterable[Mapping[str, Any]], started: float,
                simulated: Mapping[str, Any] | None = None,
                device_s: float | None = None) -> None:
    """Mark the results of one batch with the model and the batch they ran in.

    `kwargs` are the batch's requests, `started` its `time.perf_counter()` start,
    `device_s` the device's busy time in it.
    """
    requests = list(kwargs)
    batch = BatchStats(
        requests=len(requests),
        items=sum(len(k.get("items") or ()) for k in requests),
        inference_ms=(time.perf_counter() - started) * 1000,
    )
    if device_s is not None:
        batch["device_ms"] = device_s * 1000
    # One dict each for the whole batch: `take_shared` sends them once per message.
    shared_simulated = dict(simulated) if simulated is not None else None
    for result in results:
        result[MODEL] = model
        result[BATCH] = batch
        if shared_simulated is not None:
            result[SIMULATED] = shared_simulated


def take_shared(results: list[dict[str, Any]], keys: tuple[str, ...] = SHARED
                ) -> dict[str, Any] | None:
    """Take the facts (`keys`) that all `results` have alike out of them (in place), and
    return them; None, the results untouched, where nothing is shared or fewer than two
    results would share it (one result is smallest whole). A fact that one of them lacks
    or has otherwise (a split request's joined batch) stays in each result."""
    if len(results) < 2:
        return None
    first = results[0]
    names = [key for key in keys if key in first]
    if not names:
        return None
    # One batch's results hold the very same objects (`stamp_batch`): `is`, or a tuple's
    # comparison (identity first, in C), settles it; one that lacks a fact takes the long
    # way.
    get = operator.itemgetter(*names)
    values = get(first)
    alike = True
    try:
        for result in results:
            other = get(result)
            if other is not values and other != values:
                alike = False
                break
    except KeyError:
        alike = False
    if not alike:
        names = [key for key in names
                 if all(r.get(key, _MISSING) == first[key] for r in results)]
        if not names:
            return None
    values = tuple(first[key] for key in names)
    for result in results:
        for key in names:
            del result[key]
    return dict(zip(names, values, strict=True))


_MISSING = object()


def give_shared(results: Iterable[Any], shared: Any, keys: tuple[str, ...] = SHARED
                ) -> None:
    """Put the facts `take_shared` took out back into each of `results` (dicts; anything
    else is left alone); a fact a result carries itself wins, one not in `keys` is no
    fact of this contract (ignored)."""
    if not isinstance(shared, dict) or not shared:
        return
    facts = [(key, value) for key, value in shared.items() if key in keys]
    for result in results:
        if isinstance(result, dict):
            for key, value in facts:
                if key not in result:
                    result[key] = value


def batch_device_ms(results: Iterable[Mapping[str, Any] | None]) -> float | None:
    """The device's busy time in one batch, from its results (each carries it; None for a
    failed request). None when none says: all failed, or the runtime cannot tell."""
    for result in results:
        batch = read_served(result).batch if result is not None else None
        if batch and "device_ms" in batch:
            return float(batch["device_ms"])
    return None


def stamp_delivery(result: dict[str, Any], queue_ms: float | None, worker: str | None,
                   received_s: float | None = None, started_s: float | None = None,
                   answered_s: float | None = None) -> None:
    """Mark a result with how long its request queued, which worker answered it, and when
    (epoch seconds) the worker took its message, started its batch and answered it
    (`answered_s`, default now: a batch's answers may share one reading of the clock)."""
    batch = result.get(BATCH)
    inference_ms = _milliseconds(batch.get("inference_ms", 0.0)) if batch else 0.0
    # Dict displays, not Timing(...) and update(...): this runs once per answered request.
    timing: Timing
    if received_s and started_s:
        timing = {"queue_ms": queue_ms, "inference_ms": inference_ms,
                  "received_us": round(received_s * 1e6), "started_us": round(started_s * 1e6),
                  "answered_us": round((answered_s or time.time()) * 1e6)}
    else:
        timing = {"queue_ms": queue_ms, "inference_ms": inference_ms}
    result[TIMING] = timing
    if worker is not None:  # None: its reply message says it once (`Replier.shares`)
        result[WORKER] = worker


@functools.lru_cache(maxsize=16)
def _milliseconds(ms: float) -> float:
    """`ms` to the microsecond. Every result of a batch carries its batch's time, so a
    batch rounds it once (round(x, 3) ~0.28 us; a cache hit ~0.06 us)."""
    return round(ms, 3)


def stamp_parts(result: dict[str, Any], inference_ms: float, parts: int) -> None:
    """Mark the joined result of a request run as `parts` batches (`tasks.split`): its
    batch is the first part's (as joined), with the inference time of all of them."""
    batch = dict(result.get(BATCH) or {})
    batch.update(inference_ms=inference_ms, parts=parts)
    result[BATCH] = batch


def _mapping(value: Any) -> Any:
    return value if isinstance(value, Mapping) else None


def read_served(result: Mapping[str, Any]) -> Served:
    """The envelope of a result; tolerates a result without one (an older worker's)."""
    worker = result.get(WORKER)
    model = result.get(MODEL)
    return Served(
        model=str(model) if model else None,
        batch=_mapping(result.get(BATCH)),
        timing=_mapping(result.get(TIMING)),
        worker=str(worker) if worker else None,
        simulated=_mapping(result.get(SIMULATED)),
    )


def reply_headers(result: Mapping[str, Any]) -> dict[str, str]:
    """The response headers a gateway derives from a result's envelope."""
    served = read_served(result)
    headers: dict[str, str] = {}
    timing = served.timing or {}
    if timing.get("queue_ms") is not None:
        headers["X-Queue-Time-Ms"] = str(timing["queue_ms"])
    if timing.get("inference_ms") is not None:
        headers["X-Inference-Time-Ms"] = f"{timing['inference_ms']:.1f}"
    if served.worker:
        headers["X-Worker"] = served.worker
    if served.simulated:
        # A `sim` runtime answered: shapes are right, numbers are not a model's.
        headers["X-Simulated"] = str(served.simulated.get("device", "true"))
    if served.batch and "requests" in served.batch:
        headers["X-Batch-Requests"] = str(served.batch["requests"])
    if served.batch and served.batch.get("parts"):
        headers["X-Batch-Parts"] = str(served.batch["parts"])  # run as this many batches
    first = time_to_first_token_ms(result)
    if first is not None:
        headers["X-Time-To-First-Token-Ms"] = f"{first:.1f}"
        itl = [t["itl_ms"] for t in result.get("latency") or () if "itl_ms" in t]
        headers["X-Inter-Token-Latency-Ms"] = f"{sum(itl) / len(itl):.2f}"
    return headers


def time_to_first_token_ms(result: Mapping[str, Any]) -> float | None:
    """A generate result's first token, from its publication: the queue wait plus the
    runtime's time to the earliest first token of its choices (`latency`). None for other
    results."""
    firsts = [t["ttft_ms"] for t in result.get("latency") or () if "ttft_ms" in t]
    if not firsts:
        return None
    queue = (read_served(result).timing or {}).get("queue_ms") or 0.0
    return float(queue) + min(firsts)
