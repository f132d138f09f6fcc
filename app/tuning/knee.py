"""The knee of a load curve, and when a load sweep should stop. Pure: no I/O.

Throughput grows with offered load until the server saturates; past that,
more load only queues, and tail latency climbs. The useful operating point
is the most throughput the server gives before the tail blows up. "Blows
up" is relative to the server itself: the p99 at the lowest load is the
baseline, and a load is acceptable while its p99 stays within a factor of it.

Definition implemented by `find_knee` (points in any order):

1. Points are sorted by load, repeated loads by p99 (best first, missing
   last), so a repeated measurement never hides a good one. The baseline
   is the p99 of the lowest load (the median p99 when several points share
   it). Without a finite, positive baseline, or when the lowest load itself
   has too many errors, there is no knee (None).
2. A point *violates* when its p99 > p99_factor x baseline (the limit itself
   is within), its p99 is missing (None, NaN, inf: nothing succeeded), or its
   error rate > max_error_rate. Fast errors must not pass for low latency.
3. Non-monotone curves: the curve *breaks* at the first violating point that
   is the last point or is followed by another violating point. A single
   violating point followed by a good one is noise (on a busy machine a p99
   is a handful of samples): it is skipped, not a candidate. Points after the
   break are ignored even if their p99 comes back down: past overload that
   is an artefact (drops, timeouts, a cache), not capacity.
4. The knee is the candidate (non-violating point before the break) with the
   highest throughput; ties (equal throughput) go to the first in that
   order, i.e. the lowest load, which serves the same for less queueing.
   When throughput falls after saturation, the knee is still the peak, not
   the last good load.
5. `Knee.confirmed` is True when a higher load than the knee was measured: a
   load that broke the bound or gave no more throughput. False means the
   knee is only the highest load tried; the reason says to raise the load.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Point:
    load: float  # offered: clients (closed loop) or arrivals/s (open loop)
    throughput: float  # completed requests/s
    p50_ms: float | None
    p99_ms: float | None
    error_rate: float = 0.0  # failed (or dropped) / attempted


@dataclass(frozen=True)
class Knee:
    point: Point
    index: int  # into the points as given
    baseline_p99_ms: float
    limit_p99_ms: float
    confirmed: bool
    reason: str


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _check(p99_factor: float, max_error_rate: float) -> None:
    if not (math.isfinite(p99_factor) and p99_factor >= 1.0):
        raise ValueError(f"p99_factor must be a finite number >= 1, got {p99_factor}")
    if not 0.0 <= max_error_rate <= 1.0:
        raise ValueError(f"max_error_rate must be within 0..1, got {max_error_rate}")


def baseline_p99(points: Sequence[Point], max_error_rate: float = 0.01) -> float | None:
    """The median p99 at the lowest load; None if that is unusable (see the module doc)."""
    if not points:
        return None
    lowest = min(p.load for p in points)
    first = [p for p in points if p.load == lowest]
    if any(not _finite(p.p99_ms) or p.error_rate > max_error_rate for p in first):
        return None
    value = statistics.median(p.p99_ms for p in first)  # type: ignore[misc]
    return value if value > 0 else None


def violates(point: Point, limit_ms: float, max_error_rate: float) -> bool:
    return (not _finite(point.p99_ms) or point.p99_ms > limit_ms  # type: ignore[operator]
            or point.error_rate > max_error_rate)


def _why(point: Point, limit_ms: float, max_error_rate: float) -> str:
    if not _finite(point.p99_ms):
        return f"no successful responses at load {point.load:g}"
    if point.error_rate > max_error_rate:
        return f"error rate {point.error_rate:.1%} at load {point.load:g}"
    return f"p99 {point.p99_ms:.1f} ms > {limit_ms:.1f} ms at load {point.load:g}"


def find_knee(points: Sequence[Point], p99_factor: float = 2.0,
              max_error_rate: float = 0.01) -> Knee | None:
    """The knee as defined in the module docstring, or None without a usable baseline."""
    _check(p99_factor, max_error_rate)
    baseline = baseline_p99(points, max_error_rate)
    if baseline is None:
        return None
    limit = p99_factor * baseline
    order = sorted(range(len(points)), key=lambda i: (
        points[i].load, points[i].p99_ms if _finite(points[i].p99_ms) else math.inf))
    bad = [violates(points[i], limit, max_error_rate) for i in order]
    cut = len(order)
    for k, is_bad in enumerate(bad):
        if is_bad and (k + 1 == len(order) or bad[k + 1]):
            cut = k
            break
    candidates = [order[k] for k in range(cut) if not bad[k]]
    skipped = [points[order[k]] for k in range(cut) if bad[k]]
    # The first point in `order` has p99 <= the baseline (a median of its load's p99s) and
    # acceptable errors, so it is a candidate and this is not empty.
    best = max(points[i].throughput for i in candidates)
    index = next(i for i in candidates if points[i].throughput == best)
    knee = points[index]
    confirmed = any(p.load > knee.load for p in points)
    bound = f"{p99_factor:g}x the baseline p99 {baseline:.1f} ms (limit {limit:.1f} ms)"
    if cut < len(order):
        broke = points[order[cut]]
        reason = (f"highest throughput ({knee.throughput:.1f}/s) at load {knee.load:g} before "
                  f"the curve broke {bound}: {_why(broke, limit, max_error_rate)}")
    elif confirmed:
        reason = (f"throughput peaked at load {knee.load:g} ({knee.throughput:.1f}/s) and did "
                  f"not grow at higher loads; p99 stayed within {bound}")
    else:
        reason = (f"p99 stayed within {bound} at every load measured: the knee is at or beyond "
                  f"the highest load, {knee.load:g}; raise the load to find it")
    if skipped:
        noise = ", ".join(_why(p, limit, max_error_rate) for p in skipped)
        reason += f" (ignored as isolated noise: {noise})"
    return Knee(knee, index, baseline, limit, confirmed, reason)


# --------------------------------------------------------------------------- the sweep


@dataclass(frozen=True)
class SweepPolicy:
    """Raise the load geometrically until the knee is passed.

    Stops when the latest `confirm` points all violate the bound (see
    `find_knee`), when throughput has gained less than `min_gain` over the
    best earlier point `patience` times in a row, or at `max_load`.
    """

    start: float = 1.0
    growth: float = 2.0
    max_load: float = 1024.0
    p99_factor: float = 2.0
    max_error_rate: float = 0.01
    min_gain: float = 0.03
    patience: int = 2
    confirm: int = 1
    integer: bool = True  # closed loop: loads are client counts

    def __post_init__(self) -> None:
        _check(self.p99_factor, self.max_error_rate)
        if not self.growth > 1.0:
            raise ValueError(f"growth must be > 1, got {self.growth}")
        if not 0 < self.start <= self.max_load:
            raise ValueError(f"need 0 < start <= max_load, got {self.start}, {self.max_load}")
        if self.integer and self.start != int(self.start):
            raise ValueError(f"integer loads need an integer start, got {self.start}")
        if self.patience < 1 or self.confirm < 1:
            raise ValueError("patience and confirm must be >= 1")


@dataclass(frozen=True)
class Step:
    load: float | None  # None: stop
    reason: str


def grow(load: float, policy: SweepPolicy) -> float:
    """The next load up: x growth, at least +1 for integer loads, at most max_load."""
    raised = load * policy.growth
    if policy.integer:
        # ceil, not round: x1.5 from 1 must move, and 2.5 must not round down to 2.
        raised = max(load + 1, math.ceil(raised - 1e-9))
    return min(raised, policy.max_load)


def next_load(points: Sequence[Point], policy: SweepPolicy | None = None) -> Step:
    """The next load to measure after `points` (in the order measured), or why to stop."""
    policy = policy or SweepPolicy()
    if not points:
        return Step(policy.start, "first load")
    baseline = baseline_p99(points, policy.max_error_rate)
    if baseline is None:
        return Step(None, f"no usable baseline at load {min(p.load for p in points):g} "
                          "(no successful responses, or too many errors)")
    limit = policy.p99_factor * baseline
    recent = points[-policy.confirm:]
    if len(recent) == policy.confirm and all(
            violates(p, limit, policy.max_error_rate) for p in recent):
        return Step(None, f"{_why(points[-1], limit, policy.max_error_rate)} (bound: "
                          f"{policy.p99_factor:g}x the baseline p99 {baseline:.1f} ms, "
                          f"{policy.max_error_rate:.0%} errors)")
    flat = 0
    for k in range(len(points) - 1, 0, -1):
        before = max(p.throughput for p in points[:k])
        if before > 0 and points[k].throughput < before * (1 + policy.min_gain):
            flat += 1
        else:
            break
    if flat >= policy.patience:
        return Step(None, f"throughput gained < {policy.min_gain:.0%} over the best earlier "
                          f"load {flat} times in a row")
    highest = max(p.load for p in points)
    if highest >= policy.max_load:
        return Step(None, f"reached the maximum load {policy.max_load:g}")
    return Step(grow(highest, policy), f"x{policy.growth:g}")
