"""The broker's practical limit here: a plain aio-pika publish -> consume -> reply loop.

One process, two connections: a client publishing with confirms to a model-
like queue (quorum by default, same arguments as shoal's) with `reply_to`, and
a consumer that acks each message and answers at once. N requests are kept in
flight (closed loop). No Celery, no HTTP, no model: what is left is RabbitMQ
and the AMQP client, the floor under any pipeline on this machine.

    .venv/bin/python -m bench.amqp_loop --in-flight 32 --duration 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass

import aio_pika

from tasks.settings import get_settings
from tasks.topology import model_queue

DIRECT_REPLY_TO = "amq.rabbitmq.reply-to"


@dataclass
class LoopResult:
    in_flight: int
    queue_type: str
    reply: str
    round_trips: int
    per_s: float
    p50_ms: float
    p99_ms: float


async def run_loop(in_flight: int, duration: float, warmup: float = 1.0,
                   queue_type: str = "quorum", body_bytes: int = 200,
                   reply: str = "queue") -> LoopResult:
    """`reply`: "queue" (an exclusive reply queue, as shoal's gateway) or "direct"
    (RabbitMQ's direct reply-to: no queue, consumed on the publishing channel)."""
    url = get_settings().broker_url
    name = f"shoal-amqp-loop-{uuid.uuid4().hex[:8]}"
    mq = model_queue("loop", prefix=name, max_length=100_000, delivery_limit=20,
                     queue_type=queue_type)
    server = await aio_pika.connect(url)
    client = await aio_pika.connect(url)
    try:
        server_channel = await server.channel(publisher_confirms=False)
        await server_channel.set_qos(prefetch_count=64)
        arguments = {k: v for k, v in mq.arguments.items() if not k.startswith("x-dead-letter")}
        queue = await server_channel.declare_queue(mq.name, durable=True, arguments=arguments)

        async def answer(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            await server_channel.default_exchange.publish(
                aio_pika.Message(b"ok", correlation_id=message.correlation_id),
                routing_key=message.reply_to or "")
            await message.ack()

        consumer_tag = await queue.consume(answer)
        channel = await client.channel(publisher_confirms=True)
        if reply == "direct":
            replies = await channel.get_queue(DIRECT_REPLY_TO, ensure=False)
        else:
            replies = await channel.declare_queue(exclusive=True, auto_delete=True)
        pending: dict[str, asyncio.Future] = {}

        def on_reply(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            future = pending.pop(message.correlation_id or "", None)
            if future is not None and not future.done():
                future.set_result(None)

        await replies.consume(on_reply, no_ack=True)
        body = b"x" * body_bytes
        start = time.perf_counter() + warmup
        end = start + duration
        latencies: list[float] = []

        async def one_client() -> None:
            loop = asyncio.get_running_loop()
            while time.perf_counter() < end:
                cid = uuid.uuid4().hex
                future = loop.create_future()
                pending[cid] = future
                sent = time.perf_counter()
                await channel.default_exchange.publish(
                    aio_pika.Message(body, correlation_id=cid, reply_to=replies.name,
                                     delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                    routing_key=mq.name)
                await future
                done = time.perf_counter()
                if start <= done <= end:
                    latencies.append((done - sent) * 1000)

        await asyncio.gather(*(one_client() for _ in range(in_flight)))
        await queue.cancel(consumer_tag)
        await queue.delete(if_unused=False, if_empty=False)
    finally:
        await client.close()
        await server.close()
    cuts = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else [0.0] * 99
    return LoopResult(in_flight, queue_type, reply, len(latencies), len(latencies) / duration,
                      cuts[49], cuts[98])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.amqp_loop", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in-flight", type=int, default=32)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--queue-type", choices=["quorum", "classic"], default="quorum")
    parser.add_argument("--reply", choices=["queue", "direct"], default="queue",
                        help="replies through an exclusive queue or direct reply-to")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = asyncio.run(run_loop(args.in_flight, args.duration, queue_type=args.queue_type,
                                  reply=args.reply))
    print(json.dumps(asdict(result)) if args.json else
          f"{result.per_s:.0f} round trips/s ({result.queue_type} queue, replies by "
          f"{result.reply}, {result.in_flight} in flight), p50 {result.p50_ms:.2f} ms, "
          f"p99 {result.p99_ms:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
