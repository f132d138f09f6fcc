"""A worker's SIGTERM under load: what it hands back, what it finishes, what is redone.

    .venv/bin/python -m bench.drain --runs 3 --requests 240

Per run, on a private queue prefix: two workers (A and B) serve MiniLM; the
bench publishes `--requests` task messages at once (Celery protocol, `--texts`
texts each, replies to a queue of its own so every reply is seen, duplicates
included), waits until A runs batches and holds work behind them, sends A
`--signal` (TERM: the drain; QUIT: Celery's cold shutdown, for contrast), and
waits for every reply. Reported per run, and their medians:

- handed back: requests A requeued when its drain began
  (`shoal_shutdown_handed_back_total`);
- answered after the signal: A's results published while it drained
  (`shoal_shutdown_answered_total`);
- recomputed texts: texts run over both workers (`shoal_batch_items_sum`; A's
  is final once its drain began, as it starts no batch after) minus texts sent;
- duplicates and lost replies (both must be 0);
- signal → drain begun (A's log), and signal → A's exit.

A fresh A is started each run; B serves throughout, or with `--late-peer` a fresh
B starts once A exited (then A alone held the work, up to its prefetch).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import msgpack
from kombu import Connection, Producer

from app.tuning import markdown
from app.tuning.stack import Process, Stack, delete_queues, free_port, prefix_queues, queue_counts
from app.tuning.stack import wait_for as _wait_for
from app.tuning.stats import median
from bench.lib.minilm import MINILM
from bench.lib.output import emit

TEXTS_RUN = "shoal_batch_items_sum"  # texts a worker ran (requests split in parts count once)
SENTENCE = "the quick brown fox jumps over the lazy dog while a shoal of fish swims past"
WORDS = SENTENCE.split(" ")


def metric(port: int, name: str) -> float:
    import httpx

    total = 0.0
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for(condition: Any, timeout: float, what: str) -> Any:
    return _wait_for(condition, timeout, what, interval=0.02)


class Client:
    """Publishes task messages to the model queue; collects every reply."""

    def __init__(self, broker_url: str, queue: str) -> None:
        self.queue = queue
        self.reply_to = f"bench-drain-reply-{uuid.uuid4().hex}"
        self.conn = Connection(broker_url)
        self.channel = self.conn.channel()
        self.channel.queue_declare(queue=self.reply_to)
        self.replies: list[dict[str, Any]] = []

    def publish(self, n: int, texts: int) -> list[str]:
        ids = []
        producer = Producer(self.channel)
        for i in range(n):
            task_id = str(uuid.uuid4())
            items = [{"text": " ".join(WORDS[(i + k) % len(WORDS):] + WORDS) + f" {i}.{k}"}
                     for k in range(texts)]
            headers = {"task": "shoal.encode", "id": task_id, "shoal_model": MINILM,
                       "shoal_op": "encode", "shoal_items": texts, "shoal_cost": 32 * texts,
                       "shoal_longest": 32}
            producer.publish(msgpack.packb([[], {"model": MINILM, "items": items}, {}]),
                             routing_key=self.queue, exchange="", headers=headers,
                             reply_to=self.reply_to, correlation_id=task_id,
                             content_type="application/x-msgpack", content_encoding="binary",
                             delivery_mode=2)
            ids.append(task_id)
        return ids

    def collect(self) -> Counter[str]:
        while (m := self.channel.basic_get(self.reply_to, no_ack=True)) is not None:
            self.replies.append(msgpack.unpackb(m.body))
        return Counter(r["task_id"] for r in self.replies)

    def close(self) -> None:
        self.channel.queue_delete(self.reply_to)
        self.conn.close()


def start_worker(stack: Stack, name: str, queue: str, broker_url: str) -> tuple[Process, int]:
    port = free_port()
    before = queue_counts(queue, broker_url)[1] if _exists(queue, broker_url) else 0
    process = stack.worker(name, [MINILM], SHOAL_WORKER_METRICS_PORT=str(port))
    _wait_for(lambda: queue_counts(queue, broker_url)[1] > before, 180,
              f"worker {name} to consume", give_up=lambda: None if process.alive() else "exited")
    return process, port


def _exists(queue: str, broker_url: str) -> bool:
    try:
        queue_counts(queue, broker_url)
        return True
    except Exception:
        return False


def log_time(line_pattern: str, log: str) -> float | None:
    """Epoch seconds of the first log line matching `line_pattern` (Celery's format)."""
    for line in log.splitlines():
        if re.search(line_pattern, line):
            m = re.match(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})", line)
            if m:
                return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return None


def one_run(stack: Stack, run: int, queue: str, broker_url: str, b_port: int | None,
            args: argparse.Namespace) -> dict[str, Any]:
    """One run; `b_port` is the metrics port of a B serving throughout, or None: a B of
    this run starts once A was signalled (A alone held the work)."""
    a, a_port = start_worker(stack, f"drain-a{run}-{uuid.uuid4().hex[:4]}", queue, broker_url)
    late_b: Process | None = None
    b_texts_before = 0.0 if b_port is None else metric(b_port, TEXTS_RUN)
    client = Client(broker_url, queue)
    try:
        ids = client.publish(args.requests, args.texts)
        # A runs batches and holds more behind them.
        wait_for(lambda: metric(a_port, "shoal_batch_requests_count") >= args.after_batches
                 and metric(a_port, "shoal_held_messages") > 0, 120, "A to hold work")
        sig = signal.SIGTERM if args.signal == "TERM" else signal.SIGQUIT
        sent = time.time()
        os.kill(a.pid, sig)
        a_texts = handed = answered = None
        if sig == signal.SIGQUIT:
            # Celery's cold shutdown starts no batch after the signal either; its metrics
            # go soon: read them at once.
            with contextlib.suppress(Exception):
                a_texts = metric(a_port, TEXTS_RUN)
        if sig == signal.SIGTERM:
            # A starts no batch once it drains (the later parts of a split request aside,
            # and SHOAL_PART_TARGET_MS splits none here): its count is final from here on.
            wait_for(lambda: metric(a_port, "shoal_worker_draining") == 1, 30, "A to drain")
            a_texts = metric(a_port, TEXTS_RUN)
            handed = metric(a_port, "shoal_shutdown_handed_back_total")
            # Its answers count until its drain ends (then its metrics go with it): read
            # after the gauge says the drain ended, the count is final.
            while a.alive():
                try:
                    draining = metric(a_port, "shoal_worker_draining")
                    answered = metric(a_port, "shoal_shutdown_answered_total")
                except Exception:
                    break
                if draining == 0:
                    break
                time.sleep(0.01)
        a.reap(60)
        exited = time.time()
        if b_port is None:
            late_b, b_port = start_worker(stack, f"drain-b{run}-{uuid.uuid4().hex[:4]}", queue,
                                          broker_url)
        wait_for(lambda: set(client.collect()) >= set(ids), 300, "every reply")
        wait_for(lambda: queue_counts(queue, broker_url)[0] == 0, 60, "an empty queue")
        time.sleep(0.5)  # a duplicate would be published before its message's ack
        counts = client.collect()
        b_texts = metric(b_port, TEXTS_RUN) - b_texts_before
        log = a.log()
        begun = log_time(r"draining for shutdown: stopped consuming", log)
        return {
            "requests": len(ids),
            "handed_back": handed,
            "answered_after_signal": answered,
            "recomputed_texts": None if a_texts is None
            else a_texts + b_texts - len(ids) * args.texts,
            "duplicates": sum(n - 1 for n in counts.values() if n > 1),
            "lost": len(set(ids) - set(counts)),
            "drain_begun_s": None if begun is None else round(begun - sent, 3),
            "exit_s": round(exited - sent, 2),
            "exit_code": a.proc.returncode,
        }
    finally:
        client.close()
        if late_b is not None:
            late_b.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--texts", type=int, default=4, help="texts per request")
    parser.add_argument("--after-batches", type=int, default=3,
                        help="signal A once it started this many batches")
    parser.add_argument("--signal", choices=["TERM", "QUIT"], default="TERM")
    parser.add_argument("--runtime", default="pytorch", help="SHOAL_RUNTIME (pytorch, sim)")
    parser.add_argument("--late-peer", action="store_true",
                        help="start B only once A exited (A alone holds the work)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    from tasks.settings import Settings, get_settings
    from tasks.topology import queue_for

    prefix = f"shoal-bench-drain-{os.getpid()}"
    broker_url = get_settings().broker_url
    queue = queue_for(MINILM, Settings(queue_prefix=prefix)).name
    env = {**os.environ, "SHOAL_QUEUE_PREFIX": prefix, "SHOAL_RUNTIME": args.runtime,
           "SHOAL_DEVICE": "cpu", "SHOAL_WORKER_METRICS_PORT": "0",
           # No request in parts: a part started after the signal would make A's count of
           # texts run (read when its drain begins) short.
           "SHOAL_PART_TARGET_MS": "60000"}
    stack = Stack(env, Path(tempfile.mkdtemp(prefix="shoal-bench-drain-")))
    rows = []
    try:
        b_port = None if args.late_peer else start_worker(
            stack, f"drain-b-{uuid.uuid4().hex[:4]}", queue, broker_url)[1]
        for run in range(args.runs):
            row = one_run(stack, run, queue, broker_url, b_port, args)
            print(row, file=sys.stderr)
            rows.append(row)
    finally:
        stack.stop_all()
        delete_queues(prefix_queues(prefix, [MINILM]), broker_url)

    keys = ["requests", "handed_back", "answered_after_signal", "recomputed_texts", "duplicates",
            "lost", "drain_begun_s", "exit_s", "exit_code"]

    def median_of(key: str) -> Any:
        value = median(r[key] for r in rows)
        return None if value is None else round(value, 3)

    lines = [f"SIG{args.signal} of a worker under load ({args.runs} runs, {args.requests} "
             f"requests of {args.texts} texts, runtime {args.runtime}; stack logs in "
             f"{stack.log_dir})", "",
             *markdown.table(["run", *keys],
                             [*([i + 1, *(row[k] for k in keys)] for i, row in enumerate(rows)),
                              ["median", *(median_of(k) for k in keys)]],
                             align="l" * (len(keys) + 1))]
    return emit("\n".join(lines), {"args": vars(args), "runs": rows}, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
