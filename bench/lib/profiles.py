"""py-spy profiles of a benchmark's processes, and what they say.

`record` starts `py-spy record` on each process (raw collapsed stacks, only samples of a
thread holding the GIL: where a process's CPU goes); `report` turns the recordings into
each process's cores and, per thread, its top functions (written beside each recording as
NAME.top.txt). `bench.sglang --py-spy` and `bench.device_feed --py-spy` use them.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def top_functions(collapsed: str, limit: int = 25) -> list[tuple[str, float, float]]:
    """From py-spy's raw (collapsed) stacks, "frame;frame;... count" per line: the
    functions with the most samples, as (function, % of samples on the stack, % as the
    innermost frame), most on the stack first. A function is counted once per stack."""
    total = 0
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [f for f in stack.split(";") if f]
        # The thread/process header frames py-spy adds are not functions.
        frames = [f for f in frames if not f.startswith(("process ", "thread "))]
        for frame in set(frames):
            inclusive[frame] += n
        if frames:
            own[frames[-1]] += n
    if not total:
        return []
    return [(name, 100 * n / total, 100 * own[name] / total)
            for name, n in inclusive.most_common(limit)]


def record(pids: Mapping[str, int], seconds: float, out: Path) -> list[subprocess.Popen]:
    """`py-spy record` of each process for `seconds`: raw collapsed stacks, 200 Hz, only
    samples of a thread holding the GIL (where the process's CPU goes), thread names
    first."""
    exe = Path(sys.executable).with_name("py-spy")
    out.mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen([str(exe), "record", "--pid", str(pid), "--duration",
                              str(int(seconds)), "--rate", "200", "--format", "raw",
                              "--threads", "--gil", "--nonblocking",
                              "--output", str(out / f"{name}.txt")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name, pid in pids.items()]


def by_thread(collapsed: str) -> dict[str, str]:
    """py-spy's collapsed stacks (recorded with --threads) split by thread name."""
    threads: dict[str, list[str]] = {}
    for line in collapsed.splitlines():
        first = line.split(";", 1)[0]
        name = first.split(": ", 1)[1].strip('"') if first.startswith("thread ") \
            and ": " in first else "?"
        threads.setdefault(name, []).append(line)
    return {name: "\n".join(lines) for name, lines in threads.items()}


def samples(collapsed: str) -> int:
    return sum(int(count) for line in collapsed.splitlines()
               for _, _, count in [line.rpartition(" ")] if count.isdigit())


def report(out: Path, seconds: float, rate: int = 200) -> dict[str, Any]:
    """For each recorded process: its CPU (GIL-holding samples as cores), and per thread
    its share and top functions; also written beside each recording as NAME.top.txt."""
    report: dict[str, Any] = {}
    for path in sorted(out.glob("*.txt")):
        if path.name.endswith(".top.txt"):
            continue
        collapsed = path.read_text(errors="replace")
        total = samples(collapsed)
        entry: dict[str, Any] = {"cores": total / (seconds * rate), "threads": {}}
        lines = [f"{path.stem}: {total} samples holding the GIL in {seconds:g} s at "
                 f"{rate} Hz = {entry['cores']:.2f} cores"]
        for thread, stacks in sorted(by_thread(collapsed).items(),
                                     key=lambda item: -samples(item[1])):
            n = samples(stacks)
            top = top_functions(stacks, limit=60)
            entry["threads"][thread] = {"share": n / total if total else 0.0, "top": top}
            lines += ["", f"thread {thread}: {100 * n / max(total, 1):.0f}% of the samples",
                      "% on stack | % innermost | function"]
            lines += [f"{inc:6.1f} | {own:6.1f} | {name}" for name, inc, own in top]
        report[path.stem] = entry
        path.with_suffix(".top.txt").write_text("\n".join(lines) + "\n")
    return report
