"""bench.faults' report: one run's row (what the load saw around the fault, duplicates,
the cut worker's own figures) and the table over runs."""

from __future__ import annotations

import argparse
from typing import Any

from app.tuning import markdown
from app.tuning.stats import median
from bench.lib.faults_fleet import Fleet
from bench.lib.faults_load import Load, summarize


def report(fleet_: Fleet, load: Load, marks: dict[str, Any], args: argparse.Namespace,
           checked: dict[str, Any] | None) -> dict[str, Any]:
    fault = marks["fault"]
    window_end = marks.get("heal", marks["load_end"])
    row = summarize(load.shots, fault, args.before, window_end, marks.get("burst"))
    before, after = marks.get("duplicates_before"), marks.get("duplicates_after")
    row["dup_replies"] = None if before is None or after is None else after - before
    row["twice"] = None if checked is None else checked["mismatched"]
    row["verify"] = checked
    row["marks"] = {k: round(v - fault, 2) if isinstance(v, float) else v
                    for k, v in marks.items() if not k.startswith("duplicates")}
    if "detected" in marks:
        row["detect_s"] = marks["detected"] - fault
    if "rejoined" in marks:
        row["rejoin_s"] = marks["rejoined"] - marks.get("heal", fault)
    if args.scenario == "worker-link-cut":
        row.update(cut_worker_figures(fleet_, load, marks, row["late_after_s"]))
    refused = [s.sent - fault for s in load.shots if s.status in (429, 503)]
    if refused:
        row["refused_from_s"], row["refused_to_s"] = min(refused), max(refused)
    # Every request, for plots: sent (s from the fault), latency s, status, code, host.
    row["shots"] = [[round(s.sent - fault, 3),
                     None if s.latency is None else round(s.latency, 4), s.status, s.code,
                     fleet_.host_of(s.worker) if s.worker else None] for s in load.shots]
    ok = [s for s in load.shots if s.status == 200]
    row["answered_by"] = {w.partition("@")[0]: sum(1 for s in ok if s.worker == w)
                          for w in sorted({s.worker for s in ok})}
    return row


def cut_worker_figures(fleet_: Fleet, load: Load, marks: dict[str, Any],
                       late_s: float) -> dict[str, Any]:
    """What w1 held when its link went: requests sent before the broker noticed, answered
    late (stuck) -- by whom -- and whether w1 answered anything while cut off."""
    w1 = f"{fleet_.worker_name('w1')}@"
    fault = marks["fault"]
    noticed = marks.get("detected", marks.get("heal", fault))
    heal = marks.get("heal", marks["load_end"])
    stuck = [s for s in load.shots if s.status == 200 and fault - late_s <= s.sent <= noticed
             and s.latency is not None and s.latency > late_s and s.done is not None
             and s.done > fault]
    return {"held_by_cut": len(stuck),
            "held_answered_by_other": sum(1 for s in stuck if not s.worker.startswith(w1)),
            "answered_by_cut_while_cut": sum(
                1 for s in load.shots if s.worker.startswith(w1) and s.done is not None
                and fault + late_s < s.done <= heal),
            "answered_by_cut_after_heal": sum(
                1 for s in load.shots if s.worker.startswith(w1) and s.sent >= heal)}


def _fmt(value: Any, spec: str = ".1f") -> str:
    if value is None:
        return "-"
    return format(value, spec) if isinstance(value, float) else str(value)


def table(scenario: str, rows: list[dict[str, Any]]) -> str:
    head = ["run", "sent", "in flight", "answered", "retryable", "lost", "twice", "dup replies",
            "p99 before ms", "p99 during ms", "max gap s", "recover s", "detect s"]
    extra = ["held by w1", "of them answered by w2", "rejoin s"] \
        if scenario == "worker-link-cut" else []
    lines = markdown.table(head + extra)

    def cells(r: dict[str, Any], label: str) -> list[str]:
        out = [label, _fmt(r["sent"]), _fmt(r.get("in_flight_at_fault")),
               _fmt(r["answered"]), _fmt(r["retryable"]),
               _fmt(r["lost"]), _fmt(r["twice"]), _fmt(r["dup_replies"], ".0f"),
               _fmt(r["p99_before_ms"], ".0f"), _fmt(r["p99_during_ms"], ".0f"),
               _fmt(r["max_gap_s"]), _fmt(r["recover_s"]), _fmt(r.get("detect_s"))]
        if extra:
            out += [_fmt(r.get("held_by_cut")), _fmt(r.get("held_answered_by_other")),
                    _fmt(r.get("rejoin_s"))]
        return out

    for i, r in enumerate(rows, start=1):
        lines.append(markdown.row(cells(r, str(i))))
    if len(rows) > 1:
        keys = ("p99_before_ms", "p99_during_ms", "max_gap_s", "recover_s", "detect_s",
                "rejoin_s")
        medians = {k: median([r.get(k) for r in rows]) for k in keys}
        total = {k: sum(r[k] or 0 for r in rows)
                 for k in ("sent", "in_flight_at_fault", "answered", "retryable", "lost",
                           "twice", "dup_replies")}
        merged = {**total, **medians, "held_by_cut": sum(r.get("held_by_cut") or 0 for r in rows),
                  "held_answered_by_other": sum(r.get("held_answered_by_other") or 0
                                                for r in rows)}
        lines.append(markdown.row(cells(merged, "all (sum; median of times)")))
    errors: dict[str, int] = {}
    for r in rows:
        for code, count in r["errors"].items():
            errors[code] = errors.get(code, 0) + count
    if errors:
        lines.append("\nerrors by code: " + ", ".join(f"{k}: {v}" for k, v in
                                                      sorted(errors.items())))
    return "\n".join(lines)
