"""`shoal onboard --catalog`: verify and tune every entry of a catalog whose weights are
here, and write the report (the dashboard of what each model does on this device).

Resumable: `state.json` in the report folder keeps each model's report with the hash of
its weights; a model whose weights did not change since is not run again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.onboard.results import Candidate, ModelReport
from tasks.engines import BASELINE, DEFAULT


def _state(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return {}  # a run killed mid-write starts over rather than failing
    return data if isinstance(data, dict) else {}


def _save(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1), encoding="utf-8")
    tmp.replace(path)


def run_one(entry: Any, folder: Path, tune_it: bool, duration: float,
            say: Callable[[str], None]) -> tuple[ModelReport, dict[str, Any] | None]:
    """Parity of the entry as written, then the tuning candidates; the new profile."""
    from app.onboard.detect import Detection
    from app.onboard.onboard import TUNABLE
    from app.onboard.parity import check_parity
    from app.onboard.tuning import parity_at_each, tune

    fields = entry.model_dump(exclude_none=True, exclude={"profiles", "tasks"})
    fields["runtime"] = DEFAULT
    base = entry.model_validate(fields)
    parity, reference = check_parity(base, folder)
    report = ModelReport(model=entry.id, adapter=entry.adapter, status="verified",
                         candidates=[Candidate(*BASELINE, parity.figures, parity.ok,
                                               parity.tolerance)])
    if not parity.ok:
        report.status, report.reason = "refused", f"parity failed: {parity.detail}"
        return report, None
    if not tune_it or entry.adapter not in TUNABLE:
        return report, None

    report.candidates, values = tune(fields, Detection(entry.adapter, "catalog entry"),
                                     parity_at_each(fields, folder, parity, reference),
                                     duration=duration, say=say)
    if values is not None:
        report.status = "tuned"
    return report, values


def run_catalog(catalog_dir: Path, out_dir: Path, *, tune_it: bool = True,
                duration: float = 4.0, write: bool = True, only: list[str] | None = None,
                device: str | None = None, say: Callable[[str], None] = print
                ) -> list[ModelReport]:
    """Every entry with local weights; reports kept in `out_dir/state.json`."""
    from tqdm import tqdm

    from app.onboard.tuning import profile_key
    from app.tuning.tune import write_profile
    from runtimes.onnx.graphs import hash_weights
    from tasks.catalog import Catalog
    from tasks.sources import SourceError, resolve_source

    catalog = Catalog.from_dir(catalog_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state_path = out_dir / "state.json"
    state = _state(state_path)
    reports: list[ModelReport] = []
    entries = catalog.select(only) if only else list(catalog)
    for entry in tqdm(entries, desc="onboard", unit="model"):
        started = time.perf_counter()
        try:
            folder = Path(resolve_source(entry.source, local_only=True))
            digest = hash_weights(folder)
        except (SourceError, ValueError) as exc:
            report = ModelReport(entry.id, entry.adapter, "skipped",
                                 reason=f"weights not here: {str(exc).splitlines()[0]}")
            reports.append(report)
            continue
        done = state.get(entry.id)
        if done and done.get("weights_hash") == digest and done.get("status") != "failed":
            say(f"{entry.id}: unchanged since the last run, kept")
            reports.append(ModelReport.from_json(done))
            continue
        say(f"{entry.id}:")
        try:
            report, values = run_one(entry, folder, tune_it, duration, say)
        except Exception as exc:  # one model's failure must not end the catalog's run
            report, values = ModelReport(entry.id, entry.adapter, "failed",
                                         reason=str(exc).splitlines()[0][:300]), None
        report.weights_hash, report.seconds = digest, time.perf_counter() - started
        report.device = profile_key(device)
        if values is not None and write:
            origin = catalog.origin(entry.id)
            if origin is not None:
                write_profile(origin, profile_key(device), values)
        state[entry.id] = report.to_json()
        _save(state_path, state)
        reports.append(report)
    return reports
