"""bench.pool's output: the markdown tables of a scenario and its PNG."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from app.tuning import markdown
from bench.pool_fleet import MIB
from bench.pool_stats import value
from bench.pool_traffic import TIERS

_ms = partial(markdown.dash, spec=".0f")
_pct = partial(markdown.dash, spec=".0%")
_x = partial(markdown.dash, spec=".2f")
COLORS = {"pool": "tab:blue", "pool-lru": "tab:cyan", "partition": "tab:orange",
          "router": "tab:green", "mux": "tab:red", "mux-host": "tab:pink"}


def _order(data: dict[str, Any]) -> list[str]:
    return list(dict.fromkeys(data["order"]))


def _get(r: dict[str, Any], key: str) -> Any:
    return r[key] if key in r else value(r, key)  # a median's flat key, or a row's nested


def _line(cells: list[str], r: dict[str, Any]) -> str:
    return markdown.row([
        *cells, f"{r['req_per_s']:.1f}", _pct(r["error_rate"]),
        *(f"{_ms(_get(r, f'{t}.p50_ms'))} / {_ms(_get(r, f'{t}.p99_ms'))} "
          f"({_pct(_get(r, f'{t}.error_rate'))})" for t, _, _ in TIERS),
        f"{r['loads_per_min']:.1f} ({r.get('slow_loads_per_min', float('nan')):.1f})",
        f"{r['evictions_per_min']:.1f}",
        _pct(r["utilisation_mean"])])


def _ratio_table(title: str, per_name: dict[str, Any]) -> list[str]:
    lines = ["", title, ""]
    rows = []
    for name, per in per_name.items():
        cells = [name]
        for tier, _, _ in TIERS:
            v = per[tier]
            each = ", ".join(f"{x:.2f}" for x in v["rounds"])
            who = "/".join(dict.fromkeys(v.get("against", [])))
            cells.append("-" if v["median"] is None else
                         f"{each}; **{v['median']:.2f}**" + (f" (vs {who})" if who else ""))
        rows.append(cells)
    return lines + markdown.table(["deployment", "head", "torso", "tail"], rows, align="llll")


def table(data: dict[str, Any]) -> str:
    rows, meds, order = data["rows"], data["medians"], _order(data)
    shares, p = data["tier_shares"], data["profile"]
    kind = "SIMULATED" if data.get("simulated", True) else "REAL (tiny models)"
    head = ["req/s", "errors", *(f"{t} p50 / p99 ms (errors)" for t, _, _ in TIERS),
            "loads/min (from disk)", "evictions/min", "device util"]
    lines = [
        f"{kind}, scenario **{data['scenario']}**: {len(data['models'])} models, Zipf "
        f"{data['zipf_s']:g} (" + ", ".join(f"{t} {shares[t]:.0%}" for t, _, _ in TIERS)
        + f"), {data['workers_text']}, {data['rate_text']}; budget {data['slots']} models; "
        f"batch {p['cost_a_ms']:g} ms + {p['cost_b_us']:g} us/token, load {p['load_ms']:g} ms "
        f"(host tier {p['host_load_ms']:g} ms), footprint {p['footprint_bytes'] / MIB:g} MiB, "
        f"sim speed x{data['sim_speed']:g}; window {data['warmup']:g} s warm-up + "
        f"{data['duration']:g} s", "",
        *(f"- {name}: {data['deployments'][name]['what']}" for name in order), "",
        *markdown.table(["deployment", "round", *head], align="l" * (len(head) + 2))]
    for row in sorted(rows, key=lambda r: (order.index(r["deployment"]), r["round"])):
        lines.append(_line([row["deployment"], str(row["round"])], row))
    rounds = max((m["rounds"] for m in meds.values()), default=0)
    lines += ["", f"Median over rounds ({rounds}):", "",
              *markdown.table(["deployment", *head], align="l" * (len(head) + 1))]
    for name in order:
        lines.append(_line([name], meds[name]))
    if data["ratios"].get("partition"):
        lines += _ratio_table("p99 over the static partition's, same round (rounds; median):",
                              data["ratios"]["partition"])
    if data["ratios"].get("router"):
        lines += _ratio_table("p99 over the better router's (lowest p99 of router, mux, "
                              "mux-host in the same round; rounds; median):",
                              data["ratios"]["router"])
    extra = {"fits": _fits, "shift": _shift, "burst": _burst, "workers": _workers}.get(
        data["scenario"])
    if extra:
        lines += extra(data)
    return "\n".join(lines)


def _fits(data: dict[str, Any]) -> list[str]:
    out = ["", "Loads after warm-up (in the window; rounds):", ""]
    rows = [[name, ", ".join(f"{r['loads']:.0f}" for r in data["rows"]
                             if r["deployment"] == name)] for name in _order(data)]
    return out + markdown.table(["deployment", "loads"], rows, align="ll")


def _shift(data: dict[str, Any]) -> list[str]:
    factor = data["recovery_factor"]
    out = ["", f"Rotations (every {data['shift_s']:g} s, by {data['shift_by']} ranks; at: s "
           f"from the window's start; recovery: s until p99 is back within {factor:g}x the "
           f"steady p99 for good, in {data['bucket_s']:g} s buckets; - = not within the "
           "segment):", ""]
    rows = []
    for r in sorted(data["rows"], key=lambda r: (_order(data).index(r["deployment"]),
                                                 r["round"])):
        for rot in r["shift"]["rotations"]:
            rows.append([r["deployment"], str(r["round"]), f"{rot['at']:g}",
                         _ms(rot["steady_p99_ms"]), _ms(rot["worst_p99_ms"]),
                         markdown.dash(rot["recovery_s"], spec="g")])
    out += markdown.table(["deployment", "round", "at s", "steady p99 ms", "worst bucket p99 ms",
                           "recovery s"], rows, align="llllll")
    out += ["", f"p99 ms per {data['bucket_s']:g} s bucket of the window:", ""]
    for r in data["rows"]:
        out.append(f"- {r['deployment']} round {r['round']}: " + " ".join(
            _ms(b["p99_ms"]) for b in r["shift"]["buckets"]))
    return out


def _burst(data: dict[str, Any]) -> list[str]:
    b = data["burst"]
    out = ["", f"Burst: rank {b['rank']} at {b['rate']:g} req/s for {b['seconds']:g} s in the "
           "window's middle (head = ranks 1-2 without the burst's requests):", ""]
    rows = []
    for r in sorted(data["rows"], key=lambda r: (_order(data).index(r["deployment"]),
                                                 r["round"])):
        s = r["burst"]
        during, outside = s["head_p99_during_ms"], s["head_p99_outside_ms"]
        rows.append([r["deployment"], str(r["round"]), _ms(during), _ms(outside),
                     _x(during / outside if during and outside else None),
                     f"{_ms(s['p50_ms'])} / {_ms(s['p99_ms'])}", _pct(s["error_rate"])])
    return out + markdown.table(["deployment", "round", "head p99 during ms",
                                 "head p99 outside ms", "during / outside",
                                 "burst p50 / p99 ms", "burst errors"], rows, align="lllllll")


def _workers(data: dict[str, Any]) -> list[str]:
    out = ["", f"Scaling. One worker's knee throughput C1 = {data['knee_text']}. Efficiency = "
           "req/s / (N x C1), same round. Served = a tier's completions / its offered "
           "requests per s (lowest tier shown). Machine: share of all cores busy; client and "
           "workers: cores used.", ""]
    rows = []
    for r in sorted(data["rows"], key=lambda r: (_order(data).index(r["deployment"]),
                                                 r["round"])):
        cpu = r.get("cpu") or {}
        workers = [c for c in cpu.get("worker_cores", []) if c is not None]
        served = [r[t]["completed_per_s"] / r["offered_tier_per_s"][t]
                  for t, _, _ in TIERS if r["offered_tier_per_s"].get(t)]
        rows.append([r["deployment"], str(r["round"]), str(r["workers"]),
                     f"{r['offered_per_s']:.1f}", f"{r['client_sent_per_s']:.1f}",
                     _ms(r["send_lag_p99_ms"]), f"{r['req_per_s']:.1f}",
                     _x(r.get("efficiency")), _pct(min(served) if served else None),
                     _pct(r["utilisation_mean"]), _pct(cpu.get("machine")),
                     _x(cpu.get("client_cores")),
                     _x(max(workers) if workers else None), r.get("limit", "")])
    return out + markdown.table(
        ["deployment", "round", "N", "offered/s", "client sent/s", "send lag p99 ms",
         "req/s", "efficiency", "served (min tier)", "device util", "machine cpu",
         "client cores", "max worker cores", "limited by"], rows, align="l" * 14)


# --- the PNG -------------------------------------------------------------------------------


def plot(path: Path, data: dict[str, Any]) -> Path:
    """shift: p99 over time per deployment (each round), rotations marked; workers: req/s
    against N with N x C1; otherwise per tier and deployment the p99 (bars: medians over
    rounds, dots: each round, log scale)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 5), layout="constrained")
    FigureCanvasAgg(fig)
    axis = fig.subplots()
    kind = "SIMULATED" if data.get("simulated", True) else "REAL (tiny models)"
    names = _order(data)
    if data["scenario"] == "shift":
        for r in data["rows"]:
            xs = [b["t"] for b in r["shift"]["buckets"]]
            axis.plot(xs, [b["p99_ms"] for b in r["shift"]["buckets"]], "-",
                      color=COLORS.get(r["deployment"]), alpha=0.8, marker=".",
                      label=r["deployment"] if r["round"] == 1 else None)
        for at in {rot["at"] for r in data["rows"] for rot in r["shift"]["rotations"]}:
            axis.axvline(at, color="grey", linestyle=":")
        axis.set_yscale("log")
        axis.set_xlabel(f"s from the window's start ({data['bucket_s']:g} s buckets; dotted: "
                        "rotations)")
        axis.set_ylabel("p99 ms (log)")
    elif data["scenario"] == "workers":
        scaled = [r for r in data["rows"] if r.get("efficiency") is not None]
        for name in names:
            mine = [r for r in scaled if r["deployment"] == name]
            axis.scatter([r["workers"] for r in mine], [r["req_per_s"] for r in mine],
                         label=name)
        knee = data.get("knee")
        if knee:
            ns = sorted({r["workers"] for r in scaled})
            axis.plot(ns, [n * knee for n in ns], ":", color="grey", label="N x C1")
            axis.plot(ns, [0.9 * n * knee for n in ns], "--", color="grey",
                      label="0.9 x N x C1")
        axis.set_xlabel("workers")
        axis.set_ylabel("req/s completed")
    else:
        width = 0.8 / max(1, len(names))
        tiers = [t for t, _, _ in TIERS]
        for k, name in enumerate(names):
            xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(tiers))]
            axis.bar(xs, [data["medians"][name][f"{t}.p99_ms"] or 0 for t in tiers],
                     width=width, color=COLORS.get(name), label=name)
            for i, tier in enumerate(tiers):
                dots = [r[tier]["p99_ms"] for r in data["rows"]
                        if r["deployment"] == name and r[tier]["p99_ms"] is not None]
                axis.scatter([xs[i]] * len(dots), dots, color="black", s=8, zorder=3)
        axis.set_xticks(range(len(tiers)), [f"{t}\n{data['tier_shares'][t]:.0%} of requests"
                                            for t in tiers])
        axis.set_yscale("log")
        axis.set_ylabel("p99 latency, ms (log)")
    axis.grid(True, axis="y", alpha=0.3)
    axis.legend(fontsize="small")
    fig.suptitle(f"{kind}: bench.pool --scenario {data['scenario']}: {data['workers_text']}, "
                 f"{data['rate_text']}, budget {data['slots']} models\n(bars/lines: medians "
                 "or rounds; dots: each round)", color="tab:red")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    return path
