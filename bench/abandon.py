"""Callers that leave, and short deadlines, under saturation (issue 53).

    .venv/bin/python -m bench.abandon --mode abandon [--seconds 30] [--rounds 2]
    .venv/bin/python -m bench.abandon --mode deadline [--seconds 30] [--rounds 2]

Real MiniLM behind a private stack (a gateway, one worker; `app.tuning.bench_stack`) on
this machine's CPU. Every request is a raw HTTP/1.1 POST /v1/encode/{model} on a
connection of its own, so a client that gives up closes its socket as a browser or an
HTTP client with a timeout does.

`--mode abandon`: `--patient` clients (4) send `--texts`-text requests (64) in a closed
loop and wait for each answer; first alone for `--seconds`, then beside `--abandoning`
clients (8) that send the same requests and close the connection when no answer came
within `--leave-after` s (0.3). Counted: the patient clients' answers (200) and failures
in each window, and the ratio beside / alone (issue 53's target: >= 0.8); the requests
the abandoning clients left; and the requests the worker computed for nobody: its
successful results (shoal_results_total{outcome="ok"}, read from its /metrics once all it
held is settled after the window) less the answers the clients read.

`--mode deadline`: `--probes` clients (32) saturate the worker with one-text requests
with `X-Timeout-Ms: 50` (beside `--patient` clients' 64-text requests, none by default
in this mode: with them every probe is refused at once, as its batch is predicted to end
late); counted: the probes sent, answered and refused, and the requests computed after
their deadline (the worker's successes less the answers the clients read: a result the
gateway got after the caller's 504 was computed after its deadline).

Each round runs in a fresh stack. Medians over `--rounds` rounds; the machine is a shared
2-core VM, so single rounds are noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from app.tuning.bench_stack import bench_stack
from app.tuning.stack import free_port, wait_for
from bench.lib.minilm import MINILM
from bench.lib.output import emit

GATEWAY_COUNTERS = ("shoal_gateway_callers_left_total", "shoal_gateway_revoke_messages_total")


@dataclass
class Counts:
    """What one kind of client saw in one window."""

    sent: int = 0
    answered: int = 0  # 200
    failed: dict[str, int] = field(default_factory=dict)  # status (code) -> count
    left: int = 0  # closed the connection before an answer came

    def fail(self, why: str) -> None:
        self.failed[why] = self.failed.get(why, 0) + 1


async def _post(host: str, port: int, path: str, body: bytes, headers: dict[str, str],
                leave_after: float | None) -> tuple[int, bytes] | None:
    """One request on a fresh connection: (status, body), or None if it left first."""
    reader, writer = await asyncio.open_connection(host, port)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n{head}\r\n".encode() + body)
    try:
        async with asyncio.timeout(leave_after):
            status_line = await reader.readline()
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            payload = await reader.readexactly(length)
        return int(status_line.split()[1]), payload
    except TimeoutError:
        return None
    finally:
        writer.close()


def _texts(n: int, tag: str) -> list[dict[str, str]]:
    return [{"text": f"{tag} text {i}: the river runs past the old mill into the sea"}
            for i in range(n)]


async def _client(url: str, counts: Counts, texts: int, until: float, *,
                  leave_after: float | None = None, timeout_ms: int | None = None) -> None:
    host, port = url.removeprefix("http://").split(":")
    headers = {"X-Timeout-Ms": str(timeout_ms)} if timeout_ms else {}
    n = 0
    while time.monotonic() < until:
        n += 1
        body = orjson.dumps({"items": _texts(texts, f"{id(counts)}-{n}")})
        counts.sent += 1
        try:
            got = await _post(host, int(port), f"/v1/encode/{MINILM}", body, headers,
                              leave_after)
        except (OSError, asyncio.IncompleteReadError) as exc:
            counts.fail(type(exc).__name__)
            continue
        if got is None:
            counts.left += 1
        elif got[0] == 200:
            counts.answered += 1
        else:
            code = orjson.loads(got[1]).get("error", {}).get("code", "") if got[1] else ""
            counts.fail(f"{got[0]} {code}".strip())


def _metric(metrics_url: str, name: str, label: str = "") -> float:
    total = 0.0
    for line in httpx.get(metrics_url, timeout=10).text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _settled(metrics_url: str) -> bool:
    return _metric(metrics_url, "shoal_held_messages") == 0


def _window(url: str, metrics_url: str, seconds: float, args: argparse.Namespace,
            abandoning: int, probes: int) -> dict[str, Any]:
    """One window of load; the worker's work counted once what it held is settled."""
    ok_before = _metric(metrics_url, "shoal_results_total", 'outcome="ok"')
    # The gateway's hang-ups and revoke broadcasts (issue 53; 0 in an older tree).
    gateway = {name: _metric(f"{url}/metrics", name) for name in GATEWAY_COUNTERS}
    patient, leaving, probing = Counts(), Counts(), Counts()
    until = time.monotonic() + seconds

    async def run() -> None:
        clients = [_client(url, patient, args.texts, until) for _ in range(args.patient)]
        clients += [_client(url, leaving, args.texts, until, leave_after=args.leave_after)
                    for _ in range(abandoning)]
        clients += [_client(url, probing, 1, until, timeout_ms=args.probe_timeout_ms)
                    for _ in range(probes)]
        await asyncio.gather(*clients)

    asyncio.run(run())
    # What is still held runs (or is refused) after the window: it counts too.
    wait_for(lambda: _settled(metrics_url), 180, "the worker to settle", interval=0.5)
    ok = _metric(metrics_url, "shoal_results_total", 'outcome="ok"') - ok_before
    read = patient.answered + leaving.answered + probing.answered
    gateway = {name: _metric(f"{url}/metrics", name) - before
               for name, before in gateway.items()}
    return {"patient": patient.__dict__, "abandoning": leaving.__dict__,
            "probes": probing.__dict__, "worker_ok": ok, "for_nobody": ok - read,
            "gateway": gateway}


def _round(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    metrics_url = f"http://127.0.0.1:{port}/metrics"
    with bench_stack(MINILM, {"SHOAL_WORKER_METRICS_PORT": str(port)}) as stack:
        if args.mode == "abandon":
            alone = _window(stack.url, metrics_url, args.seconds, args, 0, 0)
            print(f"  alone: {alone}", flush=True)
            beside = _window(stack.url, metrics_url, args.seconds, args, args.abandoning, 0)
            print(f"  beside abandoning clients: {beside}", flush=True)
            return {"alone": alone, "beside": beside}
        probed = _window(stack.url, metrics_url, args.seconds, args, 0, args.probes)
        print(f"  {probed}", flush=True)
        return {"probed": probed}


def _median(rounds: list[dict[str, Any]], *path: str) -> float:
    values = []
    for r in rounds:
        value: Any = r
        for key in path:
            value = value[key]
        values.append(value)
    return statistics.median(values)


def _ratio(r: dict[str, Any]) -> float:
    """A round's patient answers beside the abandoning clients / alone."""
    return r["beside"]["patient"]["answered"] / max(1, r["alone"]["patient"]["answered"])


def _table(args: argparse.Namespace, rounds: list[dict[str, Any]]) -> str:
    each = lambda *path: " / ".join(f"{_median([r], *path):g}" for r in rounds)  # noqa: E731
    if args.mode == "abandon":
        alone = _median(rounds, "alone", "patient", "answered")
        beside = _median(rounds, "beside", "patient", "answered")
        rows = [
            ("patient answers alone", each("alone", "patient", "answered"), f"{alone:g}"),
            ("patient answers beside the abandoning clients",
             each("beside", "patient", "answered"), f"{beside:g}"),
            ("beside / alone", " / ".join(f"{_ratio(r):.2f}" for r in rounds),
             f"{beside / max(1.0, alone):.2f}"),
            ("patient failures beside (any status)", " / ".join(
                str(sum(r["beside"]["patient"]["failed"].values())) for r in rounds), ""),
            ("requests the abandoning clients left", each("beside", "abandoning", "left"),
             f"{_median(rounds, 'beside', 'abandoning', 'left'):g}"),
            ("requests computed for nobody", each("beside", "for_nobody"),
             f"{_median(rounds, 'beside', 'for_nobody'):g}"),
        ]
    else:
        rows = [
            ("50 ms probes sent", each("probed", "probes", "sent"),
             f"{_median(rounds, 'probed', 'probes', 'sent'):g}"),
            ("answered 200", each("probed", "probes", "answered"),
             f"{_median(rounds, 'probed', 'probes', 'answered'):g}"),
            ("computed after their deadline", each("probed", "for_nobody"),
             f"{_median(rounds, 'probed', 'for_nobody'):g}"),
            (f"background answers ({args.patient} x {args.texts} texts)",
             each("probed", "patient", "answered"),
             f"{_median(rounds, 'probed', 'patient', 'answered'):g}"),
        ]
    lines = ["| measure | rounds | median |", "|---|---:|---:|"]
    lines += [f"| {name} | {values} | {median} |" for name, values, median in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("abandon", "deadline"), default="abandon")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--patient", type=int, default=None,
                        help="patient clients (default 4; 0 with --mode deadline)")
    parser.add_argument("--abandoning", type=int, default=8)
    parser.add_argument("--texts", type=int, default=64)
    parser.add_argument("--leave-after", type=float, default=0.3)
    parser.add_argument("--probes", type=int, default=32)
    parser.add_argument("--probe-timeout-ms", type=int, default=50)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.patient is None:
        args.patient = 4 if args.mode == "abandon" else 0
    rounds = []
    for n in range(args.rounds):
        print(f"round {n + 1}/{args.rounds} ({args.mode})", flush=True)
        rounds.append(_round(args))
    return emit(_table(args, rounds), {"args": vars(args), "rounds": rounds}, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
