"""bench.sglang's report: the rounds summarised per level (medians, shoal/bare ratios),
the table, the verdicts against the targets, and the plot."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from app.tuning import markdown
from app.tuning.markdown import dash as _num
from app.tuning.stats import median
from bench.sglang_stream import NAMES, RATIO_TARGET, SYSTEMS, TTFT_TARGET_MS

METRICS = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
           "client_cores", "cores", "prefill_busy_share")
SHOAL_SIDE = ("gateway", "worker", "rabbitmq")  # what shoal adds to SGLang's processes


def _read(run: Mapping[str, Any], key: str) -> float | None:
    if key == "cores":  # every measured process of the system, the client excluded
        return sum(run["cpu_cores"].values()) if run.get("cpu_cores") else None
    if key == "prefill_busy_share":
        return (run.get("sglang") or {}).get(key)
    return run.get(key)


def summarise(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per level: each metric's median over rounds per system; per round, shoal/bare
    throughput and shoal's TTFT p50 minus bare's, and their medians; errors summed."""
    systems = [s for s in NAMES if any(run["system"] == s for run in runs)]
    summary = []
    for clients in sorted({run["clients"] for run in runs}):
        row: dict[str, Any] = {"clients": clients}
        at = [run for run in runs if run["clients"] == clients]
        for system in systems:
            mine = [run for run in at if run["system"] == system]
            for key in METRICS:
                row[f"{system}_{key}"] = median([_read(run, key) for run in mine])
            for group in sorted({g for run in mine for g in run.get("cpu_cores", {})}):
                row[f"{system}_cpu_{group}"] = median(
                    [run["cpu_cores"].get(group) for run in mine])
        # CPU ms that shoal's own processes spend per streamed token.
        row["shoal_cpu_ms_per_token"] = median(
            [sum(run["cpu_cores"].get(g, 0.0) for g in SHOAL_SIDE) * 1000 / run["tokens_per_s"]
             for run in at if run["system"] == "shoal" and run.get("tokens_per_s")])
        ratios, added, added_p99 = [], [], []
        for r in sorted({run["round"] for run in at}):
            pair = {run["system"]: run for run in at if run["round"] == r}
            if not set(SYSTEMS) <= set(pair):
                continue
            shoal, bare = pair["shoal"], pair["bare"]
            if bare["tokens_per_s"]:
                ratios.append(shoal["tokens_per_s"] / bare["tokens_per_s"])
            if shoal["ttft_p50_ms"] is not None and bare["ttft_p50_ms"] is not None:
                added.append(shoal["ttft_p50_ms"] - bare["ttft_p50_ms"])
            if shoal["ttft_p99_ms"] is not None and bare["ttft_p99_ms"] is not None:
                added_p99.append(shoal["ttft_p99_ms"] - bare["ttft_p99_ms"])
        row["ratio_tokens_per_s"] = median(ratios)
        row["ratios"] = ratios
        row["added_ttft_p50_ms"] = median(added)
        row["added_ttft_p50_ms_rounds"] = added
        row["added_ttft_p99_ms"] = median(added_p99)
        for system in systems:
            row[f"{system}_errors"] = sum(run["errors"] for run in at
                                          if run["system"] == system)
        summary.append(row)
    return summary


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f}%"


def table(summary: Sequence[Mapping[str, Any]]) -> str:
    """The summary as markdown: the comparison, CPU, and the native API when measured."""
    header = ["streams", "tokens/s shoal", "tokens/s bare", "shoal/bare",
              "TTFT p50 ms shoal", "TTFT p50 ms bare", "shoal's added TTFT p50 ms",
              "TTFT p99 ms shoal", "TTFT p99 ms bare", "ITL p50 ms shoal", "ITL p50 ms bare",
              "ITL p99 ms shoal", "ITL p99 ms bare", "errors (shoal, bare)"]
    rows = []
    for row in summary:
        cells = [str(row["clients"]),
                 _num(row["shoal_tokens_per_s"], ".0f"), _num(row["bare_tokens_per_s"], ".0f"),
                 _num(row["ratio_tokens_per_s"], ".2f"),
                 _num(row["shoal_ttft_p50_ms"], ".1f"), _num(row["bare_ttft_p50_ms"], ".1f"),
                 _num(row["added_ttft_p50_ms"], "+.1f"),
                 _num(row["shoal_ttft_p99_ms"], ".0f"), _num(row["bare_ttft_p99_ms"], ".0f"),
                 _num(row["shoal_itl_p50_ms"], ".1f"), _num(row["bare_itl_p50_ms"], ".1f"),
                 _num(row["shoal_itl_p99_ms"], ".0f"), _num(row["bare_itl_p99_ms"], ".0f"),
                 f"{row['shoal_errors']}, {row['bare_errors']}"]
        rows.append(cells)
    lines = markdown.table(header, rows)
    cpu = ["streams", "shoal: gateway", "worker", "RabbitMQ", "SGLang",
           "bare: SGLang", "shoal's processes, idle", "client (shoal, bare)",
           "shoal's CPU ms per token", "SGLang in prefill (shoal, bare)"]
    lines += ["", "CPU, cores (CPU seconds per second; SGLang = its HTTP, scheduler and "
              "detokenizer processes):", "",
              *markdown.table(cpu)]
    for row in summary:
        lines.append(markdown.row([
            str(row["clients"]), _num(row.get("shoal_cpu_gateway"), ".2f"),
            _num(row.get("shoal_cpu_worker"), ".2f"), _num(row.get("shoal_cpu_rabbitmq"), ".2f"),
            _num(row.get("shoal_cpu_sglang"), ".2f"), _num(row.get("bare_cpu_sglang"), ".2f"),
            _num(row.get("bare_cpu_shoal idle"), ".2f"),
            f"{_num(row['shoal_client_cores'], '.2f')}, {_num(row['bare_client_cores'], '.2f')}",
            _num(row.get("shoal_cpu_ms_per_token"), ".2f"),
            f"{_pct(row.get('shoal_prefill_busy_share'))}, "
            f"{_pct(row.get('bare_prefill_busy_share'))}"]))
    if any("native_tokens_per_s" in row for row in summary):
        lines += ["", "SGLang's native API (/generate, streamed, as shoal's runtime calls it), "
                  "for reference:", "",
                  *markdown.table(
                      ["streams", "tokens/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "errors"],
                      [[row["clients"], _num(row.get("native_tokens_per_s"), ".0f"),
                        _num(row.get("native_ttft_p50_ms"), ".1f"),
                        _num(row.get("native_ttft_p99_ms"), ".0f"),
                        _num(row.get("native_itl_p50_ms"), ".1f"), row.get("native_errors", 0)]
                       for row in summary])]
    return "\n".join(lines)


def verdicts(summary: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per level: the two targets (ratio >= 0.9, added TTFT p50 <= 5 ms)."""
    lines = []
    for row in summary:
        ratio, added = row["ratio_tokens_per_s"], row["added_ttft_p50_ms"]
        ok_ratio = ratio is not None and ratio >= RATIO_TARGET
        ok_ttft = added is not None and added <= TTFT_TARGET_MS
        lines.append(f"{row['clients']} streams: throughput {_num(ratio, '.2f')}x bare "
                     f"({'meets' if ok_ratio else 'misses'} >= {RATIO_TARGET}), added TTFT "
                     f"p50 {_num(added, '+.1f')} ms ({'meets' if ok_ttft else 'misses'} "
                     f"<= {TTFT_TARGET_MS:g} ms)")
    return lines


def plot(path: Path, summary: Sequence[Mapping[str, Any]], title_text: str) -> Path:
    """Output tokens/s and TTFT p50 (p99 dotted) per level, both systems."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    levels = [row["clients"] for row in summary]
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    colors = {"shoal": "tab:blue", "bare": "tab:orange", "native": "tab:gray"}
    for system in [s for s in NAMES if f"{s}_tokens_per_s" in summary[0]]:
        left.plot(levels, [row[f"{system}_tokens_per_s"] or 0 for row in summary], "o-",
                  color=colors[system], label=NAMES[system])
        right.plot(levels, [row[f"{system}_ttft_p50_ms"] for row in summary], "o-",
                   color=colors[system], label=f"{NAMES[system]} p50")
        right.plot(levels, [row[f"{system}_ttft_p99_ms"] for row in summary], "s:",
                   color=colors[system], label=f"{NAMES[system]} p99")
    left.set_title("output tokens/s (higher is better)")
    right.set_title("time to first token, ms (lower is better)")
    right.set_yscale("log")
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xticks(levels, [str(n) for n in levels])
        axis.minorticks_off()
        axis.set_xlabel("concurrent streams")
        axis.grid(True, alpha=0.3)
        axis.legend()
    left.set_ylim(bottom=0)
    fig.suptitle(title_text)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
