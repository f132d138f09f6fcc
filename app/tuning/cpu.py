"""CPU seconds the stack's processes (and the load generator) spend over a measured window.

Read from /proc (utime + stime), so a benchmark can say what one request
costs each process: gateway, worker, runtime, broker.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (threads included, children not)."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2 :].split()  # fields from #3 (state) on
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def process_label(pid: int) -> str:
    """A short name: the `shoal` subcommand, else the executable's name."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return str(pid)
    words = [a.decode(errors="replace") for a in argv if a]
    for i, word in enumerate(words):
        if word.endswith("/shoal") or word in ("shoal", "app.cli"):
            return f"{' '.join(['shoal', *words[i + 1 : i + 2]])} ({pid})"
        if word == "runtimes.child_side.server":
            return f"runtime ({pid})"
    name = Path(words[0]).name if words else "?"
    return f"{name} ({pid})"


def process_kind(label: str) -> str:
    """A `process_label` without its pid: what processes of one kind add up under."""
    return label.rsplit(" (", 1)[0]


def cpu_snapshot(pids: Sequence[int]) -> dict[int, float]:
    """CPU seconds of each process still alive."""
    snapshot = {}
    for pid in pids:
        try:
            snapshot[pid] = cpu_seconds(pid)
        except OSError:
            print(f"warning: process {pid} is gone", file=sys.stderr)
    return snapshot


@dataclass(frozen=True)
class CpuUse:
    by_process: dict[str, float]  # CPU seconds per process label, alive at both ends
    client: float  # CPU seconds of this process: the load generator itself

    def ms_per_request(self, requests: int) -> tuple[dict[str, float], float | None]:
        """(ms per request of each process plus their "total", the client's); empty and
        None without requests."""
        if not requests:
            return {}, None
        per = {name: seconds * 1000 / requests for name, seconds in self.by_process.items()}
        if per:
            per["total"] = sum(per.values())
        return per, self.client * 1000 / requests


async def cpu_over(start: float, end: float, pids: Sequence[int]) -> CpuUse:
    """CPU used between two `time.perf_counter()` instants, sleeping until each."""
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    before, client_before = cpu_snapshot(pids), time.process_time()
    await asyncio.sleep(max(0.0, end - time.perf_counter()))
    after, client_after = cpu_snapshot(pids), time.process_time()
    return CpuUse({process_label(pid): after[pid] - before[pid] for pid in before if pid in after},
                  client_after - client_before)
