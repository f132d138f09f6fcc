"""bench.sglang's view of the processes it measures: the SGLang server a worker started,
process groups, their names and CPU seconds (from /proc), cores used over a phase."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping, Sequence
from pathlib import Path


def _stat(pid: int) -> list[str]:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return raw[raw.rindex(")") + 2:].split()


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def group_of(leader: int) -> list[int]:
    """The processes of a process group (SGLang's launcher and the processes it spawned)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                if int(_stat(int(entry.name))[2]) == leader:
                    pids.append(int(entry.name))
    return sorted(pids)


def sglang_server_of(worker: int) -> tuple[int, int]:
    """(pid, port) of the SGLang server a shoal worker started (its child running
    runtimes/sglang/launch.py)."""
    from app.tuning.bench_stack import _children

    for child in _children(worker):
        argv = cmdline(child).split(b"\0")
        if any(a.endswith(b"runtimes/sglang/launch.py") for a in argv):
            return child, int(argv[argv.index(b"--port") + 1])
    raise RuntimeError(f"worker {worker} runs no SGLang server")


def process_name(pid: int) -> str:
    """SGLang's process titles (sglang::scheduler), else the executable's name."""
    with contextlib.suppress(OSError):
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        if comm.startswith("sglang::"):
            return comm
    argv = cmdline(pid).split(b"\0")
    if any(a.endswith(b"launch.py") for a in argv):
        return "sglang::http"
    if any(b"resource_tracker" in a for a in argv):
        return "resource_tracker"
    return Path(argv[0].decode(errors="replace")).name if argv and argv[0] else str(pid)


def group_cpu_seconds(pids: Sequence[int]) -> float:
    """CPU seconds of a group of processes (app.tuning.cpu.cpu_seconds of each; one gone
    counts nothing)."""
    from app.tuning.cpu import cpu_seconds

    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += cpu_seconds(pid)
    return total


async def cores_over(start: float, end: float,
                     groups: Mapping[str, Sequence[int]]) -> dict[str, float]:
    """CPU seconds per second of each group of processes between two perf_counter times."""
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    before = {name: group_cpu_seconds(pids) for name, pids in groups.items()}
    await asyncio.sleep(max(0.0, end - time.perf_counter()))
    return {name: (group_cpu_seconds(pids) - before[name]) / (end - start)
            for name, pids in groups.items()}
