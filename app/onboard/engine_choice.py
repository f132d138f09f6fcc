"""Which engine a catalog entry is served with on this device (`shoal tune`): each engine
that can serve the entry is checked against the reference library at the same parity
bound onboarding holds a model to (`app.onboard.parity`), timed in process on the
benchmark mix, and the fastest whose parity holds is written to the device's profile as
its `runtime` (the worker serves the entry with it unless the entry or SHOAL_RUNTIME
names an engine: `app.worker.runtime.runtime_of_models`).

`shoal onboard` makes the same choice among its candidates (`app.onboard.tuning`),
with live sweeps; `shoal tune` starts from a catalog entry and keeps its batching
search for the engine chosen here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class EngineTrial:
    """One engine's parity and in-process rate on the entry."""

    runtime: str
    precision: str
    parity_ok: bool = False
    figures: dict[str, float] = field(default_factory=dict)
    tokens_per_s: float = 0.0
    samples: list[tuple[int, int, float]] = field(default_factory=list)
    note: str = ""


def engine_candidates(entry: Any, device: str) -> list[tuple[str, str]]:
    """(engine, precision) of each engine the registry tries for `entry`
    (`tasks.engines.computing`) on `device`: the profile's precision where the engine
    computes in it there, else fp32. An entry that names its engine (`runtime:`) has that
    one only."""
    from runtimes.model_files.precision import device_kind, profile_on
    from tasks import engines

    profile = profile_on(entry, device)
    wanted = profile.precision if profile is not None else None
    cpu = device_kind(device) != "cuda"
    found = []
    for registered in engines.computing(entry):
        if entry.names_runtime and registered.name != entry.runtime:
            continue
        allowed = registered.cpu_precisions if cpu else registered.precisions
        found.append((registered.name, wanted if wanted in allowed else "fp32"))
    return found


def choose_engine(entry: Any, requests: list[list[str]], device: str = "cpu",
                  calibrate: Callable[..., list[tuple[int, int, float]]] | None = None,
                  say: Callable[[str], None] = print) -> tuple[EngineTrial | None,
                                                                list[EngineTrial]]:
    """The fastest engine whose outputs hold the parity bound, and every trial. `calibrate`
    (app.tuning.tune.calibrate's signature) times the in-process batches."""
    from app.onboard.parity import check_parity
    from app.onboard.tuning import measured_throughput
    from app.tuning.tune import calibrate as default_calibrate
    from tasks.sources import resolve_source

    calibrate = calibrate or default_calibrate
    folder = Path(resolve_source(entry.source, local_only=True))
    reference = None
    trials: list[EngineTrial] = []
    for runtime, precision in engine_candidates(entry, device):
        trial = EngineTrial(runtime, precision)
        trials.append(trial)
        try:
            parity, reference = check_parity(entry, folder, engine=runtime,
                                             precision=precision, reference=reference)
        except Exception as exc:  # an engine that cannot load the model is no candidate
            trial.note = f"could not run: {str(exc).splitlines()[0][:160]}"
            say(f"  {runtime} {precision}: {trial.note}")
            continue
        trial.parity_ok, trial.figures = parity.ok, parity.figures
        if not parity.ok:
            trial.note = f"parity failed: {parity.detail}"
            say(f"  {runtime} {precision}: {trial.note}")
            continue
        trial.samples = calibrate(entry, requests, engine=runtime, precision=precision)
        trial.tokens_per_s = measured_throughput(trial.samples)
        say(f"  {runtime} {precision}: parity ok, in process {trial.tokens_per_s:.0f} tokens/s")
    held = [t for t in trials if t.parity_ok and t.tokens_per_s > 0]
    best = max(held, key=lambda t: t.tokens_per_s, default=None)
    return best, trials
