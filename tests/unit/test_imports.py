"""What a backend service and the gateway load: checked in a fresh interpreter each,
since this test session has long since imported everything."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.stack import REPO

# Prints the modules loaded and the Prometheus metrics registered by `import <module>`.
_PROBE = """
import json, sys
import {module}
metrics = []
if "prometheus_client" in sys.modules:
    from prometheus_client import REGISTRY
    metrics = [family.name for family in REGISTRY.collect()]
print(json.dumps({{"modules": sorted(sys.modules), "metrics": metrics}}))
"""


def _loaded_by(module: str) -> tuple[set[str], list[str]]:
    out = subprocess.run([sys.executable, "-c", _PROBE.format(module=module)], cwd=REPO,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    loaded = json.loads(out.splitlines()[-1])
    return set(loaded["modules"]), loaded["metrics"]


def _under(modules: set[str], roots: set[str]) -> list[str]:
    return sorted(m for m in modules if m in roots or m.split(".")[0] in roots)


def test_the_celery_client_loads_no_worker_code_and_no_worker_metrics():
    modules, metrics = _loaded_by("tasks.client")
    assert "tasks.celery_app" in modules  # the client is the Celery app's, routing included
    assert _under(modules, {"app", "batching", "runtimes"}) == []
    assert _under(modules, {"torch", "transformers", "numpy"}) == []
    assert [m for m in metrics if m.startswith("shoal")] == []


def test_the_gateway_loads_no_model_code_and_no_celery():
    modules, _ = _loaded_by("gateway.app")
    assert "gateway.app" in modules
    assert _under(modules, {"torch", "transformers", "numpy", "celery"}) == []
