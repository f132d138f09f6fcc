"""Product code and the benchmarks stay readable (issue 39's targets, bench/ since issue 55):
no module over 400 lines, no class over 300, no import circle, TYPE_CHECKING imports
included.

Held: the product's packages app, gateway, runtimes, batching and tasks, and bench/ (a
quarter of the house, read as often; tests/ is not held). Lines are the file's lines,
docstrings and comments included; a class's run from its `class` line to its last. The
import graph is grimp's (what import-linter reads): every import statement, those under
`if TYPE_CHECKING:` and inside functions too, so a circle hidden behind a type-only import
is still a circle.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("app", "gateway", "runtimes", "batching", "tasks")
HELD = (*PRODUCT, "bench")
MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 300


def held_files() -> Iterator[Path]:
    for package in HELD:
        yield from sorted(p for p in (REPO / package).rglob("*.py")
                          if "__pycache__" not in p.parts)


def name_of(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def test_no_module_is_over_400_lines():
    over = sorted(((len(p.read_text(encoding="utf-8").splitlines()), name_of(p))
                   for p in held_files()), reverse=True)
    over = [(n, name) for n, name in over if n > MAX_MODULE_LINES]
    assert not over, (f"{len(over)} module(s) over {MAX_MODULE_LINES} lines; split "
                      "each along a seam of its own:\n"
                      + "\n".join(f"  {name}: {n} lines" for n, name in over))


def test_no_class_is_over_300_lines():
    over = []
    for path in held_files():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    over.append((lines, f"{name_of(path)}:{node.lineno} {node.name}"))
    over.sort(reverse=True)
    assert not over, (f"{len(over)} class(es) over {MAX_CLASS_LINES} lines:\n"
                      + "\n".join(f"  {where}: {n} lines" for n, where in over))


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of `graph` (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for child in edges:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def one_cycle(graph: dict[str, set[str]], members: list[str]) -> list[str]:
    """A shortest circle through the component's first module, staying inside it."""
    inside = set(members)
    start = members[0]
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph[node] & inside):
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if child not in came_from:
                came_from[child] = node
                queue.append(child)
    return [start, start]  # a module that imports itself


def import_graph() -> tuple[grimp.ImportGraph, dict[str, set[str]]]:
    # No cache: a stale one (files rewritten within its mtime resolution) would hide a change.
    imports = grimp.build_graph(*HELD, include_external_packages=False, cache_dir=None)
    return imports, {m: set(imports.find_modules_directly_imported_by(m))
                     for m in imports.modules}


def test_the_cycle_finder_finds_circles_and_only_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    components = strongly_connected(graph)
    assert sorted(c for c in components if len(c) > 1) == [["a", "b", "c"]]
    assert ["d"] in components and ["e"] in components
    assert one_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert one_cycle(graph, ["e"]) == ["e", "e"]


def test_no_import_circle():
    imports, graph = import_graph()
    circles = [c for c in strongly_connected(graph)
               if len(c) > 1 or c[0] in graph[c[0]]]
    lines = []
    for members in sorted(circles, key=len):
        path = one_cycle(graph, members)
        steps = []
        for importer, imported in pairwise(path):
            details = imports.get_import_details(importer=importer, imported=imported)
            where = ", ".join(f"l.{d['line_number']}" for d in details) or "?"
            steps.append(f"    {importer} -> {imported} ({where})")
        lines.append(f"  {len(members)} modules: {', '.join(members)}\n"
                     "  e.g.\n" + "\n".join(steps))
    assert not circles, (f"{len(circles)} import circle(s) in product code or bench/ "
                         "(TYPE_CHECKING imports count: a type-only import back is still a "
                         "circle):\n"
                         + "\n".join(lines))
