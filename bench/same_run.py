"""Any benchmark, this tree against another revision, in one run, alternating.

    .venv/bin/python -m bench.same_run --before 48dc889 --rounds 3 \
        --field 'loads.*.texts_per_s' --field 'loads.*.cpu_us_per_text.total' \
        -- bench.device_feed --rounds 1 --duration 8

Each round runs the benchmark module once from each tree (`--before REV` is checked out
in a temporary git worktree; each run is a child process with that tree first on its
path, so it imports that tree's code, with the same virtualenv), the trees' order
alternating from round to round so that a machine that grows busier favours neither.
The benchmark writes its numbers with `--json` (every benchmark here takes it); each
`--field` (a dotted path into that JSON, `*` for every element of a list) is reported as
the median over the rounds for each tree, the rounds' range, and after ÷ before.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tqdm import tqdm

from app.tuning import markdown
from bench.lib.output import emit
from bench.lib.trees import ROOT, worktree


def run_once(tree: Path, module: str, argv: list[str]) -> Any:
    """The benchmark's JSON from one run in `tree`."""
    with tempfile.TemporaryDirectory(prefix="shoal-same-run-") as folder:
        out = Path(folder) / "out.json"
        env = {**os.environ, "PYTHONPATH": str(tree)}
        done = subprocess.run([sys.executable, "-m", module, *argv, "--json", str(out)],
                              cwd=tree, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not out.exists():
            raise SystemExit(f"{module} failed in {tree}:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def pick(data: Any, path: str) -> dict[str, float]:
    """The numbers at a dotted path (`*`: every list element), by their concrete path."""
    found: dict[str, float] = {}

    def walk(node: Any, parts: list[str], at: list[str]) -> None:
        if not parts:
            if isinstance(node, int | float) and not isinstance(node, bool):
                found[".".join(at)] = float(node)
            return
        head, rest = parts[0], parts[1:]
        if head == "*" and isinstance(node, list):
            for i, item in enumerate(node):
                walk(item, rest, [*at, str(i)])
        elif isinstance(node, dict) and head in node:
            walk(node[head], rest, [*at, head])
        elif isinstance(node, list) and head.isdigit() and int(head) < len(node):
            walk(node[int(head)], rest, [*at, head])

    walk(data, path.split("."), [])
    return found


def label(data: Any, path: str) -> str:
    """A row's name: its path, with a list element's `name`/`clients x texts` if it has."""
    parts, node, shown = path.split("."), data, []
    for part in parts:
        if isinstance(node, list):
            node = node[int(part)]
            if isinstance(node, dict) and "clients" in node and "texts" in node:
                shown.append(f"[{node['clients']}x{node['texts']}]")
            elif isinstance(node, dict) and "name" in node:
                extra = f" x{node['items_per_request']}" if "items_per_request" in node else ""
                shown.append(f"[{node['name']}{extra}]")
            else:
                shown.append(f"[{part}]")
        else:
            node = node[part] if isinstance(node, dict) else node
            shown.append(part)
    return ".".join(shown).replace(".[", "[")


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, list[Any]] = {"before": [], "after": []}
    with worktree(args.before) as before:
        order = [("before", before), ("after", ROOT)]
        with tqdm(total=args.rounds * 2, desc=f"same run: {args.module}",
                  file=sys.stderr) as bar:
            for round_ in range(args.rounds):
                for name, tree in (order if round_ % 2 == 0 else order[::-1]):
                    results[name].append(run_once(tree, args.module, args.argv))
                    bar.update()
    rows = []
    for field in args.field:
        for path in pick(results["after"][0], field):
            values = {name: [pick(r, path).get(path) for r in runs]
                      for name, runs in results.items()}
            values = {n: [v for v in vs if v is not None] for n, vs in values.items()}
            if not values["before"] or not values["after"]:
                continue
            b, a = statistics.median(values["before"]), statistics.median(values["after"])
            rows.append({"field": label(results["after"][0], path), "before": b, "after": a,
                         "before_range": [min(values["before"]), max(values["before"])],
                         "after_range": [min(values["after"]), max(values["after"])],
                         "ratio": a / b if b else None})
    return {"command": " ".join(["python -m bench.same_run", *sys.argv[1:]]),
            "before": args.before, "after": _head(), "rounds": args.rounds, "rows": rows,
            "runs": results}


def _head() -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False).stdout.strip()


def report(data: dict[str, Any]) -> str:
    def num(v: float) -> str:
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"

    rows = [[r["field"], num(r["before"]), f"{num(r['before_range'][0])} to "
             f"{num(r['before_range'][1])}", num(r["after"]),
             f"{num(r['after_range'][0])} to {num(r['after_range'][1])}",
             "-" if r["ratio"] is None else f"{r['ratio']:.2f}"] for r in data["rows"]]
    return "\n".join([f"`{data['command']}`", "",
                      f"before = {data['before']}, after = {data['after']}; medians of "
                      f"{data['rounds']} alternating rounds.", "",
                      *markdown.table(["field", "before", "rounds", "after", "rounds",
                                       "after ÷ before"], rows, align="lrrrrr")])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.same_run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the git revision to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--plot", type=Path, metavar="PNG",
                        help="also draw the rows whose field holds --plot-rows, before and "
                             "after with their rounds' range")
    parser.add_argument("--plot-rows", default="", metavar="TEXT",
                        help="which rows --plot draws (default: all); they share one unit")
    parser.add_argument("--plot-unit", default="", help="the plotted rows' unit, for its axis")
    parser.add_argument("--field", action="append", required=True,
                        help="a dotted path into the benchmark's JSON (repeatable)")
    parser.add_argument("--json", type=Path, help="also write every run's numbers here")
    parser.add_argument("module", help="the benchmark module, e.g. bench.device_feed")
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="its arguments")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    args.argv = [a for a in args.argv if a != "--"]
    data = run(args)
    if args.plot:
        draw(args.plot, data, args.plot_rows, args.plot_unit)
    return emit(report(data), data, args.json)


def draw(path: Path, data: dict[str, Any], rows: str, unit: str) -> Path:
    """The rows whose field holds `rows`, as bars (`bench.lib.plot.plot_same_run`)."""
    from bench.lib.plot import plot_same_run

    chosen = [r for r in data["rows"] if rows in r["field"]]
    module = data["command"].split(" -- ", 1)[-1].split()[0]
    title = (f"{module}: before {data['before']}, after {data['after']}\nmedians of "
             f"{data['rounds']} alternating rounds, bars: the rounds' range")
    return plot_same_run(path, chosen, title_text=title, unit=unit)


if __name__ == "__main__":
    sys.exit(main())
