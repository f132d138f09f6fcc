"""Tuning on the present device: for each runtime and precision it offers, parity at that
precision, the cost fit in process, and the knee against the live stack; the fastest
candidate whose parity holds wins.

A full `shoal tune` coordinate search restarts the stack for every setting (minutes per
model). Onboarding spends its live sweeps where they decide something: every candidate's
cost is fitted and its full-batch throughput measured in process (seconds), the live
sweep runs for the baseline (`tasks.engines.BASELINE`, PyTorch fp32, which every profile
is compared with) and for each candidate within `SCREEN_MARGIN` of the best in process,
and the winner's token budget is searched over `TOKEN_BUDGETS`. The candidates are the
engine registry's (`tasks.engines.candidates`): an engine registered there is tried.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.onboard.entry import render
from app.onboard.results import Candidate, CurvePoint
from app.tuning.knee import Knee
from tasks.engines import BASELINE, EntryFacts, candidates

# Candidates within this fraction of the best in-process throughput get a live sweep.
SCREEN_MARGIN = 0.25
TOKEN_BUDGETS = (2048, 4096, 8192)
# One short sweep's knee moves by up to a third between runs on a shared 2-core host
# (bench.onboard_minilm): another token budget replaces the default only when its knee
# is this much better, else the search would follow noise.
SEARCH_TIE = 0.15
START = {"max_tokens": 4096.0, "max_items": 64.0, "max_delay_ms": 0.0,
         "hold_horizon_batches": 2.0}


def device_candidates(entry: EntryFacts, only: list[str] | None = None
                      ) -> list[tuple[str, str]]:
    """(runtime, precision) pairs this machine can serve the entry with, the registry's
    (`tasks.engines.candidates`); `only`: those named as 'runtime:precision' among them."""
    found: list[tuple[str, str]] = list(candidates(entry, _cuda()))
    if only:
        found = [c for c in found if f"{c[0]}:{c[1]}" in only]
    return found


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def device_name() -> str:
    if _cuda():
        import torch

        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()} CPU ({platform.node()})"


def sweep_args(catalog_dir: Path, duration: float, warmup: float) -> argparse.Namespace:
    """What `app.tuning.tune.measure_live` reads from `shoal tune`'s options."""
    return argparse.Namespace(env={}, catalog_dir=catalog_dir, start=1.0, growth=2.0,
                              max_clients=64.0, p99_factor=2.0, warmup=warmup,
                              duration=duration)


def measured_throughput(samples: list[tuple[int, int, float]]) -> float:
    """Estimated padded tokens per second over the largest quarter of the calibration
    batches: what the device does with full batches, measured, not extrapolated from a
    fit (a fit's slope is unreliable beyond the sizes it saw)."""
    ordered = sorted(samples, key=lambda s: s[0])
    top = ordered[len(ordered) - max(1, len(ordered) // 4):]
    seconds = sum(s[2] for s in top)
    return sum(s[0] for s in top) / seconds if seconds > 0 else 0.0


def _knee_fields(candidate: Candidate, knee: Knee | None, points: list[Any]) -> None:
    candidate.curve = [CurvePoint(p.load, p.throughput, p.p50_ms, p.p99_ms) for p in points]
    if knee is not None:
        candidate.knee_throughput = knee.point.throughput
        candidate.knee_p99_ms = knee.point.p99_ms
        candidate.knee_load = knee.point.load


def candidate_fields(fields: dict[str, Any], candidate: Candidate) -> dict[str, Any]:
    """The entry fields that serve `fields`' model with `candidate`: the same fields, the
    entry naming no engine (the candidate's engine and precision go in its device
    profile, `profile_fields`, so another device's profile may choose another)."""
    return dict(fields)


def parity_at_each(fields: dict[str, Any], folder: Path, fp32: Any, reference: Any
                   ) -> Callable[[str, str], Any]:
    """`tune`'s parity_at: each candidate against the fp32 reference, PyTorch fp32's
    being `fp32`, the result already in hand."""
    from app.onboard.parity import check_parity
    from tasks.catalog import ModelEntry

    def parity_at(runtime: str, precision: str) -> Any:
        if (runtime, precision) == BASELINE:
            return fp32
        entry = ModelEntry.model_validate(candidate_fields(fields, Candidate(runtime, precision)))
        return check_parity(entry, folder, engine=runtime, precision=precision,
                            reference=reference)[0]

    return parity_at


def tune(fields: dict[str, Any], detection: Any, parity_at: Callable[[str, str], Any],
         duration: float = 4.0, warmup: float = 1.0, search: bool = True,
         only: list[str] | None = None, say: Callable[[str], None] = print
         ) -> tuple[list[Candidate], dict[str, Any] | None]:
    """Every candidate's parity and cost, the live knee of those worth a sweep, and the
    winner's profile fields (None when no candidate holds parity and has a knee).

    `parity_at(runtime, precision)` returns a ParityResult (app.onboard.parity)."""
    from app.tuning.mix import make_requests
    from app.tuning.tune import calibrate, fit_cost
    from tasks.catalog import ModelEntry

    requests = make_requests(300, "uniform:1:4", "uniform:5:15")
    candidates: list[Candidate] = []
    costs: dict[int, tuple[float, float, float]] = {}
    rates: dict[int, float] = {}  # in-process tokens/s of full batches
    for runtime, precision in device_candidates(ModelEntry.model_validate(fields), only):
        candidate = Candidate(runtime, precision)
        candidates.append(candidate)
        try:
            parity = parity_at(runtime, precision)
        except Exception as exc:  # a runtime that cannot load the model is not a candidate
            candidate.note = f"could not run: {str(exc).splitlines()[0][:160]}"
            say(f"  {candidate.label}: {candidate.note}")
            continue
        candidate.parity, candidate.parity_ok = parity.figures, parity.ok
        candidate.tolerance = parity.tolerance
        if not parity.ok:
            candidate.note = f"parity failed: {parity.detail}"
            say(f"  {candidate.label}: {candidate.note}")
            continue
        entry = ModelEntry.model_validate(candidate_fields(fields, candidate))
        samples = calibrate(entry, requests, reps=2, engine=runtime, precision=precision)
        costs[id(candidate)] = fit_cost(samples)
        rates[id(candidate)] = measured_throughput(samples)
        say(f"  {candidate.label}: parity ok ({_figures(parity.figures)}); in process "
            f"{rates[id(candidate)]:.0f} tokens/s, cost a={costs[id(candidate)][0]:.1f} ms "
            f"b={costs[id(candidate)][1]:.1f} us/token")
    if not costs:
        return candidates, None
    best_rate = max(rates.values())
    with tempfile.TemporaryDirectory(prefix="shoal-onboard-") as tmp:
        catalog_dir = Path(tmp)
        args = sweep_args(catalog_dir, duration, warmup)
        knees: dict[int, Knee | None] = {}  # at START
        for candidate in candidates:
            cost = costs.get(id(candidate))
            if cost is None:
                continue
            baseline = (candidate.runtime, candidate.precision) == BASELINE
            # The baseline is swept even when slower: every profile is compared with it.
            if not baseline and rates[id(candidate)] < (1 - SCREEN_MARGIN) * best_rate:
                candidate.note = (f"not swept: in process {rates[id(candidate)] / best_rate:.0%}"
                                  " of the best")
                continue
            knees[id(candidate)] = _sweep(fields, detection, candidate, cost, dict(START),
                                          args, requests, say)
        winner = _winner(candidates, knees)
        if winner is None:
            return candidates, None
        knee, setting = knees[id(winner)], dict(START)
        if search:
            tried = {setting["max_tokens"]}
            for budget in TOKEN_BUDGETS:
                if budget in tried:
                    continue
                tried.add(budget)
                trial = {**setting, "max_tokens": float(budget)}
                points: list[Any] = []
                other = _sweep(fields, detection, winner, costs[id(winner)], trial, args,
                               requests, say, points)
                if clearly_better(other, knee):
                    knee, setting = other, trial
                    _knee_fields(winner, knee, points)  # the report shows the chosen sweep
    winner.chosen = True
    winner.note = f"max_tokens {setting['max_tokens']:g}" + (
        f" (searched {', '.join(str(b) for b in TOKEN_BUDGETS)})" if search else "")
    return candidates, profile_fields(winner, setting, costs[id(winner)], knee)


def clearly_better(trial: Knee | None, current: Knee | None) -> bool:
    """Whether a trial setting's knee beats the current one by more than SEARCH_TIE in
    throughput (`app.tuning.tune.better` also takes a near-equal knee with a lower p99,
    which a tie this wide would turn into trading throughput away)."""
    if trial is None:
        return False
    return current is None or trial.point.throughput > current.point.throughput * (
        1 + SEARCH_TIE)


def _winner(candidates: list[Candidate], knees: dict[int, Knee | None]) -> Candidate | None:
    from app.tuning.tune import better

    best: Candidate | None = None
    for candidate in candidates:
        if knees.get(id(candidate)) is None:
            continue
        if best is None or better(knees[id(candidate)], knees[id(best)]):
            best = candidate
    return best


def _sweep(fields: dict[str, Any], detection: Any, candidate: Candidate,
           cost: tuple[float, float, float], setting: dict[str, float],
           args: argparse.Namespace, requests: list[list[str]], say: Callable[[str], None],
           points: list[Any] | None = None) -> Knee | None:
    """The live knee of `candidate` at `setting`, its entry in the sweep's own catalog.
    Without `points` the sweep is the candidate's own (its curve and knee are kept on
    it); with them, a trial whose points the caller keeps if it wins."""
    from app.tuning.tune import measure_live

    profile = {"runtime": candidate.runtime, "precision": candidate.precision,
               "cost_a_ms": round(cost[0], 3),
               "cost_b_us": round(cost[1], 3), "cost_c_ns": round(cost[2], 3)}
    text = render(candidate_fields(fields, candidate), detection, [],
                  ("cpu" if not _cuda() else "cuda", profile, []))
    (Path(args.catalog_dir) / "candidate.yaml").write_text(text, encoding="utf-8")
    say(f"  {candidate.label}: live sweep at max_tokens={setting['max_tokens']:g}")
    own = points is None
    points = [] if points is None else points
    knee = measure_live(fields["id"], setting, args, requests, curve=points)
    if own:
        _knee_fields(candidate, knee, points)
        if knee is None:
            candidate.note = "no knee found (p99 past its bound from the lowest load)"
    return knee


def _figures(figures: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.5g}" for k, v in figures.items())


def profile_fields(candidate: Candidate, setting: dict[str, float],
                   cost: tuple[float, float, float], knee: Knee | None) -> dict[str, Any]:
    """The `profiles.<device>` fields of the winner, with its provenance line: its engine
    (`runtime`, which the worker serves the entry with on this device unless the entry
    or SHOAL_RUNTIME names one) and its precision."""
    point = knee.point if knee is not None else None
    parity = _figures(candidate.parity)
    measured = (f"shoal onboard on {dt.date.today().isoformat()} ({device_name()}): "
                f"{candidate.runtime} {candidate.precision}, knee "
                f"{point.throughput:.0f} req/s, p99 {point.p99_ms:.0f} ms at "
                f"{point.load:g} clients; parity {parity}; cost fit a={cost[0]:.1f} ms "
                f"b={cost[1]:.1f} us/token" if point is not None else "no knee found")
    return {
        "max_tokens": int(setting["max_tokens"]), "max_items": int(setting["max_items"]),
        "max_delay_ms": setting["max_delay_ms"],
        "hold_horizon_batches": setting["hold_horizon_batches"],
        "cost_a_ms": round(cost[0], 3), "cost_b_us": round(cost[1], 3),
        "cost_c_ns": round(cost[2], 3), "runtime": candidate.runtime,
        "precision": candidate.precision, "measured": measured,
    }


def profile_key(device: str | None = None) -> str:
    """The `profiles.<key>` onboarding writes: `device` if given (a kind such as l4 or
    h100), else the worker's own default for this machine (cuda or cpu)."""
    return device or ("cuda" if _cuda() else "cpu")
