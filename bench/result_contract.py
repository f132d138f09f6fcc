"""What the result contract costs per one-text result, in-process (issue 54).

    .venv/bin/python -m bench.result_contract [--results 1,8,64] [--runs 300] [--json PATH]

One-text MiniLM results (384 float32 dims, `tasks.served` stamps: model, batch, worker,
timing; `--simulated` adds a sim's `simulated`) answered as one batch of `--results`
requests from one gateway, both ways:

- contract 1: every result whole (what a Celery client or an older gateway gets);
- contract 2: a gateway that sent `shoal_result_contract: 2`; the reply message carries
  the facts its results share once (`app.worker.lifecycle.replies`).

Per way: the reply message's bytes per result, the worker's time per result (stamp the
delivery, build the payload, pack the message: `Answers._succeed`'s part and the
Replier's) and the gateway's (`tasks.envelope.decode_results`, the facts put back). And
the runtime's `Outcomes` frame per result, whole against the batch's facts once
(`runtimes.child_side.pipeline.outcomes_reply`): bytes, the child's encode, the worker's
decode with the facts put back. Medians of `--runs`; on a shared machine, compare the
ways within one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from app.worker.lifecycle.replies import Delivery, Replier
from runtimes.base import Outcome
from runtimes.child_side.pipeline import outcomes_reply
from runtimes.wire import frames, protocol
from tasks.envelope import H_REPLY_BATCH, H_RESULT_CONTRACT, decode_results
from tasks.served import give_shared, stamp_batch, stamp_delivery

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
HOST = "celery@shoal-worker-1"
SIMULATED = {"device": "h100-conservative", "a_ms": 1.1, "b_us": 2.2, "c_ns": 3.3,
             "speed": 1.0}


class _Message:
    """What a Delivery reads of a delivered message."""

    def __init__(self, headers: dict[str, Any]) -> None:
        self.properties = {"reply_to": "gateway-reply"}
        self.headers = headers

    def ack(self) -> None:
        pass


class _Channel:
    def __init__(self) -> None:
        self.events: dict[str, set] = {"basic_ack": set(), "basic_nack": set()}
        self.bodies: list[bytes] = []

    def confirm_select(self) -> None:
        pass

    def basic_publish(self, message: Any, exchange: str, routing_key: str) -> None:
        self.bodies.append(message.body)


class _Connection:
    def __init__(self) -> None:
        self.opened = _Channel()

    def channel(self) -> _Channel:
        return self.opened


class _Consumer:
    hostname = HOST
    event_dispatcher = None


def _results(n: int, simulated: bool) -> list[dict[str, Any]]:
    results = [{"output": "dense", "dims": 384, "count": 1, "dtype": "float32",
                "embeddings": bytes(384 * 4), "usage": {"tokens": 9}} for _ in range(n)]
    stamp_batch(results, MODEL, [{"items": [{"text": "x"}]}] * n, time.perf_counter(),
                SIMULATED if simulated else None, device_s=0.0021)
    return results


def reply(n: int, contract: int, simulated: bool) -> tuple[float, float, int]:
    """One batch of `n` answered: worker seconds, gateway seconds, message bytes."""
    connection = _Connection()
    replier = Replier(_Consumer())
    replier.open(connection)
    headers: dict[str, Any] = {H_REPLY_BATCH: 1}
    if contract > 1:
        headers[H_RESULT_CONTRACT] = contract
    deliveries = [Delivery(_Message(headers)) for _ in range(n)]
    results = _results(n, simulated)
    started = time.perf_counter()
    replier.begin_batch()
    now = time.time()
    for i, (delivery, result) in enumerate(zip(deliveries, results, strict=True)):
        stamp_delivery(result, 0.41, None if replier.shares(delivery) else HOST,
                       now, now, now)
        replier.success(delivery, f"0123456789abcdef-{i:08d}", result, 0.01)
    replier.end_batch()
    worker = time.perf_counter() - started
    (body,) = connection.opened.bodies
    started = time.perf_counter()
    decoded = decode_results(body, True)
    gateway = time.perf_counter() - started
    assert len(decoded) == n and decoded[0]["result"]["worker"] == HOST
    return worker, gateway, len(body)


def frame(n: int, shared: bool, simulated: bool) -> tuple[float, float, int]:
    """One batch's Outcomes frame: child seconds, worker seconds, bytes."""
    outcomes = [Outcome(f"r{i}", result=r) for i, r in enumerate(_results(n, simulated))]
    started = time.perf_counter()
    reply_frame = outcomes_reply(outcomes) if shared else frames.Outcomes(
        [frames.RunOutcome(o.id, o.result, None, None, o.stats) for o in outcomes])
    payload = protocol.encode_frame(reply_frame)
    child = time.perf_counter() - started
    started = time.perf_counter()
    decoded = frames.BATCH_REPLY_DECODER.decode(memoryview(payload)[4:])
    if decoded.shared:
        give_shared((o.result for o in decoded.outcomes), decoded.shared)
    worker = time.perf_counter() - started
    return child, worker, len(payload)


def measure(sizes: list[int], runs: int, simulated: bool) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:
        for way, run in (("reply, contract 1", lambda n=n: reply(n, 1, simulated)),
                         ("reply, contract 2", lambda n=n: reply(n, 2, simulated)),
                         ("frame, whole", lambda n=n: frame(n, False, simulated)),
                         ("frame, shared", lambda n=n: frame(n, True, simulated))):
            samples = [run() for _ in range(runs)]
            rows.append({
                "way": way, "results": n,
                "bytes_per_result": samples[0][2] / n,
                "sender_us_per_result": statistics.median(s[0] for s in samples) / n * 1e6,
                "reader_us_per_result": statistics.median(s[1] for s in samples) / n * 1e6,
            })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="1,8,64", help="results per batch, comma-separated")
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--simulated", action="store_true", help="results of a sim runtime")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = measure([int(n) for n in args.results.split(",")], args.runs, args.simulated)
    print("| way | results per batch | bytes per result | sender µs per result "
          "(worker / child) | reader µs per result (gateway / worker) |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['way']} | {row['results']} | {row['bytes_per_result']:.0f} | "
              f"{row['sender_us_per_result']:.2f} | {row['reader_us_per_result']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
