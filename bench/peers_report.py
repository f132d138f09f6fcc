"""bench.peers' pure parts: what is compared (the systems, their names and settings), the
order of the rounds, the request body, and the rounds summarised into the tables, the
verdicts against the targets and the plot."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.tuning import markdown
from app.tuning.markdown import dash as _num
from app.tuning.stats import median, ratio
from bench.lib.minilm import MINILM

PEERS_VENV = Path(__file__).resolve().parent.parent / ".venv-peers"
SERVERS = ("shoal", "infinity")  # the two-system comparison (its table keeps its shape)
SYSTEMS = ("shoal", "shoal-onnx", "shoal-onnx-int8", "shoal-default", "infinity",
           "infinity-onnx")
NAMES = {"shoal": "shoal", "infinity": "Infinity", "shoal-onnx": "shoal ORT fp32",
         "shoal-onnx-int8": "shoal ORT int8", "shoal-default": "shoal default (make run)",
         "infinity-onnx": "Infinity ORT (optimum)"}
# shoal-default sets neither SHOAL_RUNTIME nor SHOAL_PRECISION (`run` drops them from the
# environment): MiniLM's cpu profile chooses its engine, as in `make run` (issue 54).
SHOAL_ENV = {"shoal": {"SHOAL_RUNTIME": "pytorch"},
             "shoal-onnx": {"SHOAL_RUNTIME": "onnx", "SHOAL_PRECISION": "fp32"},
             "shoal-onnx-int8": {"SHOAL_RUNTIME": "onnx", "SHOAL_PRECISION": "int8"},
             "shoal-default": {}}
INFINITY_ENGINE = {"infinity": "torch", "infinity-onnx": "optimum"}
PEERS = tuple(INFINITY_ENGINE)
OFFLINE_ENV = {"DO_NOT_TRACK": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@dataclass(frozen=True)
class Server:
    name: str  # one of SERVERS
    base_url: str  # the OpenAI base URL: requests go to {base_url}/embeddings
    pids: list[int]  # whose CPU is measured


def rotated(systems: Sequence[str], r: int) -> list[str]:
    """The systems in round `r`'s order: rotated by one each round."""
    k = r % len(systems)
    return [*systems[k:], *systems[:k]]


def schedule(rounds: int, levels: Sequence[int],
             systems: Sequence[str] = SERVERS) -> list[tuple[int, int, str]]:
    """(round, clients, system) in run order: every system at each level in turn, in
    an order rotated each round (two: shoal first in even rounds, Infinity in odd)."""
    return [(r, clients, system)
            for r in range(rounds) for clients in levels
            for system in rotated(systems, r)]


def parse_systems(text: str) -> list[str]:
    """`--systems`: a comma-separated subset of SYSTEMS, kept in SYSTEMS' order."""
    asked = {t.strip() for t in text.split(",") if t.strip()}
    unknown = asked - set(SYSTEMS)
    if unknown or not asked:
        raise argparse.ArgumentTypeError(
            f"systems are a comma-separated subset of {','.join(SYSTEMS)}, got {text!r}")
    return [s for s in SYSTEMS if s in asked]


def openai_body(texts: list[str]) -> dict[str, Any]:
    """The OpenAI embeddings body, the same bytes for both servers."""
    return {"model": MINILM, "input": texts}


METRICS = {  # summary key -> how to read it from one run
    "req_per_s": lambda run: run["req_per_s"],
    "p50_ms": lambda run: run["p50_ms"],
    "p99_ms": lambda run: run["p99_ms"],
    "cpu_ms_per_request": lambda run: run["cpu_ms_per_request"].get("total"),
}


def present(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The systems the runs measured, in SYSTEMS' order."""
    seen = {run["server"] for run in runs}
    return [s for s in SYSTEMS if s in seen]


def summarise(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per level: each metric's median over rounds for each system measured (shoal and
    Infinity always have keys), the errors of each over all rounds, and ratios:
    `ratio_{metric}` shoal/Infinity, `ratio_{metric}_{a}_vs_{b}` each shoal system
    over each Infinity one."""
    systems = [s for s in SYSTEMS if s in {*SERVERS, *present(runs)}]
    summary = []
    for clients in sorted({run["clients"] for run in runs}):
        row: dict[str, Any] = {"clients": clients}
        by_system = {s: [r for r in runs if r["clients"] == clients and r["server"] == s]
                     for s in systems}
        for key, read in METRICS.items():
            for s in systems:
                row[f"{s}_{key}"] = median([read(run) for run in by_system[s]])
            row[f"ratio_{key}"] = ratio(row[f"shoal_{key}"], row[f"infinity_{key}"])
            for a in systems:
                for b in systems:
                    if a in SHOAL_ENV and b in PEERS:
                        row[f"ratio_{key}_{a}_vs_{b}"] = ratio(row[f"{a}_{key}"],
                                                               row[f"{b}_{key}"])
        for s in systems:
            row[f"{s}_errors"] = sum(run["errors"] + run["dropped"] for run in by_system[s])
        summary.append(row)
    return summary


def systems_table(summary: Sequence[Mapping[str, Any]], systems: Sequence[str]) -> str:
    """Several systems: one row per level and system, its medians and its ratios (req/s
    and p99) to each Infinity engine measured."""
    peers = [p for p in PEERS if p in systems]
    header = ["clients", "system", "req/s", "p50 ms", "p99 ms", "CPU ms/req", "errors"]
    for p in peers:
        header += [f"req/s ÷ {NAMES[p]}", f"p99 ÷ {NAMES[p]}"]
    rows = []
    for row in summary:
        for s in systems:
            cells = [str(row["clients"]), NAMES[s], _num(row[f"{s}_req_per_s"], ".0f"),
                     _num(row[f"{s}_p50_ms"], ".1f"), _num(row[f"{s}_p99_ms"], ".1f"),
                     _num(row[f"{s}_cpu_ms_per_request"], ".1f"), str(row[f"{s}_errors"])]
            for p in peers:
                cells += [_num(row.get(f"ratio_req_per_s_{s}_vs_{p}"), ".2f"),
                          _num(row.get(f"ratio_p99_ms_{s}_vs_{p}"), ".2f")]
            rows.append(cells)
    return "\n".join(markdown.table(header, rows, align="ll" + "r" * (len(header) - 2)))


TARGETS = (  # (shoal system, Infinity engine, least req/s ratio, p99 must be lower)
    ("shoal-onnx", "infinity", 2.0, True), ("shoal-onnx-int8", "infinity", 2.0, True),
    ("shoal-onnx", "infinity-onnx", 1.0, False),
    ("shoal-onnx-int8", "infinity-onnx", 1.0, False),
    ("shoal-default", "infinity", 3.0, True))  # issue 54: `make run`'s stack
TARGET_LEVELS = (8, 32)


def verdicts(summary: Sequence[Mapping[str, Any]]) -> list[str]:
    """Issue 27's targets at 8 and 32 clients, one line each: met or not, and the numbers."""
    lines = []
    for row in summary:
        if row["clients"] not in TARGET_LEVELS:
            continue
        for a, b, least, lower_p99 in TARGETS:
            got = row.get(f"ratio_req_per_s_{a}_vs_{b}")
            if got is None:
                continue
            p99 = row.get(f"ratio_p99_ms_{a}_vs_{b}")
            ok = got >= least and (not lower_p99 or (p99 is not None and p99 < 1))
            want = f">= {least:g}x req/s" + (" and lower p99" if lower_p99 else "")
            lines.append(f"{row['clients']} clients, {NAMES[a]} vs {NAMES[b]}: {got:.2f}x "
                         f"req/s, p99 x{_num(p99, '.2f')} (target {want}): "
                         + ("met" if ok else "NOT met"))
    return lines


def table(summary: Sequence[Mapping[str, Any]], systems: Sequence[str] = SERVERS) -> str:
    """The summary as a markdown table: shoal beside Infinity column by column for the
    two of them, else one row per level and system (`systems_table`)."""
    if tuple(systems) != SERVERS:
        return systems_table(summary, systems)
    heads = [("req_per_s", "req/s", ".0f"), ("p50_ms", "p50 ms", ".1f"),
             ("p99_ms", "p99 ms", ".1f"), ("cpu_ms_per_request", "CPU ms/req", ".1f")]
    header = ["clients"]
    for _, label, _ in heads:
        header += [f"{label} shoal", f"{label} Infinity", "shoal/Inf."]
    header.append("errors (shoal, Infinity)")
    rows = []
    for row in summary:
        cells = [str(row["clients"])]
        for key, _, fmt in heads:
            cells += [_num(row[f"shoal_{key}"], fmt), _num(row[f"infinity_{key}"], fmt),
                      _num(row[f"ratio_{key}"], ".2f")]
        cells.append(f"{row['shoal_errors']}, {row['infinity_errors']}")
        rows.append(cells)
    return "\n".join(markdown.table(header, rows, align="l" * len(header)))


def plot_systems(path: Path, summary: Sequence[Mapping[str, Any]], systems: Sequence[str],
                 *, title_text: str) -> Path:
    """Throughput and p99 per client level, a bar per system."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    colors = {"shoal": "tab:blue", "shoal-onnx": "tab:cyan", "shoal-onnx-int8": "tab:green",
              "shoal-default": "tab:purple",
              "infinity": "tab:orange", "infinity-onnx": "tab:red"}
    levels = [str(row["clients"]) for row in summary]
    x = list(range(len(levels)))
    width = 0.8 / len(systems)
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    for axis, key, label in ((left, "req_per_s", "requests/s (higher is better)"),
                             (right, "p99_ms", "p99 latency, ms (lower is better)")):
        for i, s in enumerate(systems):
            offset = (i - (len(systems) - 1) / 2) * width
            axis.bar([j + offset for j in x], [row[f"{s}_{key}"] or 0 for row in summary],
                     width=width, color=colors[s], label=NAMES[s])
        axis.set_xticks(x, levels)
        axis.set_xlabel("concurrent clients (one text per request)")
        axis.set_title(label)
    left.legend(fontsize=8)
    fig.suptitle(title_text, fontsize=10)
    fig.savefig(path, dpi=100)
    return path
