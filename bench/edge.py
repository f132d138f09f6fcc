"""What the HTTP edge's limits cost: uvicorn's plain httptools protocol against
`gateway.edge.http_protocol.EdgeProtocol`, side by side on one stack, in alternating rounds.

    .venv/bin/python -m bench.edge --rounds 5 --duration 5 --clients 8

One worker serves MiniLM; two gateway processes on the same queue prefix differ
only in their HTTP protocol (plain: `uvicorn.run(..., http="httptools")`, edge:
`shoal gateway`). Each round loads each gateway in turn with a closed loop of
keep-alive clients (app.tuning.rawhttp), on two requests: GET /healthz (the HTTP path
alone, where a protocol's cost is largest relative to the rest) and
POST /v1/encode/MiniLM with one short text (a small request end to end). It
prints the medians over rounds of requests/s and the gateway's CPU per request,
and the edge/plain ratios.

    .venv/bin/python -m bench.edge --protocol-only --rounds 15

times the two protocols alone in this process (a small POST fed to each through a
transport that discards what is written, the app a no-op answering 200): the
protocol's own cost, without the noise of the network, the app and the broker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

from app.tuning.bench_stack import bench_stack
from app.tuning.cpu import cpu_snapshot
from app.tuning.rawhttp import Connection
from app.tuning.stack import Stack, free_port, http_status, wait_for
from tasks.settings import DEFAULT_MODEL

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


class _NullTransport:
    """Just enough of an asyncio transport for uvicorn's protocol."""

    def __init__(self) -> None:
        self.writes = 0
        self._closing = False

    def write(self, data: bytes) -> None:
        self.writes += 1

    def close(self) -> None:
        self._closing = True

    def is_closing(self) -> bool:
        return self._closing

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"sockname": ("127.0.0.1", 8080), "peername": ("127.0.0.1", 40000)}.get(
            name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _ok(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def _protocol_us(protocol_class: type, request: bytes, count: int) -> float:
    """CPU µs per request of `count` requests fed one read each on one connection."""
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    config = Config(_ok, lifespan="off", log_level="warning")
    config.load()
    state = ServerState()
    protocol = protocol_class(config=config, server_state=state, app_state={},
                              _loop=asyncio.get_running_loop())
    transport = _NullTransport()
    protocol.connection_made(transport)
    # CPU time, not wall time: on a shared machine other processes' turns would count.
    started = time.process_time()
    for _ in range(count):
        protocol.data_received(request)
        while state.tasks:
            await asyncio.sleep(0)
    elapsed = time.process_time() - started
    if transport.writes < count:
        raise RuntimeError(f"{transport.writes} responses for {count} requests")
    protocol.connection_lost(None)
    return elapsed / count * 1e6


def protocol_only(rounds: int, count: int = 5000) -> None:
    import uvloop
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from gateway.edge.http_protocol import EdgeLimits, EdgeProtocol
    from tasks.settings import get_settings

    EdgeProtocol.configure(EdgeLimits.from_settings(get_settings()))
    request = _requests(DEFAULT_MODEL)["POST /v1/encode"]

    async def alternate() -> dict[str, list[float]]:
        runs: dict[str, list[float]] = {"plain": [], "edge": []}
        for _ in range(rounds):
            runs["plain"].append(await _protocol_us(HttpToolsProtocol, request, count))
            runs["edge"].append(await _protocol_us(EdgeProtocol, request, count))
        return runs

    runs = uvloop.run(alternate())
    print(f"{rounds} rounds x {count} requests (a {len(request)}-byte POST), CPU µs per request")
    for name, stat in (("median", statistics.median), ("min", min)):
        plain, edge = stat(runs["plain"]), stat(runs["edge"])
        print(f"{name:6}: plain {plain:6.2f}  edge {edge:6.2f}  ratio {edge / plain:.3f}  "
              f"(+{edge - plain:.2f} µs)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.edge", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per level")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--protocol-only", action="store_true",
                        help="time the two protocols alone, in this process")
    args = parser.parse_args(argv)
    if args.protocol_only:
        protocol_only(args.rounds)
        return 0

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
