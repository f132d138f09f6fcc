"""`shoal tune` end to end on a short simulated run: it sweeps, picks, and writes the profile."""

from __future__ import annotations

import shutil

import pytest

from app.cli import main
from tasks.catalog import load_entry
from tasks.settings import REPO_ROOT

pytestmark = pytest.mark.e2e
MINILM = "sentence-transformers/all-MiniLM-L6-v2"


def test_tune_writes_a_measured_profile_from_a_sim_run(tmp_path, capsys):
    catalog = tmp_path / "catalog"
    catalog.mkdir()
    shutil.copy(REPO_ROOT / "models" / "all-minilm-l6-v2.yaml", catalog / "minilm.yaml")
    code = main([
        "tune", MINILM, "--device", "sim-test", "--catalog-dir", str(catalog),
        "--env", "SHOAL_RUNTIME=sim", "--env", "SHOAL_SIM_COST_A_MS=4",
        "--env", "SHOAL_SIM_COST_B_US=20", "--env", "SHOAL_SIM_COST_C_NS=0",
        "--grid", "max_tokens=2048", "--grid", "max_items=64", "--grid", "max_delay_ms=0",
        "--grid", "hold_horizon_batches=2",
        "--max-clients", "4", "--duration", "1", "--warmup", "0.3", "--no-calibrate",
    ])
    assert code == 0
    out = capsys.readouterr().out
    assert "2 settings measured" in out  # the start, and max_tokens=2048
    profile = load_entry(catalog / "minilm.yaml").profile("sim-test")
    assert profile is not None and profile.max_tokens in (2048, 16384)
    assert profile.measured and "knee" in profile.measured
    # The other profiles and fields of the file are untouched.
    assert load_entry(catalog / "minilm.yaml").profile("cpu") is not None
