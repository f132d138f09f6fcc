"""bench.fleet's report: medians over seeds, the pull-vs-push table and plot, and the
scaling report."""

from __future__ import annotations

import statistics
from functools import partial
from pathlib import Path
from typing import Any

from app.tuning import markdown


def _mode(row: dict[str, Any]) -> str:
    return "pull" if row["mode"].startswith("pull") else "push"


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per load, the median over seeds of each side's p50, p99 and utilisation, and of the
    per-seed ratio pull p99 / push p99 (pairs of one seed: the same mix and schedule)."""
    out = []
    for fraction in sorted({r["fraction"] for r in rows}):
        at = [r for r in rows if r["fraction"] == fraction]
        row: dict[str, Any] = {"fraction": fraction}
        for side in ("pull", "push"):
            mine = [r for r in at if _mode(r) == side]
            for key in ("p50_ms", "p99_ms", "utilisation_mean", "req_per_s"):
                row[f"{side}_{key}"] = statistics.median(r[key] for r in mine) if mine else None
        pairs = [(p, q) for p in at for q in at
                 if _mode(p) == "pull" and _mode(q) == "push" and p["seed"] == q["seed"]]
        row["p99_ratio"] = (statistics.median(p["p99_ms"] / q["p99_ms"] for p, q in pairs)
                            if pairs else None)
        row["seeds"] = len(pairs)
        out.append(row)
    return out


_pct = partial(markdown.dash, spec=".0%")
whole_ms = partial(markdown.dash, spec=".0f")


def pull_vs_push_report(data: dict[str, Any]) -> list[str]:
    capacities = data["capacity_req_per_s"]
    if not isinstance(capacities, dict):  # a result file of one seed, before --seeds
        capacities = {data.get("seed", "-"): capacities}
    lines = [f"{data['workers']} workers; capacity (closed loop, saturated, pull) per seed: "
             + ", ".join(f"seed {s}: {c:.0f} req/s" for s, c in capacities.items()), "",
             *markdown.table(["seed", "load", "pull p50 ms", "pull p99 ms", "push p50 ms",
                              "push p99 ms", "pull/push p99", "pull util (min-max)",
                              "push util (min-max)", "pull redelivered"], align="l" * 10)]
    rows = data["results"]
    keys = sorted({(r.get("seed", "-"), r["fraction"]) for r in rows}, key=str)
    for seed, fraction in keys:
        pull = next((r for r in rows if r.get("seed", "-") == seed and r["fraction"] == fraction
                     and _mode(r) == "pull"), None)
        push = next((r for r in rows if r.get("seed", "-") == seed and r["fraction"] == fraction
                     and _mode(r) == "push"), None)

        def util(r: dict[str, Any] | None) -> str:
            if r is None:
                return "-"
            return (f"{r['utilisation_mean']:.0%} ({r['utilisation_min']:.0%}-"
                    f"{r['utilisation_max']:.0%})")

        ratio = (_pct(pull["p99_ms"] / push["p99_ms"]) if pull and push and push["p99_ms"]
                 else "-")
        returned = pull.get("redelivered") if pull else None
        lines.append(markdown.row([
            seed, f"{fraction:.0%}", whole_ms(pull and pull["p50_ms"]),
            whole_ms(pull and pull["p99_ms"]), whole_ms(push and push["p50_ms"]),
            whole_ms(push and push["p99_ms"]), ratio, util(pull),
            util(push), "-" if returned is None else returned]))
    lines += ["", f"Median over {len(data.get('seeds') or [1])} seed(s):", "",
              *markdown.table(
                  ["load", "pull p50 ms", "pull p99 ms", "push p50 ms", "push p99 ms",
                   "pull/push p99 (median of seeds)", "pull util", "push util"],
                  [[f"{m['fraction']:.0%}", whole_ms(m["pull_p50_ms"]), whole_ms(m["pull_p99_ms"]),
                    whole_ms(m["push_p50_ms"]), whole_ms(m["push_p99_ms"]), _pct(m["p99_ratio"]),
                    _pct(m["pull_utilisation_mean"]), _pct(m["push_utilisation_mean"])]
                   for m in data.get("medians") or medians(rows)], align="l" * 8)]
    return lines


def plot_pull_vs_push(path: Path, data: dict[str, Any]) -> Path:
    """p99 and utilisation against load: each seed's points and the median line per side."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    rows = data["results"]
    for side, style, color in (("pull", "o-", "tab:blue"), ("push", "s--", "tab:orange")):
        mine = [r for r in rows if _mode(r) == side]
        meds = data.get("medians") or medians(rows)
        loads = [m["fraction"] * 100 for m in meds]
        label = "pull: one shared queue" if side == "pull" else "push: round-robin router"
        left.plot(loads, [m[f"{side}_p99_ms"] for m in meds], style, color=color,
                  label=f"{label} (median)")
        left.scatter([r["fraction"] * 100 for r in mine], [r["p99_ms"] for r in mine],
                     color=color, alpha=0.35, s=14)
        right.plot(loads, [m[f"{side}_utilisation_mean"] * 100 for m in meds], style,
                   color=color, label=side)
        right.scatter([r["fraction"] * 100 for r in mine],
                      [r["utilisation_mean"] * 100 for r in mine], color=color, alpha=0.35, s=14)
    left.set_xlabel("offered load, % of capacity")
    left.set_ylabel("p99 ms (dots: each seed)")
    left.legend(fontsize="small")
    right.set_xlabel("offered load, % of capacity")
    right.set_ylabel("mean device utilisation, %")
    right.legend(fontsize="small")
    seeds = ", ".join(str(s) for s in data.get("seeds") or [])
    env = "".join(f", {k}={v}" for k, v in (data.get("env") or {}).items())
    fig.suptitle(f"SIMULATED: pull vs push, {data['workers']} workers, seeds {seeds}{env} "
                 "(bench.fleet)")
    fig.savefig(path, dpi=80)
    return path


def report(data: dict[str, Any]) -> str:
    lines = ["SIMULATED workers (runtimes/doubles/sim, " + ", ".join(
        f"{k.removeprefix('SHOAL_SIM_COST_').lower()}={v}" for k, v in data["simulated"].items()
        if k.startswith("SHOAL_SIM_COST")) + ")", ""]
    if data["experiment"] == "scaling":
        one = next((r["knee"]["throughput"] for r in data["results"]
                    if r["workers"] == 1 and r["knee"]), None)
        rows = []
        for r in data["results"]:
            k = r["knee"]
            if k is None:
                rows.append([r["workers"], "-", "-", "-", "-", "-"])
                continue
            ratio = f"{k['throughput'] / (one * r['workers']):.0%}" if one else "-"
            rows.append([r["workers"], f"{k['load']:.0f}", f"{k['throughput']:.0f}",
                         f"{k['p50_ms']:.0f}", f"{k['p99_ms']:.0f}", ratio])
        lines += markdown.table(["workers", "knee: clients", "req/s", "p50 ms", "p99 ms",
                                 "vs N x 1 worker"], rows, align="l" * 6)
    else:
        lines += pull_vs_push_report(data)
    return "\n".join(lines)
