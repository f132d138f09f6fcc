"""The suite keeps its own rules (issue 42): a test waits on a condition, never sleeps and
hopes; it skips only for what a machine truly lacks. Read from the tests' source, so a
new sleep or skip has to be named here with its reason, where a reviewer sees it."""

from __future__ import annotations

import ast
from collections import Counter

from tests.stack import REPO

TESTS = REPO / "tests"

# A sleep outside a polling loop is allowed only where time passing is the point.
DELIBERATE_SLEEPS = {
    ("tests/runtime/test_device_time.py", "self.seconds"): "the device work a model stands for",
    ("tests/unit/app/test_bench_cli.py", "server.delay"): "a fake peer's response time",
    ("tests/unit/bench/test_peers.py", "0"): "yields to the event loop, waits for nothing",
    ("tests/e2e/test_broker_failover.py", "OUTAGE_S"): "the outage itself",
    ("tests/e2e/test_worker_health.py", "2 * STALL_S"): "a stall detector must see time pass",
    ("tests/e2e/test_fleet_placement.py", "i * every_s"): "an open-loop load's pacing",
}

# Skips, by file: a CUDA device, root (network namespaces), tools a machine may not have.
ALLOWED_SKIPS = Counter({
    "tests/runtime/test_lazy_loading.py": 1,  # CUDA
    "tests/runtime/test_buckets.py": 1,  # CUDA
    "tests/unit/bench/test_gpu_check.py": 1,  # the CPU-only path, where a CUDA device is here
    "tests/unit/infra/test_k8s.py": 1,  # kubectl (kustomize)
    "tests/e2e/test_netns_faults.py": 1,  # root and network namespaces
    "tests/e2e/test_broker_failover.py": 1,  # a 3-node RabbitMQ cluster's packages
    "tests/e2e/test_gpu_stack_check.py": 1,  # apt tools for the GPU bundle's packages
})
SKIP_NAMES = {"skip", "skipif", "importorskip", "xfail"}


def _sources() -> list[tuple[str, ast.Module]]:
    return [(str(path.relative_to(REPO)), ast.parse(path.read_text(), str(path)))
            for path in sorted(TESTS.rglob("*.py"))]


def _parents(tree: ast.Module) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _in_loop(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while (node := parents.get(node)) is not None:
        if isinstance(node, (ast.While, ast.For, ast.AsyncFor)):
            return True
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return False
    return False


def _attribute_calls(tree: ast.Module, names: set[str]) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and node.func.attr in names]


def test_no_test_sleeps_and_hopes():
    found = []
    for path, tree in _sources():
        parents = _parents(tree)
        for call in _attribute_calls(tree, {"sleep"}):
            if _in_loop(call, parents) or not call.args:
                continue  # a poll of a condition, between its checks
            key = (path, ast.unparse(call.args[0]))
            if key not in DELIBERATE_SLEEPS:
                found.append(f"{path}:{call.lineno} sleep({key[1]})")
    assert not found, ("sleeps that hope something happened meanwhile; wait for it instead "
                       f"(tests.stack.wait_for, tests/slow_batches.py): {found}")


def _is_skip(node: ast.AST) -> bool:
    """`pytest.skip`, `pytest.importorskip`, `pytest.xfail` or `pytest.mark.skip[if]/xfail`."""
    if not isinstance(node, ast.Attribute) or node.attr not in SKIP_NAMES:
        return False
    owner = node.value
    return (isinstance(owner, ast.Name) and owner.id == "pytest") or \
        (isinstance(owner, ast.Attribute) and owner.attr == "mark")


def test_skips_only_for_what_a_machine_lacks():
    skips = Counter(path for path, tree in _sources() for node in ast.walk(tree)
                    if _is_skip(node))
    unexpected = {path: n for path, n in skips.items() if n > ALLOWED_SKIPS[path]}
    assert not unexpected, ("a skip hides a failure unless the machine truly lacks something "
                            f"(CUDA, root, a tool); fail loudly instead: {unexpected}")
