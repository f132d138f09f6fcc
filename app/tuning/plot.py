"""A PNG of one load sweep: throughput and latency against offered load, the knee marked.

matplotlib is imported only here and only when a plot is asked for (it is a
`bench` extra, and costs a second to import); the Agg canvas is used
directly, so no GUI backend or pyplot global state is involved.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from app.tuning.load import LoadResult


def title(model: str, mode: str, simulated: bool) -> str:
    text = f"shoal bench: {model}, {mode} loop"
    return f"SIMULATED: {text}" if simulated else text


def plot_sweep(path: Path, levels: Sequence[LoadResult], *, model: str, mode: str,
               knee_load: float | None = None, p99_limit_ms: float | None = None,
               simulated: bool = False) -> Path:
    """Write the PNG to `path` and return it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    levels = sorted(levels, key=lambda r: r.offered)
    loads = [r.offered for r in levels]
    fig = Figure(figsize=(8, 7), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True)

    top.plot(loads, [r.req_per_s for r in levels], "o-", color="tab:blue", label="req/s")
    top.set_ylabel("requests/s", color="tab:blue")
    items = top.twinx()
    items.plot(loads, [r.items_per_s for r in levels], "s--", color="tab:green",
               label="items/s")
    items.set_ylabel("items/s", color="tab:green")
    top.set_ylim(bottom=0)
    items.set_ylim(bottom=0)
    top.grid(True, alpha=0.3)

    for name, color in (("p50_ms", "tab:blue"), ("p99_ms", "tab:red")):
        xs = [r.offered for r in levels if getattr(r, name) is not None]
        ys = [getattr(r, name) for r in levels if getattr(r, name) is not None]
        bottom.plot(xs, ys, "o-", color=color, label=name.replace("_ms", ""))
    if p99_limit_ms is not None:
        bottom.axhline(p99_limit_ms, color="tab:red", linestyle=":", linewidth=1,
                       label=f"p99 limit {p99_limit_ms:.1f} ms")
    bottom.set_ylabel("latency, ms")
    bottom.set_ylim(bottom=0)
    bottom.grid(True, alpha=0.3)
    bottom.set_xlabel("offered load, clients" if mode == "closed" else "offered load, req/s")
    # Geometric sweeps read better on a log axis.
    if loads and min(loads) > 0 and max(loads) / min(loads) >= 8:
        bottom.set_xscale("log", base=2)
        bottom.set_xticks(loads, [f"{load:g}" for load in loads])
        bottom.minorticks_off()

    if knee_load is not None:
        for axis in (top, bottom):
            axis.axvline(knee_load, color="tab:orange", linestyle=":", linewidth=2)
        # Left of the line: the knee is often the last load, next to the right axis.
        top.annotate(f"knee: {knee_load:g}", xy=(knee_load, 0), xytext=(-4, 4),
                     textcoords="offset points", color="tab:orange", ha="right")
    handles = top.get_legend_handles_labels()
    extra = items.get_legend_handles_labels()
    top.legend(handles[0] + extra[0], handles[1] + extra[1], loc="upper left")
    bottom.legend(loc="upper left")
    fig.suptitle(title(model, mode, simulated),
                 color="tab:red" if simulated else "black", fontweight="bold")
    path = Path(path)
    fig.savefig(path, dpi=100)
    return path
