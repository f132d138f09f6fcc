"""Closed- and open-loop HTTP load against one endpoint, with app.tuning.rawhttp.

Closed loop (N clients, each sending its next request when the last one
answers) measures what a fixed set of callers gets, but it slows itself down
when the server does, so it never shows a queue building up. Open loop sends
requests at Poisson arrival times fixed in advance, whatever the responses
do: that is how independent users behave, and it shows what happens past
saturation (latency grows without bound, or requests are refused).

In open loop each arrival goes out on an idle keep-alive connection; more
connections are opened as needed up to a cap, and an arrival that finds
none free is counted as dropped rather than delayed, so the schedule never
waits on the server. Latency counts from the scheduled arrival time, so a
late event loop is charged to the result rather than hidden.

`closed_loop_calls` is the closed loop through a client library (e.g. the
official `openai` client) instead of raw HTTP, counted the same way.

Counting, for both modes, over the measured window [warm-up end, end):
- throughput (requests, items, req/s, items/s): successful responses that
  *completed* inside the window;
- latency percentiles and errors: requests *started* (closed) or *scheduled*
  (open) inside the window, awaited after it ends (up to the timeout), so
  slow responses under overload are not left out of the tail;
- CPU (`cpu_pids`, app.tuning.cpu): each process's CPU over the window, per
  request completed in it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from app.tuning.cpu import CpuUse, cpu_over
from app.tuning.knee import Point
from app.tuning.rawhttp import Connection, HttpError
from app.tuning.stats import percentile

BodyFn = Callable[[list[str]], dict[str, Any]]
CallFn = Callable[[list[str]], Awaitable[object]]  # one request through a client library


def items_body(texts: list[str]) -> dict[str, Any]:
    """The native body: one item per text."""
    return {"items": [{"text": t} for t in texts]}


@dataclass(frozen=True)
class Prepared:
    """One request, serialised once so the load generator spends no CPU on JSON."""

    data: bytes
    items: int


def prepare(endpoint: str, requests: Sequence[list[str]],
            body: BodyFn = items_body) -> list[Prepared]:
    """Raw HTTP requests for `endpoint` (a full URL), one per list of texts."""
    if not requests:
        raise ValueError("no requests to send")
    parts = urlsplit(endpoint)
    path = parts.path or "/"
    if parts.query:
        path += f"?{parts.query}"
    connection = Connection(endpoint)
    return [Prepared(connection.request_bytes(path, json.dumps(body(texts)).encode(),
                                              "application/json"), len(texts))
            for texts in requests]


@dataclass
class LoadResult:
    mode: str  # closed | open
    offered: float  # clients (closed) or arrivals/s (open)
    duration: float
    requests: int  # successful, completed inside the window
    items: int
    req_per_s: float
    items_per_s: float
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    errors: int
    error_kinds: dict[str, int]
    dropped: int  # open loop: arrivals with no free connection under the cap
    attempted: int  # requests started/scheduled inside the window, dropped included
    median_batch_requests: float | None
    simulated: bool  # a response carried X-Simulated
    simulated_device: str | None = None
    connections: int = 0  # opened, at most
    warmup_errors: int = 0
    # CPU ms per completed request of each process in `cpu_pids` (and their "total"),
    # and of the load generator itself (None without requests).
    cpu_ms_per_request: dict[str, float] = field(default_factory=dict)
    client_cpu_ms_per_request: float | None = None

    @property
    def error_rate(self) -> float:
        """Failed or dropped, of those attempted in the window."""
        return (self.errors + self.dropped) / self.attempted if self.attempted else 0.0

    def point(self) -> Point:
        """This level as a point of the load curve (app.tuning.knee)."""
        return Point(self.offered, self.req_per_s, self.p50_ms, self.p99_ms, self.error_rate)


@dataclass
class _Window:
    start: float
    end: float


@dataclass
class _Tally:
    window: _Window
    completed: int = 0
    completed_items: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    batch_requests: list[int] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    attempted: int = 0
    dropped: int = 0
    warmup_errors: int = 0
    simulated: str | None = None

    def record(self, started: float, ended: float, items: int, error: str | None,
               headers: dict[str, str]) -> None:
        w = self.window
        if "x-simulated" in headers:
            self.simulated = headers["x-simulated"] or "true"
        in_window = w.start <= started < w.end
        if error is None and w.start <= ended < w.end:
            self.completed += 1
            self.completed_items += items
        if not in_window:
            if error is not None and started < w.start:
                self.warmup_errors += 1
            return
        self.attempted += 1
        if error is not None:
            self.errors[error] += 1
            return
        self.latencies_ms.append((ended - started) * 1000)
        batch = headers.get("x-batch-requests", "")
        if batch.isdigit():
            self.batch_requests.append(int(batch))


async def _send(connection: Connection, request: bytes,
                timeout: float) -> tuple[str | None, dict[str, str]]:
    """(error kind or None, response headers)."""
    try:
        status, headers, _ = await asyncio.wait_for(connection.send(request), timeout)
    except (HttpError, OSError, TimeoutError, asyncio.IncompleteReadError,
            asyncio.LimitOverrunError, ValueError, IndexError) as exc:
        # ValueError/IndexError: a malformed status line or Content-Length.
        # The reply may still arrive on this socket: never reuse it.
        if connection.writer is not None:
            connection.writer.close()
        connection.writer = None
        return type(exc).__name__, {}
    return (None if status == 200 else f"HTTP {status}"), headers


async def _closed_client(endpoint: str, requests: Sequence[Prepared], first: int, step: int,
                         timeout: float, tally: _Tally) -> None:
    connection = Connection(endpoint)
    index = first
    try:
        while time.perf_counter() < tally.window.end:
            request = requests[index % len(requests)]
            index += step
            started = time.perf_counter()
            error, headers = await _send(connection, request.data, timeout)
            tally.record(started, time.perf_counter(), request.items, error, headers)
    finally:
        await connection.close()


def _start(warmup: float, duration: float,
           cpu_pids: Sequence[int]) -> tuple[_Tally, asyncio.Task[CpuUse]]:
    """The tally of a window starting after `warmup`, and the CPU meter over it."""
    now = time.perf_counter()
    window = _Window(now + warmup, now + warmup + duration)
    return _Tally(window), asyncio.create_task(cpu_over(window.start, window.end, cpu_pids))


async def closed_loop(endpoint: str, requests: Sequence[Prepared], clients: int, *,
                      warmup: float, duration: float, timeout: float = 30.0,
                      cpu_pids: Sequence[int] = ()) -> LoadResult:
    """`clients` connections, each with one request in flight at a time."""
    if clients < 1:
        raise ValueError(f"clients must be >= 1, got {clients}")
    tally, meter = _start(warmup, duration, cpu_pids)
    await asyncio.gather(*(_closed_client(endpoint, requests, k, clients, timeout, tally)
                           for k in range(clients)))
    return _result("closed", clients, duration, tally, clients, await meter)


async def closed_loop_calls(call: CallFn, requests: Sequence[list[str]], clients: int, *,
                            warmup: float, duration: float, timeout: float = 30.0,
                            cpu_pids: Sequence[int] = ()) -> LoadResult:
    """`closed_loop` through a client library instead of raw HTTP (e.g. the official
    `openai` client): `clients` tasks, each awaiting `call(texts)` in turn, counted
    the same way; an exception counts as an error of its type."""
    if clients < 1:
        raise ValueError(f"clients must be >= 1, got {clients}")
    if duration <= 0 or warmup < 0:
        raise ValueError("duration must be > 0 and warmup >= 0")
    tally, meter = _start(warmup, duration, cpu_pids)

    async def client(index: int) -> None:
        while time.perf_counter() < tally.window.end:
            texts = requests[index % len(requests)]
            index += clients
            started = time.perf_counter()
            error = None
            try:
                await asyncio.wait_for(call(texts), timeout)
            except Exception as exc:
                error = type(exc).__name__
            tally.record(started, time.perf_counter(), len(texts), error, {})

    await asyncio.gather(*(client(k) for k in range(clients)))
    return _result("closed", clients, duration, tally, clients, await meter)


async def open_loop(endpoint: str, requests: Sequence[Prepared], rate: float, *,
                    warmup: float, duration: float, timeout: float = 30.0,
                    max_connections: int = 256, seed: int = 0,
                    cpu_pids: Sequence[int] = ()) -> LoadResult:
    """Poisson arrivals at `rate` per second, each on a free pooled connection."""
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate must be > 0, got {rate}")
    if max_connections < 1:
        raise ValueError(f"max_connections must be >= 1, got {max_connections}")
    rng = random.Random(seed)
    now = time.perf_counter()
    tally, meter = _start(warmup, duration, cpu_pids)
    idle: list[Connection] = []
    opened: list[Connection] = []
    in_flight: set[asyncio.Task[None]] = set()

    async def fire(connection: Connection, request: Prepared, scheduled: float) -> None:
        error, headers = await _send(connection, request.data, timeout)
        tally.record(scheduled, time.perf_counter(), request.items, error, headers)
        idle.append(connection)

    # The schedule is absolute (each arrival = the previous one + an exponential gap),
    # never "now + gap": slow responses cannot push later arrivals back.
    scheduled = now + rng.expovariate(rate)
    index = 0
    while scheduled < tally.window.end:
        await asyncio.sleep(max(0.0, scheduled - time.perf_counter()))
        request = requests[index % len(requests)]
        index += 1
        if idle:
            connection = idle.pop()
        elif len(opened) < max_connections:
            connection = Connection(endpoint)
            opened.append(connection)
        else:
            if tally.window.start <= scheduled:
                tally.attempted += 1
                tally.dropped += 1
            scheduled += rng.expovariate(rate)
            continue
        task = asyncio.create_task(fire(connection, request, scheduled))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
        scheduled += rng.expovariate(rate)
    if in_flight:
        await asyncio.wait(in_flight)
    for connection in opened:
        with contextlib.suppress(OSError):
            await connection.close()
    return _result("open", rate, duration, tally, len(opened), await meter)


def _result(mode: str, offered: float, duration: float, tally: _Tally,
            connections: int, cpu: CpuUse) -> LoadResult:
    lat = np.array(tally.latencies_ms) if tally.latencies_ms else None
    cpu_ms, client_cpu_ms = cpu.ms_per_request(tally.completed)
    return LoadResult(
        mode=mode,
        offered=offered,
        duration=duration,
        requests=tally.completed,
        items=tally.completed_items,
        req_per_s=tally.completed / duration,
        items_per_s=tally.completed_items / duration,
        p50_ms=percentile(lat, 50),
        p90_ms=percentile(lat, 90),
        p99_ms=percentile(lat, 99),
        errors=sum(tally.errors.values()),
        error_kinds=dict(tally.errors),
        dropped=tally.dropped,
        attempted=tally.attempted,
        median_batch_requests=(float(statistics.median(tally.batch_requests))
                               if tally.batch_requests else None),
        simulated=tally.simulated is not None,
        simulated_device=tally.simulated,
        connections=connections,
        warmup_errors=tally.warmup_errors,
        cpu_ms_per_request=cpu_ms,
        client_cpu_ms_per_request=client_cpu_ms,
    )


async def run_load(endpoint: str, requests: Sequence[Prepared], mode: str, offered: float, *,
                   warmup: float, duration: float, timeout: float = 30.0,
                   max_connections: int = 256, seed: int = 0,
                   cpu_pids: Sequence[int] = ()) -> LoadResult:
    """One load level: `offered` clients (closed) or arrivals/s (open); CPU is measured
    for `cpu_pids` (the stack's processes) and for this process."""
    if duration <= 0 or warmup < 0:
        raise ValueError("duration must be > 0 and warmup >= 0")
    if mode == "closed":
        if offered != int(offered):
            raise ValueError(f"closed loop needs a whole number of clients, got {offered}")
        return await closed_loop(endpoint, requests, int(offered), warmup=warmup,
                                 duration=duration, timeout=timeout, cpu_pids=cpu_pids)
    if mode == "open":
        return await open_loop(endpoint, requests, offered, warmup=warmup, duration=duration,
                               timeout=timeout, max_connections=max_connections, seed=seed,
                               cpu_pids=cpu_pids)
    raise ValueError(f"mode must be 'closed' or 'open', got {mode!r}")
