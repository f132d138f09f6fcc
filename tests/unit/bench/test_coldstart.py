"""The pure helpers of bench.coldstart: the engines' order, its tables, a process tree's RSS."""

from __future__ import annotations

import os
import subprocess
import sys

from bench.coldstart import tree_rss_mib
from bench.coldstart_report import e2e_table, engine_order, runtime_table


def test_engines_alternate_which_runs_first_repeat_by_repeat():
    orders = [engine_order(["pytorch", "onnx"], i) for i in range(4)]
    assert orders == [["pytorch", "onnx"], ["onnx", "pytorch"]] * 2
    assert engine_order(["onnx"], 1) == ["onnx"]


def _runtime(start: float) -> dict[str, float]:
    return {"start_ms": start, "first_load_ms": 2 * start, "first_request_ms": 10.0,
            "start_to_first_answer_ms": 3 * start + 10, "reload_ms": 100.0}


def test_the_runtime_table_gives_each_engines_median_and_their_ratio():
    table = runtime_table({"pytorch": [_runtime(s) for s in (3000, 2000, 2400)],
                           "onnx": [_runtime(s) for s in (500, 800, 600)]})
    lines = table.splitlines()
    assert lines[0] == "| in the runtime | pytorch p50 | onnx p50 | onnx / pytorch |"
    assert "| runtime start to ready (no model), ms | 2400 | 600 | 0.25 |" in lines
    assert "pytorch, each (start/first load/first request ms): 3000/6000/10, 2000/4000/10, " \
        "2400/4800/10" in lines
    # One engine: its medians, no ratio column.
    only = runtime_table({"onnx": [_runtime(600)]}).splitlines()
    assert only[0] == "| in the runtime | onnx p50 |"
    assert "| first load, fresh runtime, ms | 1200 |" in only


def test_the_e2e_table_reads_each_workers_record_and_dashes_what_is_missing():
    def worker(consuming: float, load: float | None) -> dict:
        return {"consuming_ms": consuming, "first_answer_ms": consuming + 500,
                "first": {"latency_ms": 400.0, "queue_ms": 380.0, "load_ms": load},
                "cold": {"latency_ms": 150.0, "load_ms": 100.0},
                "warm": {"latency_ms": 20.0, "inference_ms": 5.0}, "rss_mib": 300.0}

    table = e2e_table({"pytorch": [worker(4000, 2000), worker(5000, None)],
                       "onnx": [worker(1000, None)]}).splitlines()
    assert "| worker start to consuming, ms | 4500 | 1000 | 0.22 |" in table
    assert "| first request: the worker's logged load, ms | 2000 | - | - |" in table
    assert "| worker start to first answer, ms | 5000 | 1500 | 0.30 |" in table


def test_tree_rss_counts_the_children_of_a_process():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        alone = tree_rss_mib(child.pid)
        with_child = tree_rss_mib(os.getpid())
        assert alone and with_child and with_child > alone
    finally:
        child.stdin.close()
        child.wait(10)
