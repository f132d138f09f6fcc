"""bench.coldstart's pure parts: the engines it compares, the loads a worker's log
reports, and the runtime and end-to-end tables."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from app.tuning import markdown
from app.tuning.stats import median, ratio
from bench.lib.minilm import MINILM

ENGINES = ("pytorch", "onnx")
LOADED_LINE = re.compile(r"loaded (?P<key>\S+) \((?P<mib>[\d.]+) MiB\) in (?P<s>[\d.]+)s")


def logged_loads(log: str, model: str = MINILM) -> list[float]:
    """The load seconds of `model` (not its LoRA adapters) a worker's log reports, in order."""
    return [float(m["s"]) for m in LOADED_LINE.finditer(log) if m["key"] == model]


def _num(value: float | None, spec: str = ".0f") -> str:
    return markdown.dash(value, spec)


def engine_order(engines: Sequence[str], repeat: int) -> list[str]:
    """The engines of repeat `repeat` (0-based), in the order they run: as given on even
    repeats, reversed on odd ones, so neither always runs first (after the other's
    processes exit, with the page cache as the other left it)."""
    return list(engines) if repeat % 2 == 0 else list(reversed(engines))


def _columns(engines: Sequence[str], by_engine: Mapping[str, Sequence[float | None]]
             ) -> list[str]:
    """p50 of each engine, then onnx/pytorch when both ran."""
    p50 = {e: median(by_engine[e]) for e in engines}
    cells = [_num(p50[e]) for e in engines]
    if set(engines) == set(ENGINES):
        cells.append(_num(ratio(p50["onnx"], p50["pytorch"]), ".2f"))
    return cells


def _header(engines: Sequence[str], first: str) -> list[str]:
    head = [first, *(f"{e} p50" for e in engines)]
    return [*head, "onnx / pytorch"] if set(engines) == set(ENGINES) else head


def runtime_table(samples: Mapping[str, Sequence[Mapping[str, float]]]) -> str:
    """`samples`: engine -> its repeats' samples."""
    engines = [e for e in ENGINES if e in samples]
    keys = (("start_ms", "runtime start to ready (no model), ms"),
            ("first_load_ms", "first load, fresh runtime, ms"),
            ("first_request_ms", "first request after it (one text), ms"),
            ("start_to_first_answer_ms", "start + first load + first request, ms"),
            ("reload_ms", "reload after unload, same runtime, ms"))
    rows = [[label, *_columns(engines, {e: [s.get(key) for s in samples[e]]
                                        for e in engines})] for key, label in keys]
    lines = markdown.table(_header(engines, "in the runtime"), rows,
                           align="l" + "r" * (len(rows[0]) - 1))
    for e in engines:
        lines += ["", f"{e}, each (start/first load/first request ms): " + ", ".join(
            f"{_num(s['start_ms'])}/{_num(s['first_load_ms'])}/"
            f"{_num(s.get('first_request_ms'))}" for s in samples[e])]
    return "\n".join(lines)


def e2e_table(workers: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    """`workers`: engine -> one record per fresh worker (`e2e_coldstarts`)."""
    engines = [e for e in ENGINES if e in workers]

    def column(path: tuple[str, str]) -> dict[str, list[float | None]]:
        part, key = path
        return {e: [(w.get(part) or {}).get(key) if part else w.get(key) for w in workers[e]]
                for e in engines}

    keys = ((("", "consuming_ms"), "worker start to consuming, ms"),
            (("first", "latency_ms"), "first request: latency ms"),
            (("first", "queue_ms"), "first request: X-Queue-Time-Ms"),
            (("first", "load_ms"), "first request: the worker's logged load, ms"),
            (("", "first_answer_ms"), "worker start to first answer, ms"),
            (("cold", "latency_ms"), "request after shoal_unload: latency ms"),
            (("cold", "load_ms"), "request after shoal_unload: logged load, ms"),
            (("warm", "latency_ms"), "the next one (warm): latency ms"),
            (("warm", "inference_ms"), "the next one (warm): X-Inference-Time-Ms"),
            (("", "rss_mib"), "worker's memory after them (RSS, all its processes), MiB"))
    rows = [[label, *_columns(engines, column(path))] for path, label in keys]
    lines = markdown.table(_header(engines, "end to end (one text per request)"), rows,
                           align="l" + "r" * (len(rows[0]) - 1))
    for e in engines:
        lines += ["", f"{e}, each (start to consuming/first answer ms): " + ", ".join(
            f"{_num(w.get('consuming_ms'))}/{_num(w.get('first_answer_ms'))}"
            for w in workers[e])]
    return "\n".join(lines)
