"""The pure helpers of bench.lora and bench.coldstart."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from app.tuning.stats import median as p50
from bench.coldstart_report import logged_loads
from bench.lora import CASES, assign_loras, encode_body, lora_entry, schedule, summarise


def test_loras_are_drawn_uniformly_and_a_closed_loop_client_sees_them_all():
    names = [f"lora{i}" for i in range(8)]
    assigned = assign_loras(2048, names, seed=0)
    assert assigned == assign_loras(2048, names, seed=0)
    counts = Counter(assigned)
    assert set(counts) == set(names) and min(counts.values()) > 2048 / 8 * 0.8
    # Client 0 of 32 sends requests 0, 32, 64, ...: not always the same LoRA.
    assert len(set(assigned[::32])) == 8
    with pytest.raises(ValueError):
        assign_loras(1, [])


def test_bodies_and_catalog_entry():
    assert encode_body(["a", "b"], None) == {"items": [{"text": "a"}, {"text": "b"}]}
    assert encode_body(["a"], "x")["options"] == {"lora": "x"}
    entry = lora_entry({"id": "m", "adapter": "dense"}, {"x": Path("/tmp/x")})
    assert entry == {"id": "m", "adapter": "dense", "loras": {"x": {"path": "/tmp/x"}}}


def test_schedule_runs_every_case_each_round_in_a_rotating_order():
    plan = schedule(3)
    assert len(plan) == 3 * len(CASES)
    firsts = [plan[r * len(CASES)][1] for r in range(3)]
    assert len(set(firsts)) == 3  # no case always goes first
    for r in range(3):
        assert sorted(c for rr, c in plan if rr == r) == sorted(CASES)


def _run(case: str, round_: int, rps: float, p99: float) -> dict:
    return {"case": case, "round": round_, "req_per_s": rps, "items_per_s": 2 * rps,
            "p50_ms": p99 / 2, "p99_ms": p99, "median_batch_requests": 8.0,
            "cpu_ms_per_request": {"total": 10.0}, "errors": 0, "dropped": 0}


def test_ratios_are_taken_inside_each_round_then_the_median():
    runs = [_run("none", 0, 100, 200), _run("mixed", 0, 80, 250), _run("split", 0, 40, 500),
            _run("none", 1, 50, 400), _run("mixed", 1, 45, 450), _run("split", 1, 30, 600),
            _run("none", 2, 100, 200), _run("mixed", 2, 90, 220), _run("split", 2, 45, 400)]
    summary = summarise(runs)
    assert summary["cases"]["none"]["req_per_s"] == 100
    assert summary["cases"]["mixed"]["req_per_s"] == 80
    ratios = summary["ratios"]
    assert ratios["mixed_vs_none_req_per_s_rounds"] == [0.8, 0.9, 0.9]
    assert ratios["mixed_vs_none_req_per_s"] == 0.9
    assert ratios["mixed_vs_split_req_per_s"] == 2.0
    assert ratios["base_rows_vs_none_req_per_s"] is None  # no such runs


def test_worker_load_lines_are_read_for_the_model_not_its_loras():
    log = ("[x: INFO/MainProcess] loaded m (86.7 MiB) in 5.58s; 86.7 of 1 MiB in use\n"
           "runtime[1] INFO runtimes.child_side.host: loaded m (dense, 86.7 MiB) in 5.6s\n"
           "[x: INFO/MainProcess] loaded m:lora0 (0.3 MiB) in 0.02s; ...\n"
           "[x: INFO/MainProcess] loaded m (86.7 MiB) in 0.15s; 86.7 of 1 MiB in use\n")
    assert logged_loads(log, "m") == [5.58, 0.15]
    assert p50([3.0, None, 1.0, 2.0]) == 2.0 and p50([]) is None
