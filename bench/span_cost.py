"""What a span costs in one process, and what the gateway's tracing hooks cost a request.

    .venv/bin/python -m bench.span_cost [--spans 5000] [--requests 2000] [--rounds 3]

In this process, with OpenTelemetry's SDK (no exporter over the network; CPU time from
`time.process_time`, the best of `--rounds`):

- one span made and ended with a request's attributes (6), through a span processor;
- the same span encoded for OTLP (`encode_spans`, what both OTLP exporters send), per span
  in batches of 512;
- `trace.get_tracer` (why `tasks.tracing.tracer` keeps its tracer);
- the gateway's hooks around one request on a hot route (`gateway.edge.server_spans`,
  `call_span`, `publish_span`, `reply_span`, around an app that answers at once), with
  every trace sampled and with none sampled (`parentbased_traceidratio` at 0).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.tuning import markdown
from bench.lib.output import emit

ATTRIBUTES = {"shoal.model": "m", "shoal.op": "encode", "shoal.items": 1, "shoal.tokens": 10,
              "shoal.task_id": "abc", "messaging.system": "rabbitmq"}


def _cpu_us(call: Callable[[], Any], n: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.process_time()
        for _ in range(n):
            call()
        best = min(best, (time.process_time() - started) / n * 1e6)
    return best


def span_costs(n: int, rounds: int) -> dict[str, float]:
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    kept: list[Any] = []

    class Keep(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            kept.extend(spans)
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(Keep()))
    tracer = provider.get_tracer("bench")
    made = _cpu_us(lambda: tracer.start_span("x", attributes=ATTRIBUTES).end(), n, rounds)
    spans = kept[:n]

    def encode() -> None:
        for i in range(0, len(spans), 512):
            encode_spans(spans[i:i + 512]).SerializeToString()

    encoded = _cpu_us(encode, 1, rounds) / len(spans)
    trace.set_tracer_provider(provider)  # as in a traced process: the global provider's
    get_tracer = _cpu_us(lambda: trace.get_tracer("bench"), n, rounds)
    return {"span made and ended": made, "span encoded for OTLP": encoded,
            "trace.get_tracer": get_tracer}


def hooks_cost(n: int, rounds: int, ratio: float) -> float:
    """CPU µs of the gateway's hooks around one request, traces sampled at `ratio`, in a
    process of its own (OpenTelemetry takes one tracer provider per process)."""
    import subprocess

    code = f"""
import asyncio, time
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio
trace.set_tracer_provider(TracerProvider(sampler=ParentBasedTraceIdRatio({ratio})))
from gateway.edge.server_spans import ServerSpans
from gateway.edge.tracing import call_span, publish_span, reply_span
from tasks.envelope import Annotations, Part
part = Part("t", Annotations("m", "encode", 1, 10, 10, 2_000_000_000_000, 1.0), b"")
async def answer(scope, receive, send):
    call_span(part)
    confirmed = asyncio.get_running_loop().create_future()
    publish_span("m", "shoal.m", part, confirmed)
    confirmed.set_result(None)
    reply_span({{"answered_us": time.time() * 1e6 - 1000}}, time.time())
    await send({{"type": "http.response.start", "status": 200, "headers": []}})
    await send({{"type": "http.response.body", "body": b"{{}}"}})
async def plain(scope, receive, send):
    await send({{"type": "http.response.start", "status": 200, "headers": []}})
    await send({{"type": "http.response.body", "body": b"{{}}"}})
scope = {{"type": "http", "method": "POST", "path": "/v1/embeddings", "headers": [], "state": {{}}}}
async def receive(): return {{"type": "http.request", "body": b""}}
async def send(m): pass
async def cpu(app):
    best = float("inf")
    for _ in range({rounds}):
        t = time.process_time()
        for _ in range({n}):
            await app(dict(scope), receive, send)
        best = min(best, (time.process_time() - t) / {n} * 1e6)
    return best
async def main():
    print(await cpu(ServerSpans(answer)) - await cpu(plain))
asyncio.run(main())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[1])
    return float(out.stdout.strip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.span_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spans", type=int, default=5000)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    result = span_costs(args.spans, args.rounds)
    result["gateway hooks, a request, every trace sampled"] = hooks_cost(
        args.requests, args.rounds, 1.0)
    result["gateway hooks, a request, none sampled"] = hooks_cost(
        args.requests, args.rounds, 0.0)
    table = "\n".join(markdown.table(["what", "CPU µs"],
                                     [[k, f"{v:.1f}"] for k, v in result.items()], align="lr"))
    return emit(table, result, args.json)


if __name__ == "__main__":
    sys.exit(main())
