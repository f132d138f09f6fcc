"""app.tuning.load and `shoal bench` against a tiny in-test HTTP server (no shoal stack).

The server answers every POST with a fixed body and the headers the gateway
sets (X-Batch-Requests, X-Simulated), after `delay` seconds; paths under
/fail answer 503. Assertions are on counts and presence, never on speed.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from app.cli import bench as cli
from app.cli import main
from app.tuning.load import prepare, run_load
from app.tuning.mix import make_requests


@dataclass
class Server:
    url: str
    delay: float = 0.0
    simulated: bool = True
    bodies: list[dict] = field(default_factory=list)


async def _serve(server: Server, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            method, path, _ = head[0].split(" ", 2)
            length = 0
            for line in head[1:]:
                if line.lower().startswith("content-length:"):
                    length = int(line.split(":", 1)[1])
            body = await reader.readexactly(length)
            if method == "POST" and len(server.bodies) < 5:
                server.bodies.append(json.loads(body))
            if server.delay:
                await asyncio.sleep(server.delay)
            status = "503 Service Unavailable" if path.startswith("/fail") else "200 OK"
            payload = b'{"ok": true}'
            extra = "X-Batch-Requests: 3\r\n"
            if server.simulated:
                extra += "X-Simulated: h100\r\n"
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(payload)}\r\n{extra}\r\n".encode() + payload)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


@pytest.fixture
def server() -> Iterator[Server]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    state = Server(url="")

    async def start() -> asyncio.Server:
        return await asyncio.start_server(
            lambda r, w: _serve(state, r, w), "127.0.0.1", 0)

    listener = asyncio.run_coroutine_threadsafe(start(), loop).result(5)
    state.url = f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    yield state

    async def stop() -> None:
        listener.close()
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                task.cancel()

    asyncio.run_coroutine_threadsafe(stop(), loop).result(5)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def requests_for(url: str, path: str = "/v1/encode/m"):
    texts = make_requests(20, "uniform:1:4", "uniform:2:6", seed=0)
    return prepare(f"{url}{path}", texts)


def test_closed_loop(server: Server) -> None:
    prepared = requests_for(server.url)
    result = asyncio.run(run_load(f"{server.url}/v1/encode/m", prepared, "closed", 2,
                                  warmup=0.05, duration=0.3))
    assert result.mode == "closed" and result.offered == 2
    assert result.requests > 0
    assert result.items >= result.requests
    assert result.req_per_s == result.requests / 0.3
    assert result.errors == 0 and result.dropped == 0
    assert result.p50_ms is not None and result.p50_ms <= result.p99_ms  # type: ignore[operator]
    assert result.median_batch_requests == 3
    assert result.simulated and result.simulated_device == "h100"
    assert server.bodies[0]["items"][0]["text"]


def test_open_loop(server: Server) -> None:
    prepared = requests_for(server.url)
    result = asyncio.run(run_load(f"{server.url}/v1/encode/m", prepared, "open", 200,
                                  warmup=0.05, duration=0.3, seed=1))
    assert result.mode == "open" and result.offered == 200
    assert result.requests > 0
    assert result.attempted >= result.requests - 5  # completions may lag arrivals slightly
    assert result.errors == 0 and result.dropped == 0
    assert result.connections >= 1
    assert result.median_batch_requests == 3


def test_open_loop_drops_rather_than_waits(server: Server) -> None:
    # One connection and 50 ms per response: at most ~8 of the ~80 arrivals can be sent.
    server.delay = 0.05
    server.simulated = False
    prepared = requests_for(server.url)
    result = asyncio.run(run_load(f"{server.url}/v1/encode/m", prepared, "open", 200,
                                  warmup=0.0, duration=0.4, max_connections=1, seed=2))
    assert result.connections == 1
    assert result.dropped > 0
    assert result.dropped + result.errors + result.requests <= result.attempted + 1
    assert result.error_rate > 0.5
    assert not result.simulated


def test_errors_are_counted_by_kind(server: Server) -> None:
    prepared = requests_for(server.url, "/fail")
    result = asyncio.run(run_load(f"{server.url}/fail", prepared, "closed", 1,
                                  warmup=0.0, duration=0.2))
    assert result.requests == 0 and result.errors > 0
    assert set(result.error_kinds) == {"HTTP 503"}
    assert result.p99_ms is None
    assert result.point().error_rate == 1.0


def test_cli_writes_the_table_json_and_png(server: Server, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["--url", server.url, "--model", "test/m", "--op", "score", "--loads", "1,2",
            "--duration", "0.25", "--warmup", "0.05", "--mix-items", "pareto:1.2:1:8",
            "--mix-words", "uniform:2:6", "--distinct", "20", "--json", str(out_json),
            "--png", str(out_png), "--no-progress"]
    assert main(["bench", *argv]) == 0
    out = capsys.readouterr().out
    assert "SIMULATED" in out
    assert "| load | req/s | items/s |" in out
    assert "Knee: " in out
    assert server.bodies[0]["query"] == cli.DEFAULT_QUERY

    raw = json.loads(out_json.read_text())
    assert [p["offered"] for p in raw["points"]] == [1, 2]
    assert all(p["requests"] > 0 for p in raw["points"])
    assert raw["knee"]["point"]["load"] in (1, 2)
    assert raw["simulated"] is True
    assert raw["mix"]["items_spec"] == "pareto:1.2:1:8" and raw["mix"]["requests"] == 20
    assert "nproc" in raw["machine"]
    assert raw["command"].startswith("shoal bench --url")
    assert raw["endpoint"].endswith("/v1/score/test/m")
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_sweep_stops_at_the_maximum(server: Server, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "sweep.json"
    argv = ["--url", server.url, "--mode", "open", "--sweep", "--start", "50",
            "--max-load", "100", "--duration", "0.2", "--warmup", "0", "--distinct", "5",
            "--p99-factor", "1000", "--json", str(out_json), "--no-progress"]
    assert main(["bench", *argv]) == 0
    raw = json.loads(out_json.read_text())
    assert [p["offered"] for p in raw["points"]] == [50, 100]
    assert "maximum load 100" in raw["sweep_stop"]
    assert "Sweep stopped" in capsys.readouterr().out


def test_cli_refuses_bad_input(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--url", server.url, "--mix-items", "pareto:1", "--no-progress"]) == 2
    assert "bad distribution spec" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--url", server.url, "--mode", "closed", "--loads", "1.5"])
    with pytest.raises(SystemExit):
        main(["bench", "--env", "SHOAL_RUNTIME=sim"])
    # Nothing listens on port 9 of localhost: not ready, exit 2.
    assert main(["bench", "--url", "http://127.0.0.1:9", "--loads", "1", "--no-progress"]) == 2
