"""bench.claims's pure parts: what is compared (the modes, the models, the limits), the
images, the order of the phases, and each phase's row summarised per mode into the table,
the CPU table and the plot."""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.tuning import markdown
from app.tuning.load import LoadResult
from app.tuning.stats import median, ratio

CLIP_ID = "bench/tiny-clip"
MODES = ("inline", "claim", "text")
NAMES = {"inline": "images inline", "claim": "claim-checked", "text": "no images (reference)"}
INLINE_CLAIM_BYTES = 1_000_000_000  # over any image: the claim check never fires
BODY_LIMIT = 64 * 1024 * 1024  # both gateways take a 4 MB image in one body
DEFAULT_JSON = Path("bench/out/claims.json")
MB = 1_000_000
# (mode key, what) of the per-mode medians in the summary.
METRICS = ("text_p50_ms", "text_p99_ms", "text_req_per_s", "image_p50_ms", "image_p99_ms",
           "image_req_per_s", "rss_peak", "rss_added", "mem_used_peak", "mem_used_added",
           "queue_memory_peak", "message_bytes_peak")
# Compared within a round: latencies as ratios, memory as a difference (a ratio of two
# near-zero additions says nothing).
RATIOS = ("text_p50_ms", "text_p99_ms", "image_p50_ms")
DIFFERENCES = ("rss_peak", "rss_added", "mem_used_peak", "mem_used_added")


def png_side(target_bytes: int) -> int:
    """The side of a square RGB PNG of about `target_bytes` when stored uncompressed: a row
    is one filter byte and 3 bytes a pixel, so side * (3 * side + 1) = target."""
    if target_bytes < 4:
        raise ValueError(f"an image needs a few bytes, got {target_bytes}")
    return max(1, int((math.sqrt(1 + 12 * target_bytes) - 1) / 6))


def make_png(target_bytes: int, seed: int) -> bytes:
    """An uncompressed PNG of random pixels, about `target_bytes` long (random pixels so
    that no layer on the way, compressing or deduplicating, makes it smaller)."""
    import numpy as np
    from PIL import Image

    side = png_side(target_bytes)
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG", compress_level=0)
    return out.getvalue()


def schedule(rounds: int, modes: Sequence[str]) -> list[tuple[int, str]]:
    """(round, mode) in run order: `modes` in even rounds, reversed in odd ones, so that
    neither mode always runs on a broker the other has just loaded."""
    return [(r, mode) for r in range(rounds) for mode in (modes if r % 2 == 0 else modes[::-1])]


@dataclass(frozen=True)
class Sample:
    """The broker's memory at one instant; None where it was not read this time."""

    at: float
    rss: int | None = None  # bytes, beam.smp's resident set
    mem_used: int | None = None  # bytes, the node's own count (management API)
    queue_memory: int | None = None  # bytes, this stack's queues (management API)
    message_bytes: int | None = None  # bytes of the messages in this stack's queues


def memory_peaks(samples: Sequence[Sample], before: Sample) -> dict[str, int | None]:
    """Peak of each figure over `samples`, and for RSS and mem_used the peak minus its value
    in `before` (what the phase added, never below 0)."""
    out: dict[str, int | None] = {}
    for name in ("rss", "mem_used", "queue_memory", "message_bytes"):
        values = [v for s in samples if (v := getattr(s, name)) is not None]
        out[f"{name}_peak"] = max(values) if values else None
    for name in ("rss", "mem_used"):
        peak, base = out[f"{name}_peak"], getattr(before, name)
        out[f"{name}_added"] = None if peak is None or base is None else max(0, peak - base)
    return out


def cores_by_process(result: LoadResult) -> dict[str, float]:
    """CPU cores (CPU seconds per second) of each kind of process over the window, from
    app.tuning.load's ms per completed request: labels lose their pid, so both gateways and
    every runtime add up under one name each."""
    from app.tuning.cpu import process_kind

    out: dict[str, float] = {}
    for label, ms in result.cpu_ms_per_request.items():
        if label == "total":
            continue
        name = process_kind(label)
        out[name] = out.get(name, 0.0) + ms * result.requests / 1000 / result.duration
    return out


def phase_row(mode: str, round_: int, text: LoadResult, image: LoadResult | None,
              memory: Mapping[str, int | None]) -> dict[str, Any]:
    """One phase's figures, flat (what `summarise` reads)."""
    return {"mode": mode, "round": round_,
            "text_p50_ms": text.p50_ms, "text_p99_ms": text.p99_ms,
            "text_req_per_s": text.req_per_s, "text_errors": text.errors + text.dropped,
            "text_error_kinds": text.error_kinds,
            "image_p50_ms": image.p50_ms if image else None,
            "image_p99_ms": image.p99_ms if image else None,
            "image_req_per_s": image.req_per_s if image else None,
            "image_requests": image.attempted if image else 0,
            "image_errors": image.errors + image.dropped if image else 0,
            "image_error_kinds": image.error_kinds if image else {},
            "cores": cores_by_process(text), **memory}


def _difference(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def summarise(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per mode: each metric's median over rounds and errors summed. Per round: claim-checked
    / inline of RATIOS, claim-checked - inline of DIFFERENCES, and each image mode's text
    latency over the reference's; then the median of each over rounds."""
    modes = [m for m in MODES if any(row["mode"] == m for row in rows)]
    per_mode: dict[str, dict[str, Any]] = {}
    for mode in modes:
        mine = [row for row in rows if row["mode"] == mode]
        entry: dict[str, Any] = {key: median([row[key] for row in mine]) for key in METRICS}
        entry["text_errors"] = sum(row["text_errors"] for row in mine)
        entry["image_errors"] = sum(row["image_errors"] for row in mine)
        entry["rounds"] = len(mine)
        names = sorted({name for row in mine for name in row["cores"]})
        entry["cores"] = {n: median([row["cores"].get(n) for row in mine]) for n in names}
        per_mode[mode] = entry
    compare: dict[str, list[float | None]] = {}
    for r in sorted({row["round"] for row in rows}):
        pair = {row["mode"]: row for row in rows if row["round"] == r}
        if "inline" in pair and "claim" in pair:
            for key in RATIOS:
                compare.setdefault(f"claim/inline {key}", []).append(
                    ratio(pair["claim"][key], pair["inline"][key]))
            for key in DIFFERENCES:
                compare.setdefault(f"claim-inline {key}", []).append(
                    _difference(pair["claim"][key], pair["inline"][key]))
        for mode in ("inline", "claim"):
            if mode in pair and "text" in pair:
                for key in ("text_p50_ms", "text_p99_ms"):
                    compare.setdefault(f"{mode}/text {key}", []).append(
                        ratio(pair[mode][key], pair["text"][key]))
    return {"modes": per_mode, "rounds": compare,
            "compare": {key: median(values) for key, values in compare.items()}}


def _num(value: float | None, spec: str, scale: float = 1.0) -> str:
    return markdown.dash(None if value is None else value / scale, spec)


def table(summary: Mapping[str, Any]) -> str:
    """The markdown table of the summary, a row per mode, and the ratios under it."""
    lines = markdown.table(
        ["", "text p50 ms", "text p99 ms", "text req/s", "image p50 ms", "image p99 ms",
         "images/s", "errors (text, image)", "broker RSS peak MB (added)",
         "mem_used peak MB (added)", "queues' memory peak MB", "message bytes peak MB"],
        [[NAMES[mode], _num(m["text_p50_ms"], ".1f"), _num(m["text_p99_ms"], ".1f"),
          _num(m["text_req_per_s"], ".1f"), _num(m["image_p50_ms"], ".0f"),
          _num(m["image_p99_ms"], ".0f"), _num(m["image_req_per_s"], ".2f"),
          f"{m['text_errors']}, {m['image_errors']}",
          f"{_num(m['rss_peak'], '.0f', MB)} (+{_num(m['rss_added'], '.0f', MB)})",
          f"{_num(m['mem_used_peak'], '.0f', MB)} (+{_num(m['mem_used_added'], '.0f', MB)})",
          _num(m["queue_memory_peak"], ".1f", MB), _num(m["message_bytes_peak"], ".1f", MB)]
         for mode, m in summary["modes"].items()],
        align="l" + "r" * 11)
    if summary["compare"]:
        rows = []
        for key, value in summary["compare"].items():
            scale, spec = (MB, "+.1f") if key.startswith("claim-inline") else (1.0, ".2f")
            unit = " MB" if scale == MB else ""
            rounds = ", ".join(_num(v, spec, scale) for v in summary["rounds"][key])
            rows.append([f"{key}{unit}", rounds, f"**{_num(value, spec, scale)}**"])
        lines += ["", *markdown.table(["within a round", "per round", "median"], rows,
                                      align="llr")]
    return "\n".join(lines)


def cores_table(summary: Mapping[str, Any]) -> str:
    names = sorted({n for m in summary["modes"].values() for n in m["cores"]})
    return "\n".join(markdown.table(
        ["", *names], [[NAMES[mode], *(_num(m["cores"].get(n), ".2f") for n in names)]
                       for mode, m in summary["modes"].items()], align="l" + "r" * len(names)))


def plot(path: Path, summary: Mapping[str, Any], title_text: str) -> Path:
    """Text p50/p99 and the broker's added memory per mode, bars side by side."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    modes = list(summary["modes"])
    colors = {"inline": "tab:red", "claim": "tab:blue", "text": "tab:gray"}
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    panels = ((left, (("text_p50_ms", "p50"), ("text_p99_ms", "p99")), 1.0,
               "text requests' latency, ms (lower is better)"),
              (right, (("rss_added", "RSS added"), ("mem_used_added", "mem_used added"),
                       ("queue_memory_peak", "its queues' memory")), MB,
               "RabbitMQ memory: peak - before, MB (lower is better)"))
    for axis, metrics, scale, label in panels:
        width = 0.8 / len(modes)
        for i, mode in enumerate(modes):
            values = [(summary["modes"][mode][key] or 0) / scale for key, _ in metrics]
            bars = axis.bar([x + (i - (len(modes) - 1) / 2) * width for x in range(len(metrics))],
                            values, width=width, color=colors[mode], label=NAMES[mode])
            axis.bar_label(bars, fmt="%.0f", fontsize=8)
        axis.set_xticks(range(len(metrics)), [name for _, name in metrics])
        axis.set_title(label)
        axis.legend()
    fig.suptitle(title_text)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
