"""The benchmarks' PNGs: fleet scaling and pull vs push (bench.fleet), shoal against its
peers (bench.peers). The load-sweep plot of `shoal bench` is app.tuning.plot.

matplotlib is imported only when a plot is asked for (it is a `bench` extra, and costs a
second to import); the Agg canvas is used directly, so no GUI backend or pyplot global
state is involved.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def plot_fleet(path: Path, data: dict) -> Path:
    """bench.fleet results: knee throughput against workers (scaling), or p99 and
    utilisation against load for pull and push (pull-vs-push). Always SIMULATED."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    if data["experiment"] == "scaling":
        ax = fig.subplots()
        rows = [r for r in data["results"] if r["knee"]]
        workers = [r["workers"] for r in rows]
        ax.plot(workers, [r["knee"]["throughput"] for r in rows], "o-", label="knee req/s")
        if rows and rows[0]["workers"] == 1:
            one = rows[0]["knee"]["throughput"]
            ax.plot(workers, [one * n for n in workers], ":", color="grey",
                    label="N x one worker")
        ax.set_xlabel("simulated workers")
        ax.set_ylabel("requests/s at the knee")
        ax.set_xticks(workers)
        ax.legend()
        fig.suptitle("SIMULATED: shoal fleet scaling (bench.fleet scaling)")
    else:
        left, right = fig.subplots(1, 2)
        for mode, style in (("pull", "o-"), ("push", "s--")):
            rows = [r for r in data["results"] if r["mode"].startswith(mode)]
            loads = [r["fraction"] * 100 for r in rows]
            left.plot(loads, [r["p99_ms"] for r in rows], style, label=rows[0]["mode"]
                      if rows else mode)
            right.plot(loads, [r["utilisation_mean"] * 100 for r in rows], style, label=mode)
        left.set_xlabel("offered load, % of capacity")
        left.set_ylabel("p99 ms")
        left.legend()
        right.set_xlabel("offered load, % of capacity")
        right.set_ylabel("mean device utilisation, %")
        fig.suptitle(f"SIMULATED: pull vs push, {data['workers']} workers (bench.fleet)")
    fig.savefig(path, dpi=80)
    return path


def plot_peers(path: Path, summary: Sequence[dict], *, title_text: str) -> Path:
    """Throughput and p99 per client level, shoal beside a peer server (bench.peers)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    levels = [str(row["clients"]) for row in summary]
    x = list(range(len(levels)))
    fig = Figure(figsize=(9, 4), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    for axis, key, label in ((left, "req_per_s", "requests/s (higher is better)"),
                             (right, "p99_ms", "p99 latency, ms (lower is better)")):
        for offset, server, color in ((-0.2, "shoal", "tab:blue"),
                                      (0.2, "infinity", "tab:orange")):
            values = [row[f"{server}_{key}"] or 0 for row in summary]
            axis.bar([i + offset for i in x], values, width=0.4, color=color,
                     label="shoal" if server == "shoal" else "Infinity")
        axis.set_xticks(x, levels)
        axis.set_xlabel("concurrent clients (one text per request)")
        axis.set_title(label)
        axis.legend()
    fig.suptitle(title_text)
    fig.savefig(path, dpi=110)
    return path


def plot_same_run(path: Path, rows: Sequence[dict], *, title_text: str, unit: str) -> Path:
    """bench.same_run's rows as horizontal bars, before and after, each with its rounds'
    range: a field per pair of bars, all in one `unit`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 0.55 * len(rows) + 1.6), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    height = 0.38
    for offset, tree, colour in ((-height / 2, "before", "#9e9e9e"),
                                 (height / 2, "after", "#1f77b4")):
        values = [r[tree] for r in rows]
        spread = [[v - r[f"{tree}_range"][0] for v, r in zip(values, rows, strict=True)],
                  [r[f"{tree}_range"][1] - v for v, r in zip(values, rows, strict=True)]]
        ax.barh([i + offset for i in range(len(rows))], values, height, xerr=spread,
                color=colour, label=tree, capsize=3)
    for i, r in enumerate(rows):
        if r.get("ratio"):
            ax.annotate(f"x{r['ratio']:.2f}", (max(r["before"], r["after"]), i),
                        xytext=(6, 0), textcoords="offset points", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [r["field"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.legend(loc="lower right")
    fig.suptitle(title_text, fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
