"""How long callers go without a success when a runtime's replacement dies while it loads,
and how many refusals they are sent meanwhile, with clients that honour Retry-After and
clients that retry at once, on one worker and with a peer.

    .venv/bin/python -m bench.replacement_storm [--drills 3] [--clients 4]
        [--modes polite,naive] [--workers 1,2] [--json out.json]

Per (workers, client mode): a private stack (gateway + `workers` workers serving the
packaged MiniLM, each with a spare runtime; `app.tuning.bench_stack`) and `--clients`
closed-loop clients, each sending one short text at a time and, on a 503, sending it
again: `polite` after the response's Retry-After (what the openai client and most SDKs
do), `naive` at once. Each drill is the fault of `bench.crash_gap --scenario
replacement-kill` on the first worker: its serving runtime is SIGKILLed and, as soon as
the spare is promoted (the next spare appears), the promoted spare too, while it loads;
the next spare has only begun to import torch. Before each drill answers flow and the
first worker's spare has imported.

Per drill:
- gap: from the kill to the first 200 of a request sent after it (any client; with a
  peer, it may serve at once; an answer to a request in flight at the kill may have been
  computed before it);
- refusals: 503s answered between the kill and that first success, and per second;
- retry-after: the largest Retry-After those 503s carried.
Reported per (workers, mode): the median and the worst drill.
"""

from __future__ import annotations

import argparse
import http.client
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
from app.tuning.stats import median
from bench.crash_gap import kill_the_replacement, runtime_children, spare_ready, wait
from bench.lib.minilm import MINILM
from bench.lib.output import emit

FIRST_SUCCESS_WAIT_S = 120.0


@dataclass
class Clients:
    """Closed-loop clients; every answer's (sent, done, status, Retry-After), in completion
    order."""

    url: str
    count: int
    polite: bool
    answers: list[tuple[float, float, int, int | None]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._client, daemon=True) for _ in range(self.count)]
        for thread in threads:
            thread.start()
        return threads

    def _client(self) -> None:
        host, port = self.url.split("//", 1)[1].split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=120)
        path = f"/v1/encode/{MINILM}"
        body = None
        while not self.stop.is_set():
            body = body or json.dumps({"items": [{"text": f"text {uuid.uuid4().hex}"}]})
            retry_after = None
            sent = time.monotonic()
            try:
                connection.request("POST", path, body, {"content-type": "application/json"})
                response = connection.getresponse()
                response.read()
                status = response.status
                header = response.getheader("retry-after")
                retry_after = int(header) if header and header.isdigit() else None
            except (OSError, http.client.HTTPException):
                status = 0
                connection.close()
                connection = http.client.HTTPConnection(host, int(port), timeout=120)
            with self._lock:
                self.answers.append((sent, time.monotonic(), status, retry_after))
            if status == 200:
                body = None  # the next request is a new text; a refused one is sent again
            elif self.polite and status in (429, 503):
                # A fresh connection after the wait: the gateway may close an idle one
                # meanwhile, and http.client does not retry a request on a stale one (the
                # clients that honour Retry-After, httpx and requests, do).
                connection.close()
                self.stop.wait(retry_after if retry_after is not None else 1.0)

    def snapshot(self) -> list[tuple[float, float, int, int | None]]:
        with self._lock:
            return list(self.answers)

    def first_success_after(self, since: float) -> float | None:
        """When the first request sent after `since` was answered 200 (a request in flight
        at a kill may be answered from before it)."""
        return next((done for sent, done, status, _ in self.snapshot()
                     if sent > since and status == 200), None)


def drill_figures(answers: list[tuple[float, float, int, int | None]], killed: float,
                  success: float) -> dict[str, Any]:
    refused = [(done, after) for _, done, status, after in answers
               if killed < done <= success and status == 503]
    gap = success - killed
    return {"gap_s": gap, "refusals": len(refused),
            "refusals_per_s": len(refused) / gap if gap > 0 else 0.0,
            "max_retry_after": max((a for _, a in refused if a is not None), default=None),
            "other_errors": dict(Counter(str(status) for _, done, status, _ in answers
                                         if killed < done <= success
                                         and status not in (200, 503)))}


def run(workers: int, polite: bool, args: argparse.Namespace, bar: tqdm) -> dict[str, Any]:
    env = {"SHOAL_RUNTIME_SPARE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "SHOAL_TORCH_THREADS": str(args.threads)}
    drills: list[dict[str, Any]] = []
    with bench_stack(MINILM, extra_env=env, workers=workers) as stack:
        worker_pid = stack.pids[1]  # gateway, then the workers: the first is the victim
        clients = Clients(stack.url, args.clients, polite)
        threads = clients.start()
        try:
            time.sleep(args.warmup)
            for _ in range(args.drills):
                wait(lambda: clients.first_success_after(time.monotonic() - 1.0), 180,
                     "answers to flow")
                wait(lambda: spare_ready(worker_pid), 300, "a spare to finish importing")
                time.sleep(args.settle)
                children = runtime_children(worker_pid)
                assert len(children) >= 2, "no spare beside the serving runtime"
                pid, spare = children[0][1], children[1][1]
                killed = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                kill_the_replacement(worker_pid, pid, spare)
                success = wait(lambda k=killed: clients.first_success_after(k),
                               FIRST_SUCCESS_WAIT_S, "a success after the kill", interval=0.01)
                drills.append(drill_figures(clients.snapshot(), killed, success))
                bar.update(1)
        finally:
            clients.stop.set()
            for thread in threads:
                thread.join(130)
    return {"workers": workers, "clients": "polite" if polite else "naive", "drills": drills}


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(results: list[dict[str, Any]]) -> str:
    rows = []
    for result in results:
        drills = result["drills"]
        gaps = [d["gap_s"] for d in drills]
        rates = [d["refusals_per_s"] for d in drills]
        rows.append([
            "1" if result["workers"] == 1 else f"{result['workers']} (a peer)",
            result["clients"], len(drills), _s(median(gaps)), _s(max(gaps) if gaps else None),
            f"{median([d['refusals'] for d in drills]):.0f}" if drills else "-",
            f"{median(rates):.0f}" if drills else "-",
            str(max((d["max_retry_after"] or 0 for d in drills), default=0)),
            ", ".join(_s(g) for g in gaps)])
    return "\n".join(markdown.table(
        ["workers", "clients", "drills", "gap to first success, median s", "worst s",
         "refusals, median", "refusals/s, median", "largest Retry-After s", "gaps s"],
        rows, align="llrrrrrrl"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.replacement_storm",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drills", type=int, default=3, help="replacement kills per setup")
    parser.add_argument("--clients", type=int, default=4, help="closed-loop clients")
    parser.add_argument("--modes", default="polite,naive",
                        help="client modes: polite (honour Retry-After), naive (at once)")
    parser.add_argument("--workers", default="1,2",
                        help="workers per stack: 1, and 2 (a peer beside the victim)")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of load first")
    parser.add_argument("--settle", type=float, default=1.0,
                        help="seconds of steady load before each drill")
    parser.add_argument("--threads", type=int, default=0,
                        help="SHOAL_TORCH_THREADS of the workers (0: torch's default)")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    counts = [int(w) for w in args.workers.split(",") if w.strip()]
    if not set(modes) <= {"polite", "naive"}:
        raise SystemExit(f"--modes takes polite and naive, not {args.modes}")
    results = []
    with tqdm(total=args.drills * len(modes) * len(counts), desc="drills",
              file=sys.stderr) as bar:
        for workers in counts:
            for mode in modes:
                results.append(run(workers, mode == "polite", args, bar))
    command = "python -m bench.replacement_storm " + " ".join(
        argv if argv is not None else sys.argv[1:])
    return emit(f"`{command}`\n\n{table(results)}", {"args": vars(args), "results": results},
                args.json)


if __name__ == "__main__":
    sys.exit(main())
