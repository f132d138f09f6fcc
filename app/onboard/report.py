"""The onboarding dashboard: what each model of a catalog does on this device.

`write_report` turns the `ModelReport`s of a run (app.onboard.results) into
`README.md` (a summary table, then a section per model with every candidate) and PNGs
beside it: a throughput-vs-p99 plot per model that was tuned, and `parity.png`, every
candidate's headline parity figure.

matplotlib is imported only when the plots are drawn (it costs a second and is a dev
extra); without it the page is still written, and says the plots were left out. The
Agg canvas is used directly, as app.tuning.plot does, so no pyplot state is involved.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING

from app.onboard.results import Candidate, ModelReport
from app.tuning.markdown import table

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# Which parity figure speaks for a candidate: the first of these it has.
HEADLINE_ORDER = ("cosine_min", "score_max_abs_diff", "labels_agree", "tokens_agree")
PARITY_PNG = "parity.png"
# A p99 range this wide (max / min) is drawn on a log axis, or the fast end is a flat line.
LOG_RANGE = 10.0


# ---- pure helpers: names and numbers ---------------------------------------------------

def slug(model: str) -> str:
    """A file name stem for `model`: lowercased, runs of anything but a-z0-9 as one '-'."""
    return re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-") or "model"


def image_stems(models: Sequence[str]) -> list[str]:
    """One distinct stem per model, in order: slugs can collide ("a_b", "a-b") and the
    overview's own name is taken, so later ones get -2, -3..."""
    taken = {PARITY_PNG.removesuffix(".png")}
    stems = []
    for model in models:
        base = stem = slug(model)
        n = 1
        while stem in taken:
            n += 1
            stem = f"{base}-{n}"
        taken.add(stem)
        stems.append(stem)
    return stems


def headline(parity: dict[str, float]) -> tuple[str, float] | None:
    """The figure that speaks for a parity check: by HEADLINE_ORDER, else the first one."""
    for name in HEADLINE_ORDER:
        if name in parity:
            return name, parity[name]
    return next(iter(parity.items()), None)


def num(value: float | None, missing: str = "-") -> str:
    """At most three significant digits, no exponent (1234, 123, 12.3, 1.2, 0.0123):
    throughputs and latencies span 0.1 to 10,000 across a catalog."""
    if value is None or math.isnan(value):
        return missing
    if math.isinf(value) or abs(value) >= 100:
        return f"{value:.0f}"
    if value == 0:
        return "0"
    decimals = min(9, 2 - math.floor(math.log10(abs(value))))
    text = f"{value:.{decimals}f}"
    # 16.0 clients and 0.400 s read as more precise than they are.
    return text.rstrip("0").rstrip(".") if "." in text else text


def cosine(value: float) -> str:
    """Enough decimals to show how far from 1 a cosine is (0.99998, 0.9999999), which a
    fixed width would round away exactly where parity is judged."""
    distance = 1.0 - value
    if distance <= 0:
        return f"{value:.4f}"
    # The slack keeps float noise (1 - 0.9999999 = 9.99999994e-08) from adding a digit.
    decimals = max(4, min(9, math.ceil(-math.log10(distance) - 1e-6)))
    return f"{value:.{decimals}f}"


def percent(fraction: float) -> str:
    """An agreement fraction as a percentage that reads 100% only when it is 1."""
    text = f"{fraction * 100:.4g}"
    if fraction < 1 and float(text) >= 100:
        return ">99.99%"
    return f"{text}%"


def figure_text(name: str, value: float) -> str:
    """A parity figure as the page shows it: "cosine min 0.99998", "labels 100%"."""
    label = name.removesuffix("_agree").replace("_", " ")
    if math.isnan(value):  # a check that could not compute its figure
        return f"{label} n/a"
    if "cosine" in name:
        return f"{label} {cosine(value)}"
    if name.endswith("_agree"):
        return f"{label} {percent(value)}"
    return f"{label} {value:.2g}"


def headline_text(parity: dict[str, float]) -> str:
    figure = headline(parity)
    return "-" if figure is None else figure_text(*figure)


def cell(text: str) -> str:
    """Free text (reasons, notes) made safe for one table cell."""
    return " ".join(text.split()).replace("|", "\\|") or "-"


# ---- the markdown ----------------------------------------------------------------------

def speaker(report: ModelReport) -> Candidate | None:
    """The candidate whose figures the summary row shows: the chosen one, else the first
    with parity figures (a refused model's failing figure is the news)."""
    return report.chosen or next((c for c in report.candidates if c.parity), None)


def summary_row(report: ModelReport) -> list[str]:
    chosen, shown = report.chosen, speaker(report)
    return [report.model, report.adapter, report.status,
            chosen.label if chosen else "-",
            num(chosen.knee_throughput) if chosen else "-",
            num(chosen.knee_p99_ms) if chosen else "-",
            headline_text(shown.parity) if shown else "-",
            num(report.seconds)]


def summary_table(reports: Iterable[ModelReport]) -> list[str]:
    head = ["model", "adapter", "status", "chosen", "knee req/s", "knee p99 ms", "parity",
            "seconds"]
    return table(head, (summary_row(r) for r in reports), align="llllrrlr")


def candidate_row(c: Candidate) -> list[str]:
    # Bold marks the chosen one without a column that is empty on every other row.
    bold = "**" if c.chosen else ""
    runtime, precision = f"{bold}{c.runtime}{bold}", f"{bold}{c.precision}{bold}"
    parity = ", ".join(figure_text(k, v) for k, v in c.parity.items()) or "-"
    return [runtime, precision, parity, cell(c.tolerance), "yes" if c.parity_ok else "no",
            num(c.knee_throughput), num(c.knee_p99_ms), num(c.knee_load), cell(c.note)]


def candidate_table(candidates: Iterable[Candidate]) -> list[str]:
    head = ["runtime", "precision", "parity", "tolerance", "ok", "knee req/s", "knee p99 ms",
            "knee clients", "note"]
    return table(head, (candidate_row(c) for c in candidates), align="lllllrrrl")


def model_section(report: ModelReport, image: str | None, device: str) -> list[str]:
    facts = [f"`{report.adapter}`", f"**{report.status}**", f"{num(report.seconds)} s"]
    if report.weights_hash:
        facts.append(f"weights `{report.weights_hash}`")
    if report.device and report.device != device:
        facts.append(f"measured on {report.device}")
    lines = [f"## {report.model}", "", " · ".join(facts), ""]
    if report.reason:
        lines += [f"> {report.status}: {' '.join(report.reason.split())}", ""]
    if report.choices:
        lines += ["Detected:", "", *(f"- {choice}" for choice in report.choices), ""]
    if report.candidates:
        lines += [*candidate_table(report.candidates), ""]
        if report.chosen:
            lines += ["Bold: the chosen runtime and precision.", ""]
    if image:
        lines += [f"![{report.model}: throughput against p99 per candidate]({image})", ""]
    return lines


def count_line(reports: Sequence[ModelReport]) -> str:
    counts: dict[str, int] = {}
    for r in reports:
        counts[r.status] = counts.get(r.status, 0) + 1
    parts = ", ".join(f"{n} {status}" for status, n in counts.items())
    noun = "model" if len(reports) == 1 else "models"
    return f"{len(reports)} {noun}" + (f": {parts}." if parts else ".")


def page(reports: Sequence[ModelReport], images: Sequence[str | None], *, device: str,
         command: str, day: date, parity_image: str | None, plots_note: str = "") -> str:
    lines = [f"# shoal onboarding: {device}, {day.isoformat()}", "",
             "Produced by:", "", "```sh", command, "```", "", count_line(reports), "",
             *summary_table(reports), ""]
    if plots_note:
        lines += [plots_note, ""]
    if parity_image:
        lines += ["Parity, every candidate's headline figure (green: within tolerance):", "",
                  f"![parity per model and candidate]({parity_image})", ""]
    for report, image in zip(reports, images, strict=True):
        lines += model_section(report, image, device)
    return "\n".join(lines).rstrip("\n") + "\n"


# ---- the plots -------------------------------------------------------------------------

def curve_xy(c: Candidate) -> tuple[list[float], list[float]]:
    """Throughput and p99 of the points that have a p99, in load order."""
    points = sorted((p for p in c.curve if p.p99_ms is not None), key=lambda p: p.load)
    return [p.throughput for p in points], [p.p99_ms for p in points if p.p99_ms is not None]


def wide(values: Sequence[float]) -> bool:
    positive = [v for v in values if v > 0]
    return len(positive) == len(values) > 0 and max(positive) / min(positive) >= LOG_RANGE


def new_figure(width: float, height: float) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def plot_curves(path: Path, report: ModelReport) -> Path | None:
    """Throughput against p99, a line per candidate with a curve; None (no file) when
    no candidate has one."""
    drawn = [(c, *curve_xy(c)) for c in report.candidates]
    drawn = [(c, xs, ys) for c, xs, ys in drawn if xs]
    if not drawn:
        return None
    fig = new_figure(8, 5)
    ax = fig.subplots()
    for c, xs, ys in drawn:
        # The chosen one in front and heavier: it is the line the page is about.
        style = ({"linewidth": 2.8, "zorder": 3} if c.chosen
                 else {"linewidth": 1.3, "alpha": 0.7, "zorder": 2})
        (line,) = ax.plot(xs, ys, "o-", markersize=4,
                          label=c.label + (" (chosen)" if c.chosen else ""), **style)
        if c.knee_throughput is not None and c.knee_p99_ms is not None:
            ax.plot([c.knee_throughput], [c.knee_p99_ms], "*", markersize=16 if c.chosen else 12,
                    color=line.get_color(), markeredgecolor="black", zorder=4)
    if wide([y for _, _, ys in drawn for y in ys]):
        ax.set_yscale("log")
    ax.plot([], [], "*", color="grey", markeredgecolor="black", markersize=12, label="knee")
    ax.set_xlabel("throughput, req/s")
    ax.set_ylabel("p99 latency, ms")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left")
    # Two lines: a catalog's model ids are long enough to run off one.
    ax.set_title(f"{report.model}\nthroughput against p99 per candidate", fontweight="bold")
    fig.savefig(path, dpi=100)
    return path


@dataclass(frozen=True)
class Kind:
    """How one kind of headline figure is drawn: its own panel, its own axis."""

    title: str
    log: bool

    def value(self, name: str, figure: float) -> float:
        if "cosine" in name:
            return 1.0 - figure  # distance from perfect, so 0.99999 and 0.999 differ visibly
        if name.endswith("_agree"):
            return figure * 100
        return figure


def kind_of(name: str) -> Kind:
    if "cosine" in name:
        return Kind(f"1 - {name.replace('_', ' ')} (distance from identical)", log=True)
    if name.endswith("_agree"):
        return Kind(f"{name.removesuffix('_agree')} agreeing, %", log=False)
    return Kind(name.replace("_", " "), log=True)


@dataclass(frozen=True)
class Mark:
    label: str
    name: str
    figure: float
    ok: bool
    chosen: bool


def parity_marks(reports: Iterable[ModelReport]) -> dict[Kind, list[Mark]]:
    """Every candidate's headline figure, grouped by how it is drawn."""
    panels: dict[Kind, list[Mark]] = {}
    for r in reports:
        for c in r.candidates:
            figure = headline(c.parity)
            if figure is not None:
                mark = Mark(f"{r.model} · {c.label}", figure[0], figure[1], c.parity_ok,
                            c.chosen)
                panels.setdefault(kind_of(figure[0]), []).append(mark)
    return panels


def right_half(values: Sequence[float], log: bool) -> list[bool]:
    """Which points sit in the right half of their panel's span (log: in decades)."""
    if log:
        scaled = [math.log10(v) for v in values]
        low, high = min(scaled, default=0.0), max(scaled, default=0.0)
    else:
        scaled, low, high = list(values), 0.0, 100.0  # the agreement axis is fixed
    return [high > low and (v - low) / (high - low) > 0.5 for v in scaled]


def draw_panel(ax: Axes, kind: Kind, marks: Sequence[Mark]) -> None:
    # Markers, not bars: a bar on a log axis starts at an arbitrary edge, so its length
    # would say nothing.
    values = [kind.value(m.name, m.figure) for m in marks]
    if kind.log:
        # A log axis has no 0: an exact match sits a decade below the smallest miss,
        # and its printed figure says what it is.
        floor = min((v for v in values if v > 0), default=1e-9) / 10
        values = [max(v, floor) for v in values]
        ax.set_xscale("log")
        ax.margins(x=0.3, y=0.15)
    else:
        ax.set_xlim(0, 103)  # a point at 100% whole, not cut by the frame
        ax.margins(y=0.15)
    ys = list(range(len(marks)))
    ax.scatter(values, ys, s=[110 if m.chosen else 50 for m in marks], zorder=3,
               c=["tab:green" if m.ok else "tab:red" for m in marks],
               edgecolors=["black" if m.chosen else "none" for m in marks], linewidths=1.5)
    for y, v, m, right in zip(ys, values, marks, right_half(values, kind.log), strict=True):
        # Printed towards the middle, so the figure of an extreme point stays inside.
        ax.annotate(figure_text(m.name, m.figure), (v, y), xytext=(-8 if right else 8, 0),
                    textcoords="offset points", va="center", ha="right" if right else "left",
                    fontsize=8)
    ax.set_yticks(ys, [m.label + (" (chosen)" if m.chosen else "") for m in marks],
                  fontsize=8)
    ax.invert_yaxis()  # first model on top, as in the table
    ax.set_xlabel(kind.title)
    ax.grid(True, axis="x", which="major", alpha=0.3)


def plot_parity(path: Path, reports: Sequence[ModelReport]) -> Path | None:
    """One panel per kind of headline figure; None (no file) when nothing has one."""
    panels = parity_marks(reports)
    if not panels:
        return None
    heights = [len(marks) + 2 for marks in panels.values()]
    fig = new_figure(9, 0.35 * sum(heights) + 1)
    axes = fig.subplots(len(panels), 1, squeeze=False, height_ratios=heights)[:, 0]
    for ax, (kind, marks) in zip(axes, panels.items(), strict=True):
        draw_panel(ax, kind, marks)
    fig.suptitle("parity per model and candidate (green: within tolerance)",
                 fontweight="bold")
    fig.savefig(path, dpi=100)
    return path


def matplotlib_missing() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return True
    return False


# ---- the entry point -------------------------------------------------------------------

def write_report(reports: list[ModelReport], out_dir: Path, device: str, command: str, *,
                 today: date | None = None) -> Path:
    """Write `out_dir/README.md` and its PNGs; return the markdown's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stems = image_stems([r.model for r in reports])
    images: list[str | None] = [None] * len(reports)
    parity_image, note = None, ""
    if matplotlib_missing():
        note = "Plots left out: matplotlib is not installed (`pip install matplotlib`)."
    else:
        for i, (report, stem) in enumerate(zip(reports, stems, strict=True)):
            drawn = plot_curves(out_dir / f"{stem}.png", report)
            images[i] = drawn.name if drawn else None
        drawn = plot_parity(out_dir / PARITY_PNG, reports)
        parity_image = drawn.name if drawn else None
    path = out_dir / "README.md"
    path.write_text(page(reports, images, device=device, command=command,
                         day=today or date.today(), parity_image=parity_image,
                         plots_note=note), encoding="utf-8")
    return path
