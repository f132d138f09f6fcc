"""bench.peers' pure logic: arguments, run order, medians and ratios, the table.

No server is started (CI has no .venv-peers) and nothing is timed.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path
from typing import Any

import pytest

from app.tuning.stats import median, ratio
from bench import peers, peers_report, peers_servers
from bench.lib.args import parse_levels


def _run(server: str, clients: int, rnd: int, req_per_s: float, p50: float | None = 10.0,
         p99: float | None = 20.0, cpu: float | None = 5.0, errors: int = 0) -> dict[str, Any]:
    return {"server": server, "clients": clients, "round": rnd, "req_per_s": req_per_s,
            "p50_ms": p50, "p99_ms": p99, "errors": errors, "dropped": 0,
            "cpu_ms_per_request": {} if cpu is None else {"gateway (1)": cpu, "total": cpu}}


def test_parse_levels() -> None:
    assert parse_levels("1,8,32") == [1, 8, 32]
    assert parse_levels("4") == [4]
    assert parse_levels("1, 8,") == [1, 8]
    for bad in ("", "0,8", "a,b", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_levels(bad)


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
    plan = peers_report.schedule(2, [1, 8])
    assert plan == [(0, 1, "shoal"), (0, 1, "infinity"), (0, 8, "shoal"), (0, 8, "infinity"),
                    (1, 1, "infinity"), (1, 1, "shoal"), (1, 8, "infinity"), (1, 8, "shoal")]


def test_median_and_ratio_skip_missing_values() -> None:
    assert median([3.0, None, 1.0, 2.0]) == 2.0
    assert median([None]) is None
    assert median([]) is None
    assert ratio(30.0, 20.0) == 1.5
    assert ratio(None, 20.0) is None
    assert ratio(30.0, None) is None
    assert ratio(30.0, 0.0) is None


def test_summarise_takes_medians_over_rounds_per_server_and_level() -> None:
    runs = [_run("shoal", 8, r, rate) for r, rate in enumerate([100.0, 300.0, 200.0])]
    runs += [_run("infinity", 8, r, rate, p50=5.0, cpu=None, errors=1)
             for r, rate in enumerate([80.0, 100.0, 120.0])]
    runs += [_run("shoal", 1, 0, 50.0), _run("infinity", 1, 0, 40.0)]
    one, eight = peers_report.summarise(runs)
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
    lines = peers_report.table(peers_report.summarise(runs)).splitlines()
    assert len(lines) == 4
    width = lines[0].count("|")
    assert all(line.count("|") == width for line in lines)
    assert lines[1].startswith("|---|")
    assert lines[2].startswith("| 1 | 50 | 40 | 1.25 |")
    assert "| 20.0 | - |" in lines[2]  # Infinity's p99, then no ratio without shoal's
    assert lines[3].startswith("| 32 | 400 | 200 | 2.00 |")
    assert lines[3].endswith("| 0, 2 |")


def test_infinity_command_serves_the_directory_on_cpu_without_cache() -> None:
    argv = peers_servers.infinity_argv(Path("/venv"), "/models/minilm", 1234)
    assert argv[:2] == ["/venv/bin/infinity_emb", "v2"]
    flags = dict(itertools.pairwise(argv))
    assert flags["--model-id"] == "/models/minilm"
    assert flags["--served-model-name"] == peers_report.MINILM
    assert (flags["--engine"], flags["--device"], flags["--batch-size"]) == ("torch", "cpu", "32")
    assert flags["--port"] == "1234" and flags["--host"] == "127.0.0.1"
    assert "--no-vector-disk-cache" in argv
    assert peers_report.OFFLINE_ENV["DO_NOT_TRACK"] == "1"
    assert peers_report.OFFLINE_ENV["INFINITY_ANONYMOUS_USAGE_STATS"] == "0"
    assert peers_report.OFFLINE_ENV["HF_HUB_OFFLINE"] == "1"


def test_openai_body_is_the_same_for_both_servers() -> None:
    assert peers_report.openai_body(["hello"]) == {"model": peers_report.MINILM, "input": ["hello"]}


def test_missing_peer_venv_says_how_to_install(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="make bench-peers"), \
            peers_servers.infinity("/m", venv=tmp_path):
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


# --------------------------------------------------------------------------- ONNX systems


def test_schedule_rotates_any_number_of_systems() -> None:
    plan = peers_report.schedule(3, [8], peers_report.SYSTEMS[:3])
    assert [s for _, _, s in plan] == ["shoal", "shoal-onnx", "shoal-onnx-int8",
                                       "shoal-onnx", "shoal-onnx-int8", "shoal",
                                       "shoal-onnx-int8", "shoal", "shoal-onnx"]
    assert peers_report.schedule(2, [1], peers_report.SERVERS) == peers_report.schedule(2, [1])


def test_parse_systems_keeps_the_canonical_order() -> None:
    assert peers_report.parse_systems("infinity-onnx,shoal") == ["shoal", "infinity-onnx"]
    assert peers.parse_args(["--systems", "shoal,infinity"]).systems == ["shoal", "infinity"]
    assert peers.parse_args([]).systems is None
    for bad in ("", "shoal,vllm"):
        with pytest.raises(argparse.ArgumentTypeError):
            peers_report.parse_systems(bad)


def test_chosen_systems_drop_infinity_onnx_without_optimum(tmp_path: Path) -> None:
    assert "infinity-onnx" not in peers.chosen_systems(None, venv=tmp_path)
    assert peers.chosen_systems(["shoal", "infinity"], venv=tmp_path) == ["shoal", "infinity"]
    with pytest.raises(SystemExit, match="optimum"):
        peers.chosen_systems(["infinity-onnx"], venv=tmp_path)
    site = tmp_path / "lib/python3.11/site-packages/optimum/onnxruntime"
    site.mkdir(parents=True)
    (site / "modeling.py").write_text("")
    assert peers.chosen_systems(None, venv=tmp_path) == list(peers_report.SYSTEMS)


def _five(clients: int, rnd: int, scale: float) -> list[dict[str, Any]]:
    rates = {"shoal": 100.0, "shoal-onnx": 200.0, "shoal-onnx-int8": 300.0,
             "shoal-default": 200.0, "infinity": 50.0, "infinity-onnx": 150.0}
    return [_run(s, clients, rnd, rate * scale, p99=1000.0 / rate) for s, rate in rates.items()]


def test_summarise_ratios_every_shoal_system_to_every_infinity_engine() -> None:
    runs = _five(8, 0, 1.0) + _five(8, 1, 2.0) + _five(8, 2, 1.5)
    (row,) = peers_report.summarise(runs)
    assert row["shoal-onnx_req_per_s"] == 300.0 and row["infinity-onnx_req_per_s"] == 225.0
    assert row["ratio_req_per_s"] == 2.0  # shoal / Infinity, as before
    assert row["ratio_req_per_s_shoal-onnx_vs_infinity"] == 4.0
    assert row["ratio_req_per_s_shoal-onnx-int8_vs_infinity-onnx"] == 2.0
    assert row["ratio_p99_ms_shoal-onnx_vs_infinity"] == 0.25
    assert "ratio_req_per_s_infinity_vs_shoal" not in row
    assert row["shoal-onnx-int8_errors"] == 0


def test_systems_table_has_a_row_per_level_and_system() -> None:
    runs = _five(1, 0, 1.0) + _five(32, 0, 1.0)
    lines = peers_report.table(peers_report.summarise(runs), peers_report.SYSTEMS).splitlines()
    assert len(lines) == 2 + 2 * len(peers_report.SYSTEMS)
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert lines[3].startswith("| 1 | shoal ORT fp32 | 200 |")
    assert "| 4.00 | 0.25 | 1.33 |" in lines[3]  # vs Infinity torch, then vs its ORT


def test_verdicts_check_targets_at_8_and_32_clients() -> None:
    runs = _five(1, 0, 1.0) + _five(8, 0, 1.0)
    lines = peers_report.verdicts(peers_report.summarise(runs))
    assert len(lines) == 5 and all(line.startswith("8 clients") for line in lines)
    assert lines[-1].startswith("8 clients, shoal default (make run) vs Infinity: 4.00x")
    assert lines[0].endswith(": met")  # ORT fp32 4x Infinity torch, lower p99
    slow = [{**r, "req_per_s": 90.0} if r["server"] == "shoal-onnx" else r for r in runs]
    assert peers_report.verdicts(peers_report.summarise(slow))[0].endswith("NOT met")


def test_infinity_optimum_command() -> None:
    flags = dict(itertools.pairwise(peers_servers.infinity_argv(Path("/v"), ".", 1, "optimum")))
    assert (flags["--engine"], flags["--model-id"]) == ("optimum", ".")


def test_onnx_model_folder_renames_the_output_and_leaves_weights(tmp_path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["input_ids"], ["output"])], "g",
        [helper.make_tensor_value_info("input_ids", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1])])
    onnx.save(helper.make_model(graph), str(tmp_path / "g.onnx"))
    model = tmp_path / "model"
    (model / "1_Pooling").mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "model.safetensors", "1_Pooling/config.json"):
        (model / name).write_text("{}")
    out = peers_servers.onnx_model_folder(model, tmp_path / "g.onnx", tmp_path / "copy")
    assert (out / "config.json").is_file() and (out / "1_Pooling/config.json").is_file()
    assert not (out / "model.safetensors").exists()
    saved = onnx.load(str(out / "model.onnx"))
    assert [o.name for o in saved.graph.output] == ["last_hidden_state"]
    assert list(saved.graph.node[0].output) == ["last_hidden_state"]
