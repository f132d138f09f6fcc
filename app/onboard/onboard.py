"""One model: read its files, detect, prove parity, tune, write the entry (in that order;
nothing is written unless parity holds)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.onboard.detect import Detection, Setting, detect
from app.onboard.entry import entry_fields, file_name, header_lines, locate, model_id, render
from app.onboard.files import ModelFiles, OnboardError
from app.onboard.results import Candidate, ModelReport
from tasks.engines import BASELINE


class ParityRefused(Exception):
    """No choice the files allow makes shoal match the reference; the message says what
    differed."""


@dataclass
class Outcome:
    report: ModelReport
    text: str = ""  # the entry's YAML
    path: Path | None = None  # where it was written
    notes: list[str] = field(default_factory=list)


def _headline(figures: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.6g}" for k, v in list(figures.items())[:2]) or "no figures"


def _candidate_line(c: Candidate) -> str:
    parity = "parity " + (_headline(c.parity) if c.parity else "not run")
    measured = (f"knee {c.knee_throughput:.0f} req/s, p99 {c.knee_p99_ms:.0f} ms"
                if c.knee_throughput else c.note)
    return f"onboard tried {c.label}: {parity}; {measured}".rstrip("; ")


def verify(fields: dict[str, Any], detection: Detection, folder: Path,
           say: Callable[[str], None]) -> tuple[dict[str, Any], Any, Any]:
    """Parity in fp32 on PyTorch for the detected settings, else for the first alternative
    that matches the reference computed from the files' own settings. Returns the fields
    that matched, the ParityResult and the reference."""
    from app.onboard.parity import check_parity
    from tasks.catalog import ModelEntry

    entry = ModelEntry.model_validate(fields)
    result, reference = check_parity(entry, folder)
    say(f"parity ({' '.join(BASELINE)}, {result.library}): {'ok' if result.ok else 'FAILED'} "
        f"{_headline(result.figures)}")
    if result.ok:
        return fields, result, reference
    tried = [f"as the files say: {result.detail}"]
    for name, values in detection.alternatives.items():
        for value in values:
            trial = {**fields, name: value}
            other, _ = check_parity(ModelEntry.model_validate(trial), folder, reference=reference)
            say(f"  trying {name}={value}: {'ok' if other.ok else other.detail}")
            if other.ok:
                detection.settings[name] = Setting(value, f"chosen by parity: the files' "
                                                   f"{detection.value(name)} did not match")
                return trial, other, reference
            tried.append(f"{name}={value}: {other.detail}")
    raise ParityRefused("no choice makes shoal match " + result.library + ": "
                        + "; ".join(tried))


def check_pooling(fields: dict[str, Any], detection: Detection,
                  say: Callable[[str], None]) -> dict[str, Any]:
    """Dense models: does the stated pooling pair paraphrases as well as the others? A
    pooling the files do not state is chosen by the probe; one they state and the weights
    contradict is refused (OnboardError), never written silently."""
    from app.onboard.pooling_probe import doubted, score_poolings

    stated = detection.settings["pooling"]
    poolings = [stated.value, *detection.alternatives.get("pooling", [])]
    scores = score_poolings(fields, poolings)
    figures = ", ".join(f"{p} {s:.2f}" for p, s in scores.items())
    say(f"pooling probe (paraphrase pairing): {figures}")
    better = doubted(stated.value, scores)
    if better is None:
        return fields
    if stated.source.startswith("not stated"):
        detection.settings["pooling"] = Setting(better, f"not stated by the files; chosen by "
                                                f"the pooling probe ({figures})")
        return {**fields, "pooling": better}
    raise OnboardError(f"the files say {stated.value} pooling ({stated.source}) but the "
                       f"weights pair paraphrases far better with {better} ({figures}): "
                       f"saved with the wrong pooling config? Re-run with --pooling "
                       f"{better} to serve {better} (checked against the reference library "
                       "built with it)")


def onboard(source: str, catalog_dir: Path, *, given_id: str | None = None,
            pooling: str | None = None, tune_it: bool = True, write: bool = True,
            force: bool = False, duration: float = 4.0, search: bool = True,
            candidates: list[str] | None = None, device: str | None = None,
            say: Callable[[str], None] = print) -> Outcome:
    """Onboard SOURCE into `catalog_dir`. Raises OnboardError (bad input) or ParityRefused."""
    from tasks.catalog import CatalogError, ModelEntry

    started = time.perf_counter()
    folder, source_fields = locate(source)
    files = ModelFiles.open(folder)
    detection = detect(files)
    if pooling is not None:
        if detection.adapter != "dense":
            raise OnboardError(f"--pooling applies to dense models; this is {detection.adapter}")
        detection.settings["pooling"] = Setting(pooling, "given on the command line")
        detection.alternatives.pop("pooling", None)
    model, id_source = model_id(folder, given_id)
    detection.settings = {"id": Setting(model, id_source), **detection.settings}
    say(f"{model}: {detection.adapter} ({detection.why})")
    for choice in detection.choices():
        say(f"  {choice}")
    fields = entry_fields(model, source_fields, detection)
    try:
        ModelEntry.model_validate(fields)
    except (CatalogError, ValueError) as exc:
        raise OnboardError(f"the detected entry is not valid: {str(exc).splitlines()[0]}"
                           ) from None
    path = catalog_dir / file_name(model)
    if write and path.exists() and not force:
        raise OnboardError(f"{path} exists; pass --force to replace it")
    if detection.adapter == "dense" and pooling is None:
        fields = check_pooling(fields, detection, say)
    fields, parity, reference = verify(fields, detection, folder, say)
    report = ModelReport(model=model, adapter=detection.adapter, status="verified",
                         choices=detection.choices())
    fp32 = Candidate(*BASELINE, parity.figures, True, parity.tolerance)
    report.candidates = [fp32]
    profile = None
    if tune_it and detection.adapter in TUNABLE:
        from app.onboard.tuning import parity_at_each, profile_key, tune

        say("tuning on this device:")
        report.candidates, values = tune(
            fields, detection, parity_at_each(fields, folder, parity, reference),
            duration=duration, search=search, only=candidates, say=say)
        if values is not None:
            # The winner's engine is written in the device's profile (`runtime`), not
            # as the entry's: a profile for another device may choose another engine.
            profile = (profile_key(device), values, [_candidate_line(c) for c in report.candidates])
            report.status = "tuned"
    elif tune_it:
        say(f"not tuned: tuning drives /v1/encode, and {detection.adapter} models serve "
            "another operation (the profile defaults apply)")
    header = header_lines(source, parity.library, _headline(parity.figures))
    text = render(fields, detection, header, profile)
    outcome = Outcome(report, text)
    if write:
        catalog_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        outcome.path = path
    report.seconds = time.perf_counter() - started
    return outcome


# Tuning drives /v1/encode (app.tuning.load); the other operations keep profile defaults.
TUNABLE = {"dense", "sparse", "multivector", "clip"}
