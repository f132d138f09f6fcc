"""bench.gpu_check without a GPU: it says so and exits 0; its fit and its replay of a run."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

from bench import gpu_check
from bench.gpu_check_measure import Row, fit_cost


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_without_a_gpu_it_says_so_and_exits_0(capsys):
    assert gpu_check.main([]) == 0
    assert "no CUDA device found" in capsys.readouterr().out


def test_the_cost_fit_recovers_a_fixed_and_a_per_token_cost():
    points = [(tokens, 0.003 + 0.2e-6 * tokens) for tokens in (64, 512, 4096, 16_384)]
    a_ms, b_us = fit_cost(points)
    assert a_ms == pytest.approx(3.0, rel=1e-6) and b_us == pytest.approx(0.2, rel=1e-6)


def test_an_earlier_run_is_printed_and_plotted(tmp_path, capsys):
    rows = [Row(f"runtime-process, depth {depth}", "m/x", "bf16", f"{clients} clients x 1 texts",
                texts_per_s=100.0 * depth, tokens_per_s=1000.0, device_busy=0.3 * depth,
                p50_ms=5.0, p99_ms=9.0) for depth in (1, 2) for clients in (1, 32)]
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"info": {"gpu": "a test"}, "rows": [asdict(r) for r in rows],
                                 "fits": {}}))
    png = tmp_path / "plot.png"
    assert gpu_check.main(["--from-json", str(saved), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert out.count("| runtime-process, depth") == 4 and "32 clients x 1 texts" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
