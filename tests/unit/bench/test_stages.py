"""bench.stages on the CPU: every stage of a batch is timed, and the forward is where a
CPU spends it (the stages are real calls into the adapter, not estimates)."""

from __future__ import annotations

from bench import stages


def test_every_stage_is_timed_and_the_cpu_forward_dominates():
    timed = stages.measure("cpu", "fp32", batch=8, per_request=4, repeats=2)
    assert list(timed) == list(stages.STAGES)
    assert all(t["wall_us"] >= 0 and t["cpu_us"] >= 0 for t in timed.values())
    assert max(timed, key=lambda name: timed[name]["wall_us"]) == "forward"
    assert timed["tokenize"]["wall_us"] > 0
    table = stages.table(timed)
    assert table.count("\n| ") == len(stages.STAGES) + 1  # a row per stage and the sum
    assert "texts/s at most" in table
