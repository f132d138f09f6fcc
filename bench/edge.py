"""What the HTTP edge's limits cost: uvicorn's plain httptools protocol against
`gateway.edge.EdgeProtocol`, side by side on one stack, in alternating rounds.

    .venv/bin/python -m bench.edge --rounds 5 --duration 5 --clients 8

One worker serves MiniLM; two gateway processes on the same queue prefix differ
only in their HTTP protocol (plain: `uvicorn.run(..., http="httptools")`, edge:
`shoal gateway`). Each round loads each gateway in turn with a closed loop of
keep-alive clients (bench.rawhttp), on two requests: GET /healthz (the HTTP path
alone, where a protocol's cost is largest relative to the rest) and
POST /v1/encode/MiniLM with one short text (a small request end to end). It
prints the medians over rounds of requests/s and the gateway's CPU per request,
and the edge/plain ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

from app.settings import DEFAULT_MODEL
from app.stack import Stack, free_port, http_status, wait_for
from bench.cpu import cpu_snapshot
from bench.rawhttp import Connection
from bench.stack import bench_stack

PLAIN = ("import uvicorn; uvicorn.run('gateway.app:create_app', factory=True, "
         "host='127.0.0.1', port={port}, loop='uvloop', http='httptools', "
         "log_level='warning')")


def _requests(model: str) -> dict[str, bytes]:
    body = json.dumps({"items": [{"text": "a short sentence to embed"}]}).encode()
    return {
        "GET /healthz": b"GET /healthz HTTP/1.1\r\nHost: bench\r\n\r\n",
        "POST /v1/encode": (f"POST /v1/encode/{model} HTTP/1.1\r\nHost: bench\r\n"
                            f"Content-Type: application/json\r\nContent-Length: {len(body)}"
                            "\r\n\r\n").encode() + body,
    }


async def _closed_loop(url: str, request: bytes, clients: int, duration: float,
                       pid: int) -> tuple[float, float]:
    """(requests/s, gateway CPU µs per request) of `clients` keep-alive connections."""
    end = time.perf_counter() + duration
    done = [0]

    async def client() -> None:
        connection = Connection(url)
        try:
            while time.perf_counter() < end:
                status, _, _ = await connection.send(request)
                if status != 200:
                    raise RuntimeError(f"HTTP {status}")
                done[0] += 1
        finally:
            await connection.close()

    before = cpu_snapshot([pid])[pid]
    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    elapsed = time.perf_counter() - started
    cpu = cpu_snapshot([pid])[pid] - before
    return done[0] / elapsed, cpu / max(done[0], 1) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.edge", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per level")
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args(argv)

    with bench_stack(args.model) as stack:
        port = free_port()
        plain_stack = Stack({**os.environ, "SHOAL_QUEUE_PREFIX": stack.prefix,
                             "SHOAL_GATEWAY_MODELS": args.model}, stack.log_dir)
        plain = plain_stack.start("plain-gateway",
                                  [sys.executable, "-c", PLAIN.format(port=port)])
        try:
            plain_url = f"http://127.0.0.1:{port}"
            wait_for(lambda: http_status(f"{plain_url}/readyz") == 200, 60,
                     "the plain gateway", give_up=plain_stack.exited)
            gateways = {"plain": (plain_url, plain.pid),
                        "edge": (stack.url, stack.gateway_pids[0] if stack.gateway_pids
                                 else stack.pids[0])}
            results: dict[tuple[str, str], list[tuple[float, float]]] = {}
            for name, request in _requests(args.model).items():
                for _ in range(args.rounds):
                    for kind, (url, pid) in gateways.items():
                        results.setdefault((name, kind), []).append(asyncio.run(
                            _closed_loop(url, request, args.clients, args.duration, pid)))
        finally:
            plain_stack.stop_all()

    print(f"{args.rounds} rounds x {args.duration:g} s, {args.clients} clients, medians")
    print(f"{'request':18} {'gateway':7} {'req/s':>8} {'cpu us/req':>11}")
    for name in _requests(args.model):
        medians = {}
        for kind in ("plain", "edge"):
            runs = results[(name, kind)]
            medians[kind] = (statistics.median(r for r, _ in runs),
                             statistics.median(c for _, c in runs))
            print(f"{name:18} {kind:7} {medians[kind][0]:8.0f} {medians[kind][1]:11.0f}")
        print(f"{name:18} {'ratio':7} {medians['edge'][0] / medians['plain'][0]:8.3f} "
              f"{medians['edge'][1] / medians['plain'][1]:11.3f}   (edge / plain)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
