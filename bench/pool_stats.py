"""bench.pool's numbers, pure: the workers' counters and logs, one run's row, p99 over time
and the recovery after a popularity rotation, a burst's numbers, and the medians and
ratios over rounds."""

from __future__ import annotations

import re
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from app.tuning.stats import median, percentile
from bench.pool_traffic import TIERS

COUNTERS = ("shoal_model_loads_total", "shoal_model_evictions_total",
            "shoal_model_load_seconds_bucket")
# A load that took longer than this read its model from disk (the sim's 2 s loads); a
# shorter one was a reload from the host-memory tier (0.2 s).
SLOW_LOAD_S = "1.0"
# The deployments a user could pick instead of the pool: the best of them is the bar.
ROUTERS = ("router", "mux", "mux-host")
POOLS = ("pool", "pool-nohost", "pool-lru")

__all__ = ["percentile"]


def parse_counters(text: str, names: Sequence[str]) -> dict[tuple[str, tuple], float]:
    """Samples of the Prometheus counters `names` in an exposition text: {(name, sorted
    label pairs): value} (the `_total` samples, not `_created`)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def counter_delta(before: dict[tuple[str, tuple], float], after: dict[tuple[str, tuple], float],
                  name: str, **labels: str) -> float:
    """How much the samples of `name` whose labels include `labels` grew."""
    total = 0.0
    for key, value in after.items():
        sample, pairs = key
        if sample != name or any(dict(pairs).get(k) != v for k, v in labels.items()):
            continue
        total += value - before.get(key, 0.0)
    return total


LOG_LINE = re.compile(r"\[(?P<when>[^\]]+?)(?:,\d+)?: \w+/\w+\] (?P<what>(?:loading|loaded|"
                      r"evicting) .*)$")


def log_events(log_text: str) -> dict[str, Any]:
    """Counts of a worker log's pool events (loads started, loads ended, evictions) and
    its tracebacks and errors."""
    starts: Counter = Counter()
    evicted: Counter = Counter()
    for line in log_text.splitlines():
        match = LOG_LINE.search(line)
        if not match:
            continue
        words = match.group("what").split()
        if words[0] == "loading":
            starts[words[1]] += 1
        elif words[0] == "evicting":
            evicted[words[1]] += 1
    return {"loads_started": sum(starts.values()), "evictions": sum(evicted.values()),
            "loads_by_model": dict(starts), "evictions_by_model": dict(evicted),
            "tracebacks": log_text.count("Traceback"),
            "errors": sum(1 for line in log_text.splitlines()
                          if "ERROR/" in line or "CRITICAL/" in line)}


# --- one run ---------------------------------------------------------------------------------


def _latencies(outcomes: Sequence[Any]) -> list[float]:
    return [(o.done - o.sent) * 1000 for o in outcomes if o.ok]


def tier_row(outcomes: Sequence[Any]) -> dict[str, Any]:
    ok = _latencies(outcomes)
    failed = sum(1 for o in outcomes if not o.ok)
    return {"requests": len(ok), "p50_ms": percentile(ok, 50), "p99_ms": percentile(ok, 99),
            "errors": failed, "error_rate": failed / (failed + len(ok)) if failed + len(ok)
            else None}


def summarize(window: Any, worker_names: Sequence[str], weights: Sequence[float]) -> dict:
    """One deployment's row: throughput, latency per tier (a burst's extra requests apart),
    errors, loads, evictions, who served what, the client's sending and the CPU."""
    duration = window.seconds
    outcomes = window.outcomes
    steady = [o for o in outcomes if not o.burst]
    ok = [o for o in outcomes if o.ok]
    completed = [o for o in [*outcomes, *window.outside]
                 if o.ok and window.start <= o.done < window.end]
    commonest = _commonest(outcomes)
    row: dict[str, Any] = {
        "scheduled": len(outcomes), "ok": len(ok), "errors": len(outcomes) - len(ok),
        "error_rate": (len(outcomes) - len(ok)) / len(outcomes) if outcomes else None,
        "error_kinds": dict(Counter(o.error for o in outcomes if not o.ok)),
        "errors_by_rank": dict(sorted(Counter(o.rank for o in outcomes if not o.ok).items())),
        # The commonest error texts, numbers and model ids blurred so that alike ones count
        # together.
        "error_messages": dict(Counter(_blur(o.message) for o in outcomes
                                       if not o.ok).most_common(8)),
        # The first few errors other than the commonest kind, with their wall-clock time.
        "rare_errors": [{"rank": o.rank, "code": o.error, "message": o.message,
                         "at": time.strftime("%H:%M:%S", time.localtime(o.wall))
                         + f".{int(o.wall % 1 * 1000):03d}"}
                        for o in [o for o in outcomes if not o.ok and o.error != commonest][:20]],
        "offered_per_s": len(outcomes) / duration,
        "req_per_s": len(completed) / duration,
        "p50_ms": percentile(_latencies(outcomes), 50),
        "p99_ms": percentile(_latencies(outcomes), 99),
    }
    for name, first, last in TIERS:
        mine = [o for o in steady if first <= o.rank <= last]
        row[name] = tier_row(mine)
        row[name]["completed_per_s"] = sum(1 for o in completed if not o.burst
                                           and first <= o.rank <= last) / duration
    # The client: how many it got to send in the window, and how late.
    sent = [o for o in [*outcomes, *window.outside] if window.start <= o.started < window.end]
    row["client_sent_per_s"] = len(sent) / duration
    row["send_lag_p99_ms"] = percentile([(o.started - o.sent) * 1000 for o in outcomes
                                         if o.started], 99)
    # Who served what: per worker, its requests by rank, and its simulated busy share.
    by_worker: dict[str, Counter] = {}
    busy: dict[str, float] = {}
    for o in completed:
        key = _worker_index(o.worker, worker_names)
        by_worker.setdefault(key, Counter())[o.rank] += 1
        busy[key] = busy.get(key, 0.0) + o.busy_ms
    row["utilisation"] = {k: busy.get(k, 0.0) / (duration * 1000)
                          for k in (f"w{i}" for i in range(len(worker_names)))}
    row["utilisation_mean"] = statistics.fmean(row["utilisation"].values())
    row["served_by"] = {k: dict(sorted(v.items())) for k, v in sorted(by_worker.items())}
    row["traffic_share"] = {k: sum(v.values()) / max(1, len(completed))
                            for k, v in sorted(by_worker.items())}
    # Ranks that several workers served (each at least 5% of the rank's requests).
    counts = {rank: [by_worker.get(f"w{i}", Counter())[rank] for i in range(len(worker_names))]
              for rank in range(1, len(weights) + 1)}
    row["ranks_on_several"] = [r for r, c in counts.items()
                               if sum(c) and sum(1 for x in c if x >= 0.05 * sum(c)) >= 2]
    minutes = duration / 60
    loads = [counter_delta(b, a, "shoal_model_loads_total", outcome="ok")
             for b, a in zip(window.before, window.after, strict=True)]
    failed = [counter_delta(b, a, "shoal_model_loads_total") - ok_loads
              for b, a, ok_loads in zip(window.before, window.after, loads, strict=True)]
    evictions = [counter_delta(b, a, "shoal_model_evictions_total")
                 for b, a in zip(window.before, window.after, strict=True)]
    slow = [counter_delta(b, a, "shoal_model_load_seconds_bucket", le="+Inf")
            - counter_delta(b, a, "shoal_model_load_seconds_bucket", le=SLOW_LOAD_S)
            for b, a in zip(window.before, window.after, strict=True)]
    row["slow_loads_per_min"] = sum(slow) / minutes
    row["loads"] = sum(loads)
    row["loads_per_min"] = sum(loads) / minutes
    row["loads_per_min_by_worker"] = [v / minutes for v in loads]
    row["failed_loads"] = sum(failed)
    row["evictions_per_min"] = sum(evictions) / minutes
    row["evictions_per_min_by_worker"] = [v / minutes for v in evictions]
    queued = [o.queue_ms for o in ok if o.queue_ms is not None]
    row["queue_ms_p99"] = percentile(queued, 99)
    row["cpu"] = cpu_use(*window.cpu) if len(window.cpu) == 2 else None
    return row


def cpu_use(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Between two cpu samples: the machine's busy share (all cores), and the cores the
    client and each worker used."""
    wall = max(1e-9, after["wall"] - before["wall"])
    total = after["machine_total"] - before["machine_total"]

    def cores(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else (a - b) / wall

    return {"machine": (after["machine_busy"] - before["machine_busy"]) / total if total
            else None, "client_cores": cores(after["client"], before["client"]),
            "worker_cores": [cores(a, b) for a, b in zip(after["workers"], before["workers"],
                                                         strict=True)]}


def _commonest(outcomes: Sequence[Any]) -> str | None:
    kinds = Counter(o.error for o in outcomes if not o.ok).most_common(1)
    return kinds[0][0] if kinds else None


def _blur(message: str | None) -> str:
    text = re.sub(r"\d+(\.\d+)?", "N", message or "")
    return re.sub(r"[\w.-]+/[\w.-]+", "MODEL", text)[:300]


def _worker_index(worker: str | None, names: Sequence[str]) -> str:
    for i, name in enumerate(names):
        if worker and worker.startswith(f"{name}@"):
            return f"w{i}"
    return "?"


# --- over time: rotations and bursts -------------------------------------------------------


def bucket_p99(points: Sequence[tuple[float, float]], start: float, end: float,
               width: float) -> list[dict[str, Any]]:
    """(time, latency ms) points in [start, end) into buckets of `width` s from `start`:
    each bucket's start (s from `start`), count and p99 (None when empty)."""
    if not width > 0:
        raise ValueError(f"width must be > 0, got {width}")
    n = max(0, int((end - start) / width + 1 - 1e-9))
    groups: list[list[float]] = [[] for _ in range(n)]
    for at, latency in points:
        k = int((at - start) // width)
        if start <= at < end and 0 <= k < n:
            groups[k].append(latency)
    return [{"t": k * width, "n": len(g), "p99_ms": percentile(g, 99)}
            for k, g in enumerate(groups)]


def recovery_s(buckets: Sequence[dict[str, Any]], steady_ms: float | None,
               factor: float = 1.5) -> float | None:
    """Buckets from a rotation on (their `t` from it): when p99 is back within `factor` x
    `steady_ms` for good, i.e. the start of the first bucket from which every bucket with
    requests is; None when the last one still is not (or nothing to compare)."""
    if steady_ms is None:
        return None
    bound = factor * steady_ms
    answer = None
    for bucket in buckets:
        p99 = bucket["p99_ms"]
        if p99 is None:
            continue
        if p99 > bound:
            answer = None
        elif answer is None:
            answer = bucket["t"]
    return answer


def rotation_stats(outcomes: Sequence[Any], run_start: float, window: tuple[float, float],
                   rotations: Sequence[float], width: float,
                   factor: float = 1.5) -> dict[str, Any]:
    """p99 over the window in buckets of `width` s (from the window's start), and per
    rotation (offsets from the run's start): the steady p99 before it (the second half of
    the segment before it, from the window's start on), the worst bucket after it, and the
    recovery time (`recovery_s`, buckets from the rotation up to the next one)."""
    points = [(o.sent - run_start, (o.done - o.sent) * 1000) for o in outcomes if o.ok]
    start, end = window
    out: dict[str, Any] = {"buckets": bucket_p99(points, start, end, width), "rotations": []}
    inside = [r for r in rotations if start < r < end]
    for k, at in enumerate(inside):
        previous = inside[k - 1] if k else start
        following = inside[k + 1] if k + 1 < len(inside) else end
        half = (at - previous) / 2
        steady = percentile([v for t, v in points if at - half <= t < at], 99)
        after = bucket_p99(points, at, following, width)
        worst = max((b["p99_ms"] for b in after if b["p99_ms"] is not None), default=None)
        out["rotations"].append({"at": at - start, "steady_p99_ms": steady,
                                 "worst_p99_ms": worst, "recovery_s": recovery_s(
                                     after, steady, factor), "buckets": after})
    return out


def burst_stats(outcomes: Sequence[Any], run_start: float, burst: Any) -> dict[str, Any]:
    """The head's p99 during the burst and outside it (the burst's own requests apart), and
    the burst's requests' p50/p99 and errors."""
    def during(o: Any) -> bool:
        return burst.during(o.sent - run_start)

    head = [o for o in outcomes if not o.burst and o.rank <= 2]
    extra = [o for o in outcomes if o.burst]
    row = tier_row(extra)
    return {"head_p99_during_ms": tier_row([o for o in head if during(o)])["p99_ms"],
            "head_p99_outside_ms": tier_row([o for o in head if not during(o)])["p99_ms"],
            "p50_ms": row["p50_ms"], "p99_ms": row["p99_ms"], "errors": row["errors"],
            "requests": row["requests"], "error_rate": row["error_rate"]}


# --- over rounds -----------------------------------------------------------------------------

METRICS = ("req_per_s", "offered_per_s", "client_sent_per_s", "errors", "error_rate",
           "utilisation_mean", "loads", "loads_per_min", "slow_loads_per_min",
           "evictions_per_min", "p50_ms",
           "p99_ms", "burst.head_p99_during_ms", "burst.head_p99_outside_ms", "burst.p50_ms",
           "burst.p99_ms", "burst.error_rate", "cpu.machine", "cpu.client_cores")


def value(row: dict[str, Any], key: str) -> Any:
    """`key`'s value in a row (dotted: nested); None where the row has none."""
    for part in key.split("."):
        if not isinstance(row, dict) or part not in row:
            return None
        row = row[part]
    return row


def medians(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per deployment, the median over rounds of each number in the tables."""
    keys = [*METRICS, *(f"{t}.{m}" for t, _, _ in TIERS
                        for m in ("p50_ms", "p99_ms", "error_rate", "completed_per_s"))]
    out = {}
    for name in dict.fromkeys(r["deployment"] for r in rows):
        mine = [r for r in rows if r["deployment"] == name]
        out[name] = {}
        for k in keys:
            values = [v for v in (value(r, k) for r in mine) if v is not None]
            out[name][k] = median(values) if values else None
        out[name]["rounds"] = len(mine)
    return out


def ratios(rows: list[dict[str, Any]], base: str | Sequence[str] = "partition",
           names: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    """p99 per tier of each deployment (or of `names`) over `base`'s in the same round; with
    several bases, over the lowest of theirs (the better router): every round's and their
    median."""
    bases = [base] if isinstance(base, str) else list(base)
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r["deployment"] for r in rows):
        if name in bases or (names is not None and name not in names):
            continue
        per: dict[str, list[float]] = {t: [] for t, _, _ in TIERS}
        against: dict[str, list[str]] = {t: [] for t, _, _ in TIERS}
        for row in (r for r in rows if r["deployment"] == name):
            others = [r for r in rows if r["deployment"] in bases and r["round"] == row["round"]]
            for tier, _, _ in TIERS:
                candidates = [(o[tier]["p99_ms"], o["deployment"]) for o in others
                              if o[tier]["p99_ms"]]
                if row[tier]["p99_ms"] and candidates:
                    best, who = min(candidates)
                    per[tier].append(row[tier]["p99_ms"] / best)
                    against[tier].append(who)
        if any(per.values()):
            out[name] = {t: {"rounds": v, "median": median(v) if v else None,
                             **({"against": against[t]} if len(bases) > 1 else {})}
                         for t, v in per.items()}
    return out
