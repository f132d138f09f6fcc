"""How long a worker answers nothing after its model runtime is killed, spare on and off.

    .venv/bin/python -m bench.crash_gap [--kills 5] [--concurrency 4] [--modes on,off]
        [--scenario kill|replacement-kill] [--json out.json]

Per mode (SHOAL_RUNTIME_SPARE=1, =0): a private stack (gateway + one worker serving
the packaged MiniLM, `app.tuning.bench_stack`), `--concurrency` clients each sending one
unique short text at a time (closed loop, keep-alive), and `--kills` times a
SIGKILL of the worker's serving runtime process (the oldest `runtimes.child_side.server`
child of the worker: a spare always starts after the child it would replace). Before
each kill the stack is steady again: answers flow, and with the spare on a spare has
finished importing (else the kill would measure a spare caught mid-import).

`--scenario replacement-kill` (spare on only): each kill is a drill of two. The
serving runtime is SIGKILLed; as soon as the worker has promoted its spare (the next
spare appears: it is started right after the promotion), the promoted spare is SIGKILLed
too, while it connects and loads the models. The next spare is then still importing
torch. The figures are taken from the first kill.

Per kill:
- gap: the longest time without any answer, from 1 s before the kill to 30 s after
  (with one worker nothing else answers; the batch in the killed runtime is rerun);
- p99: the 99th percentile latency of the requests sent from 1 s before the kill to
  5 s after it (those that waited for the recovery);
- errors: answers other than 200, by status (0: no HTTP answer); a 504 is the
  gateway's deadline passing while the runtime restarts.
Reported per mode: the median and the worst of the kills' figures, and the p50/p99
latency of the steady state before the first kill.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import itertools
import json
import os
import signal
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from app.tuning import markdown
from app.tuning.bench_stack import bench_stack
from app.tuning.stats import median, percentile
from bench.lib.minilm import MINILM
from bench.lib.output import emit

BEFORE_S, GAP_AFTER_S, P99_AFTER_S = 1.0, 30.0, 5.0


# --------------------------------------------------------------------------- load


@dataclass
class Load:
    """Closed-loop clients; every answer's (sent, done, status), in completion order."""

    url: str
    concurrency: int
    answers: list[tuple[float, float, int]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._client, daemon=True)
                   for _ in range(self.concurrency)]
        for thread in threads:
            thread.start()
        return threads

    def _client(self) -> None:
        host, port = self.url.split("//", 1)[1].split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=120)
        path = f"/v1/encode/{MINILM}"
        while not self.stop.is_set():
            body = json.dumps({"items": [{"text": f"steady load {uuid.uuid4().hex}"}]})
            sent = time.monotonic()
            try:
                connection.request("POST", path, body, {"content-type": "application/json"})
                response = connection.getresponse()
                response.read()
                status = response.status
            except (OSError, http.client.HTTPException):
                status = 0
                connection.close()
                connection = http.client.HTTPConnection(host, int(port), timeout=120)
            with self._lock:
                self.answers.append((sent, time.monotonic(), status))

    def snapshot(self) -> list[tuple[float, float, int]]:
        with self._lock:
            return list(self.answers)

    def answered_since(self, since: float) -> int:
        return sum(1 for _, done, status in self.snapshot() if done > since and status == 200)


# --------------------------------------------------------------------------- the worker


def runtime_children(worker_pid: int) -> list[tuple[int, int, list[str]]]:
    """The worker's `runtimes.child_side.server` children: (start time in ticks, pid, argv). Of
    every
    thread of the worker: a restart starts them from the thread whose batch failed."""
    pids = set()
    for task in Path(f"/proc/{worker_pid}/task").iterdir():
        with contextlib.suppress(OSError):
            pids.update(int(p) for p in (task / "children").read_text().split())
    found = []
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            if "runtimes.child_side.server" in argv:
                stat = Path(f"/proc/{pid}/stat").read_text()
                started = int(stat.rsplit(")", 1)[1].split()[19])
                found.append((started, pid, argv))
    return sorted(found)


def serving_pid(worker_pid: int) -> int | None:
    children = runtime_children(worker_pid)
    return children[0][1] if children else None


def spare_ready(worker_pid: int) -> bool:
    """A spare that finished importing: it listens on its socket, nobody connected yet."""
    for _, _, argv in runtime_children(worker_pid)[1:]:
        if "--spare" in argv and Path(argv[argv.index("--socket") + 1]).exists():
            return True
    return False


def wait(condition: Any, timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f}s for {what}")
        time.sleep(interval)
    return found


def kill_the_replacement(worker_pid: int, killed: int, spare: int) -> int:
    """Once `spare` replaces the killed runtime (the worker starts the next spare right
    after promoting it, before it loads), SIGKILL it: it dies while it loads."""
    def promoted() -> bool:
        return any(pid not in (killed, spare) for _, pid, _ in runtime_children(worker_pid))

    # Polled often: the promoted spare loads MiniLM in a few hundred ms.
    wait(promoted, 60, "the spare's promotion", interval=0.002)
    os.kill(spare, signal.SIGKILL)
    return spare


# --------------------------------------------------------------------------- figures


def longest_gap(answers: list[tuple[float, float, int]], start: float, end: float) -> float:
    """The longest time in [start, end] without an answer."""
    times = sorted(done for _, done, _ in answers if start <= done <= end)
    edges = [start, *times, end]
    return max(b - a for a, b in itertools.pairwise(edges))


def rank_above(values: list[float], q: float) -> float | None:
    """The q-th quantile (q from 0 to 1), the rank above where it falls between two."""
    return percentile(values, q * 100, method="higher")


def kill_figures(answers: list[tuple[float, float, int]], killed: float,
                 next_kill: float | None) -> dict[str, Any]:
    # The window ends at the last answer seen, at most GAP_AFTER_S after the kill, and
    # before the next kill's window.
    end = min(killed + GAP_AFTER_S, max((done for _, done, _ in answers), default=killed),
              float("inf") if next_kill is None else next_kill - BEFORE_S)
    gap = longest_gap(answers, killed - BEFORE_S, end)
    during = [done - sent for sent, done, _ in answers
              if killed - BEFORE_S <= sent <= min(killed + P99_AFTER_S, end)]
    errors = Counter(str(status) for sent, _, status in answers
                     if status != 200 and killed - BEFORE_S <= sent <= end)
    return {"gap_s": gap, "p99_s": rank_above(during, 0.99), "requests": len(during),
            "errors": sum(errors.values()), "error_statuses": dict(errors)}


# --------------------------------------------------------------------------- one mode


def run_mode(spare: bool, args: argparse.Namespace, bar: tqdm) -> dict[str, Any]:
    env = {"SHOAL_RUNTIME_SPARE": "1" if spare else "0", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "SHOAL_TORCH_THREADS": str(args.threads)}
    with bench_stack(MINILM, extra_env=env) as stack:
        worker_pid = stack.pids[1]  # gateway, then the one worker
        load = Load(stack.url, args.concurrency)
        threads = load.start()
        kills: list[dict[str, Any]] = []
        try:
            time.sleep(args.warmup)
            steady_start = time.monotonic() - args.warmup
            for _ in range(args.kills):
                # Steady again: answers flow (and a spare is ready when on).
                wait(lambda: load.answered_since(time.monotonic() - 1.0) > 0, 120,
                     "answers to flow")
                if spare:
                    wait(lambda: spare_ready(worker_pid), 180, "a spare to finish importing")
                time.sleep(args.settle)
                children = runtime_children(worker_pid)
                assert children, "no runtime process"
                pid = children[0][1]
                killed = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                if args.scenario == "replacement-kill":
                    kill_the_replacement(worker_pid, pid, children[1][1])
                wait(lambda k=killed: load.answered_since(k) > 0, 180, "answers after a kill")
                time.sleep(P99_AFTER_S + 1)
                kills.append({"killed_at": killed, "pid": pid})
                bar.update(1)
        finally:
            load.stop.set()
            for thread in threads:
                thread.join(130)
        answers = load.snapshot()
    first_kill = kills[0]["killed_at"] if kills else time.monotonic()
    steady = [done - sent for sent, done, status in answers
              if steady_start <= sent and done < first_kill - BEFORE_S and status == 200]
    for kill, after in itertools.zip_longest(kills, kills[1:]):
        kill.update(kill_figures(answers, kill["killed_at"],
                                 None if after is None else after["killed_at"]))
    return {"spare": spare, "scenario": args.scenario, "kills": kills,
            "steady_p50_s": rank_above(steady, 0.5),
            "steady_p99_s": rank_above(steady, 0.99), "requests": len(answers),
            "errors": sum(1 for *_, status in answers if status != 200),
            "error_statuses": dict(Counter(str(s) for *_, s in answers if s != 200))}


# --------------------------------------------------------------------------- output


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def table(results: list[dict[str, Any]]) -> str:
    rows = []
    for result in results:
        gaps = [k["gap_s"] for k in result["kills"]]
        p99s = [k["p99_s"] for k in result["kills"] if k["p99_s"] is not None]
        rows.append([
            ("on" if result["spare"] else "off") +
            (", replacement killed" if result.get("scenario") == "replacement-kill" else ""),
            len(gaps), _ms(median(gaps)),
            _ms(max(gaps) if gaps else None), _ms(median(p99s)),
            f"{_ms(result['steady_p50_s'])} / {_ms(result['steady_p99_s'])}",
            f"{result['errors']} {result['error_statuses'] or ''}",
            ", ".join(_ms(g) for g in gaps)])
    return "\n".join(markdown.table(
        ["spare", "kills", "longest gap, median ms", "longest gap, worst ms",
         "p99 during fault, median ms", "steady p50 / p99 ms", "errors", "gaps ms"],
        rows, align="lrrrrrrl"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.crash_gap", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=5, help="SIGKILLs of the runtime per mode")
    parser.add_argument("--concurrency", type=int, default=4, help="closed-loop clients")
    parser.add_argument("--modes", default="on,off", help="spare modes to run: on, off")
    parser.add_argument("--scenario", choices=("kill", "replacement-kill"), default="kill",
                        help="kill: SIGKILL the serving runtime; replacement-kill: then "
                             "its promoted spare too, while it loads (spare on only)")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of load first")
    parser.add_argument("--settle", type=float, default=1.0,
                        help="seconds of steady load before each kill")
    parser.add_argument("--threads", type=int, default=0,
                        help="SHOAL_TORCH_THREADS of the worker (0: torch's default)")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    modes = [m.strip() == "on" for m in args.modes.split(",") if m.strip()]
    if args.scenario == "replacement-kill" and modes != [True]:
        raise SystemExit("--scenario replacement-kill needs --modes on (it kills the spare)")
    results = []
    with tqdm(total=args.kills * len(modes), desc="kills", file=sys.stderr) as bar:
        for spare in modes:
            results.append(run_mode(spare, args, bar))
    command = "python -m bench.crash_gap " + " ".join(argv if argv is not None else sys.argv[1:])
    return emit(f"`{command}`\n\n{table(results)}", {"args": vars(args), "results": results},
                args.json)


if __name__ == "__main__":
    sys.exit(main())
