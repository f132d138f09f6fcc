"""A worker host loses its network under load, on the network-namespace fleet.

`bench.faults`' worker-link-cut scenario, small: a gateway in shoal-gw, two MiniLM
workers in shoal-w1 and shoal-w2, the broker on the bridge (infra/netns-fleet.sh).
w1's link goes down while requests flow; the broker notices the missing heartbeats,
requeues what w1 held, and w2 answers it. Nothing may be lost, no caller may get an
answer that is not for its own text, and w1 must consume and answer again once its
link is back. The other scenarios (worker kill, broker restart, a cluster node
stopped) are `make faults`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.lib.faults_fleet import netns_unavailable

_WHY_NOT = netns_unavailable()
pytestmark = pytest.mark.skipif(_WHY_NOT is not None,
                                reason=f"the namespace fleet cannot run here: {_WHY_NOT}")


def test_worker_link_cut_loses_nothing(tmp_path: Path) -> None:
    from bench.faults import parse_args, run_once

    # Heartbeat 3 s: the broker notices within ~2-3 heartbeats; the cut lasts well beyond.
    args = parse_args(["--scenario", "worker-link-cut", "--rate", "8", "--before", "6",
                       "--fault", "18", "--after", "4", "--heartbeat", "3",
                       "--json", str(tmp_path / "faults.json")])
    row = run_once(args, seed=0, log_dir=tmp_path)
    summary = {k: row.get(k) for k in ("sent", "answered", "lost", "errors", "twice",
                                        "held_by_cut", "held_answered_by_other",
                                        "answered_by_cut_while_cut", "marks", "answered_by")}
    assert row["lost"] == 0, summary
    assert row["answered"] + row["retryable"] == row["sent"], summary
    # Every answer is the embedding of its own text (checked against the model here).
    assert row["twice"] == 0, row["verify"]
    assert row["verify"]["checked"] == row["answered"], row["verify"]
    # The broker noticed, and what w1 held when its link went was answered by w2.
    assert "detected" in row["marks"], summary
    assert row["held_by_cut"] > 0, summary
    assert row["held_answered_by_other"] == row["held_by_cut"], summary
    assert row["answered_by_cut_while_cut"] == 0, summary
    # After the heal, w1 consumes again and answers requests sent after it.
    assert "rejoined" in row["marks"], summary
    assert row["answered_by_cut_after_heal"] > 0, summary
