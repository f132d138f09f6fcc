"""bench.peers' pure logic: arguments, run order, medians and ratios, the table.

No server is started (CI has no .venv-peers) and nothing is timed.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path
from typing import Any

import pytest

from bench import peers


def _run(server: str, clients: int, rnd: int, req_per_s: float, p50: float | None = 10.0,
         p99: float | None = 20.0, cpu: float | None = 5.0, errors: int = 0) -> dict[str, Any]:
    return {"server": server, "clients": clients, "round": rnd, "req_per_s": req_per_s,
            "p50_ms": p50, "p99_ms": p99, "errors": errors, "dropped": 0,
            "cpu_ms_per_request": {} if cpu is None else {"gateway (1)": cpu, "total": cpu}}


def test_parse_levels() -> None:
    assert peers.parse_levels("1,8,32") == [1, 8, 32]
    assert peers.parse_levels("4") == [4]
    assert peers.parse_levels("1, 8,") == [1, 8]
    for bad in ("", "0,8", "a,b", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            peers.parse_levels(bad)


def test_parse_args_defaults_and_checks() -> None:
    args = peers.parse_args([])
    assert (args.clients, args.duration, args.warmup, args.rounds, args.client, args.json) == (
        [1, 8, 32], 8.0, 2.0, 3, "raw", None)
    args = peers.parse_args(["--clients", "1,8", "--duration", "3", "--rounds", "1",
                             "--client", "openai", "--json", "out.json"])
    assert (args.clients, args.duration, args.rounds, args.client, args.json) == (
        [1, 8], 3.0, 1, "openai", Path("out.json"))
    for bad in (["--rounds", "0"], ["--duration", "0"], ["--client", "grpc"],
                ["--clients", "0"]):
        with pytest.raises(SystemExit):
            peers.parse_args(bad)


def test_schedule_alternates_servers_and_swaps_order_each_round() -> None:
    plan = peers.schedule(2, [1, 8])
    assert plan == [(0, 1, "shoal"), (0, 1, "infinity"), (0, 8, "shoal"), (0, 8, "infinity"),
                    (1, 1, "infinity"), (1, 1, "shoal"), (1, 8, "infinity"), (1, 8, "shoal")]


def test_median_and_ratio_skip_missing_values() -> None:
    assert peers.median([3.0, None, 1.0, 2.0]) == 2.0
    assert peers.median([None]) is None
    assert peers.median([]) is None
    assert peers.ratio(30.0, 20.0) == 1.5
    assert peers.ratio(None, 20.0) is None
    assert peers.ratio(30.0, None) is None
    assert peers.ratio(30.0, 0.0) is None


def test_summarise_takes_medians_over_rounds_per_server_and_level() -> None:
    runs = [_run("shoal", 8, r, rate) for r, rate in enumerate([100.0, 300.0, 200.0])]
    runs += [_run("infinity", 8, r, rate, p50=5.0, cpu=None, errors=1)
             for r, rate in enumerate([80.0, 100.0, 120.0])]
    runs += [_run("shoal", 1, 0, 50.0), _run("infinity", 1, 0, 40.0)]
    one, eight = peers.summarise(runs)
    assert one["clients"] == 1 and eight["clients"] == 8
    assert eight["shoal_req_per_s"] == 200.0 and eight["infinity_req_per_s"] == 100.0
    assert eight["ratio_req_per_s"] == 2.0
    assert eight["ratio_p50_ms"] == 2.0 and eight["ratio_p99_ms"] == 1.0
    assert eight["shoal_cpu_ms_per_request"] == 5.0
    assert eight["infinity_cpu_ms_per_request"] is None
    assert eight["ratio_cpu_ms_per_request"] is None
    assert (eight["shoal_errors"], eight["infinity_errors"]) == (0, 3)
    assert one["ratio_req_per_s"] == pytest.approx(1.25)


def test_table_is_markdown_with_one_row_per_level() -> None:
    runs = [_run("shoal", 1, 0, 50.0, p99=None), _run("infinity", 1, 0, 40.0),
            _run("shoal", 32, 0, 400.0), _run("infinity", 32, 0, 200.0, errors=2)]
    lines = peers.table(peers.summarise(runs)).splitlines()
    assert len(lines) == 4
    width = lines[0].count("|")
    assert all(line.count("|") == width for line in lines)
    assert lines[1].startswith("|---|")
    assert lines[2].startswith("| 1 | 50 | 40 | 1.25 |")
    assert "| 20.0 | - |" in lines[2]  # Infinity's p99, then no ratio without shoal's
    assert lines[3].startswith("| 32 | 400 | 200 | 2.00 |")
    assert lines[3].endswith("| 0, 2 |")


def test_infinity_command_serves_the_directory_on_cpu_without_cache() -> None:
    argv = peers.infinity_argv(Path("/venv"), "/models/minilm", 1234)
    assert argv[:2] == ["/venv/bin/infinity_emb", "v2"]
    flags = dict(itertools.pairwise(argv))
    assert flags["--model-id"] == "/models/minilm"
    assert flags["--served-model-name"] == peers.MINILM
    assert (flags["--engine"], flags["--device"], flags["--batch-size"]) == ("torch", "cpu", "32")
    assert flags["--port"] == "1234" and flags["--host"] == "127.0.0.1"
    assert "--no-vector-disk-cache" in argv
    assert peers.OFFLINE_ENV["DO_NOT_TRACK"] == "1"
    assert peers.OFFLINE_ENV["INFINITY_ANONYMOUS_USAGE_STATS"] == "0"
    assert peers.OFFLINE_ENV["HF_HUB_OFFLINE"] == "1"


def test_openai_body_is_the_same_for_both_servers() -> None:
    assert peers.openai_body(["hello"]) == {"model": peers.MINILM, "input": ["hello"]}


def test_missing_peer_venv_says_how_to_install(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="make bench-peers"), peers.infinity("/m", venv=tmp_path):
        pass


def test_closed_loop_calls_counts_results_and_errors_like_the_raw_loop() -> None:
    """app.tuning.load.closed_loop_calls (the --client openai path) with an in-memory call."""
    import asyncio

    from app.tuning.load import closed_loop_calls

    seen: list[list[str]] = []

    async def call(texts: list[str]) -> object:
        seen.append(texts)
        await asyncio.sleep(0)
        if texts == ["bad"]:
            raise ConnectionError("refused")
        return None

    result = asyncio.run(closed_loop_calls(call, [["a"], ["b"], ["bad"]], 2, warmup=0.0,
                                           duration=0.05))
    assert result.mode == "closed" and result.offered == 2
    assert result.requests > 0 and result.items == result.requests
    assert result.error_kinds.get("ConnectionError", 0) > 0
    assert result.attempted >= result.errors > 0
    assert {tuple(t) for t in seen} == {("a",), ("b",), ("bad",)}
    with pytest.raises(ValueError):
        asyncio.run(closed_loop_calls(call, [["a"]], 0, warmup=0.0, duration=0.05))
