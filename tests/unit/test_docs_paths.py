"""Docs that cannot drift (issue 39): every repository path and every Python name a doc
mentions must exist.

Read from the docs' text, line by line (prose, backticks, links and code blocks alike):

- a path that starts with one of the repository's top-level folders or files (`app/...`,
  `gateway/...`, `infra/...`, `Makefile`, `pyproject.toml`, ...) must exist; `*` and
  `<placeholder>` are globs that must match something, a trailing `...` means "under this
  folder". A path written `pkg/mod.Name` (a module, then a name in it) is read as the
  dotted name `pkg.mod.Name`;
- a dotted name that starts with one of the repository's Python packages (`tasks.errors`,
  `tasks.errors.ShoalError`, `app.worker.lifecycle.replies.Replier.progress`) must resolve: its
  longest prefix that is a module (a `.py` file or a package folder) exists, the next
  name is defined at the top of that module (def, class, assignment, import, `__all__`),
  and a name after a class is a member of that class (method, class attribute, dataclass
  field or `self.<name> =`). Read with `ast`, importing nothing: modules that need torch or
  SGLang are checked as well as the rest;
- a bare `Class.member` (`ModelEntry.parse`, `ModelHost.begin/forward/finish`) whose class
  is defined in the repository must name a member of it (a class defined elsewhere, such as
  sentence-transformers' `Pooling`, is not ours to check);
- a Python file named relative to a folder the doc has in mind (`feeder.py`,
  `edge/codecs.py`) must be the tail of some file in the repository;
- a relative link (`[models.md](models.md#lora-adapters)`) must point at a file, and its
  anchor at one of that file's headings;
- `make <target>` in backticks must name a target of the Makefile.

Left alone, by design: URLs, HTTP routes (`/v1/embeddings`), env vars, metric names, shell
words that name no repository path, and paths relative to some other folder
(`base/gateway.yaml` under `infra/k8s/`).
"""

from __future__ import annotations

import ast
import fnmatch
import re
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

DOCS = [
    "docs/architecture.md",
    "docs/operations.md",
    "docs/runtimes.md",
    "docs/models.md",
    "docs/clients.md",
    "README.md",
]

# The repository's Python packages: a dotted name starting with one of these is ours.
PRODUCT = ("app", "gateway", "runtimes", "batching", "tasks")
PACKAGES = (*PRODUCT, "bench", "tests")
# Top-level folders and files: a path starting with one of these is ours.
TOP_LEVEL = (*PACKAGES, "infra", "docs", "models", ".ci")
TOP_FILES = ("Makefile", "Procfile", "pyproject.toml", "README.md", "BENCHMARKS.md")

# Deliberate exceptions: (doc, mention) -> why it may name what does not exist. Keep it short.
EXCEPTIONS: dict[tuple[str, str], str] = {
    # where a wheel installs models/ (pyproject's package-dir); no such folder in a checkout
    ("docs/models.md", "tasks/models/"): "the installed catalog's path",
}

_URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_PATH = re.compile(
    r"(?<![\w./~$@-])(?:(?:" + "|".join(re.escape(t) for t in TOP_LEVEL) + r")/[\w.*<>/+-]*"
    r"|(?:" + "|".join(re.escape(f) for f in TOP_FILES) + r")(?![\w.-]))"
)
_DOTTED = re.compile(r"(?<![\w./~$@-])(?:" + "|".join(PACKAGES)
                     + r")(?:\.[A-Za-z_]\w*)+(?:/[A-Za-z_]\w*)*(?![\w-])")
# `ModelEntry.parse`, `ModelHost.begin/forward/finish`: a CamelCase class, then members.
_CLASS_MEMBER = re.compile(r"(?<![\w./~$@-])([A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*)"
                           r"\.([a-z_]\w*(?:/[a-z_]\w*)*)(?![\w-])")
_RELATIVE_PY = re.compile(r"(?<![\w./~$@<>*-])(?:[\w<>*-]+/)*[\w<>*-]+\.py(?![\w/-])")
_MAKE = re.compile(r"`make ([a-z][\w-]*)")
_FILE_SUFFIXES = {"py", "md", "yaml", "yml", "json", "jsonl", "txt", "toml", "sh", "onnx",
                  "npy", "cfg"}


@cache
def _files() -> tuple[str, ...]:
    """The repository's files, tracked or not, less what git ignores."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    return tuple(p for p in listed if (REPO / p).exists())


def _somewhere(tail: str) -> bool:
    """A Python file named relative to some folder (`feeder.py`, `edge/codecs.py`,
    `pytorch/<family>.py`) is the tail of some file of the repository."""
    pattern = "*/" + re.sub(r"<[^<>/]*>", "*", tail)
    return any(fnmatch.fnmatchcase("/" + f, pattern) for f in _files())


def _path_exists(path: str) -> bool:
    path = path.rstrip(".,;:").split("...", 1)[0]
    pattern = re.sub(r"<[^<>/]*>", "*", path).rstrip("/")
    if not any(c in pattern for c in "*?["):
        return (REPO / pattern).exists()
    return any(fnmatch.fnmatchcase(f, pattern) or fnmatch.fnmatchcase(f, pattern + "/*")
               for f in _files())


def _ignored(path: str) -> bool:
    """A path git ignores (`infra/.env`, `bench/out/`) is made at run time, not shipped."""
    return subprocess.run(["git", "check-ignore", "-q", "--no-index", path.rstrip(".,;:")],
                          cwd=REPO).returncode == 0


# --- dotted names, read with ast -------------------------------------------------------

def _module_file(dotted: str) -> Path | None:
    base = REPO.joinpath(*dotted.split("."))
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


@cache
def _make_targets() -> frozenset[str]:
    return frozenset(re.findall(r"^([a-z][\w-]*):", (REPO / "Makefile").read_text(), re.M))


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _targets(node: ast.AST) -> list[str]:
    """The names a statement at module or class level defines."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for target in node.targets for t in ast.walk(target)
                if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [(a.asname or a.name).split(".")[0] for a in node.names]
    return []


def _flat(body: list[ast.stmt]) -> list[ast.stmt]:
    """Statements of a body, with those under `if` / `try` / `with` (TYPE_CHECKING, optional
    imports) lifted up."""
    out: list[ast.stmt] = []
    for node in body:
        out.append(node)
        if isinstance(node, ast.If):
            out += _flat(node.body) + _flat(node.orelse)
        elif isinstance(node, ast.Try):
            out += _flat(node.body) + _flat(node.orelse) + _flat(node.finalbody)
            for handler in node.handlers:
                out += _flat(handler.body)
        elif isinstance(node, ast.With):
            out += _flat(node.body)
    return out


def _module_name(path: Path, name: str) -> ast.stmt | str | None:
    """What defines `name` at the top of the module at `path`: a statement, or "" for a
    name only listed in `__all__` (a lazy export)."""
    found = None
    for node in _flat(_tree(path).body):
        if name in _targets(node):
            found = node
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                return node
    if found is not None:
        return found
    for node in _tree(path).body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                  for t in node.targets)
                and isinstance(node.value, (ast.List, ast.Tuple))
                and any(isinstance(e, ast.Constant) and e.value == name for e in node.value.elts)):
            return ""
    return None


def _class_has(cls: ast.ClassDef, member: str) -> bool:
    for node in _flat(cls.body):
        if member in _targets(node):
            return True
    for node in ast.walk(cls):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name) and node.value.id == "self"
                and node.attr == member):
            return True
    return False


def _class_members_ok(path: Path, cls: ast.ClassDef, rest: list[str], depth: int = 0) -> bool:
    if not rest or _class_has(cls, rest[0]):
        return True  # what a member's value has is not read statically
    # inherited from a base class of ours (a third-party base's members are not ours)
    for base in cls.bases:
        if isinstance(base, ast.Name) and depth < 5:
            found = _class_of(path, base.id, depth + 1)
            if found and _class_members_ok(*found, rest, depth + 1):
                return True
    return False


def _class_of(path: Path, name: str, depth: int = 0) -> tuple[Path, ast.ClassDef] | None:
    """The class `name` means in the module at `path`, followed through imports of ours."""
    node = _module_name(path, name)
    if isinstance(node, ast.ClassDef):
        return path, node
    if isinstance(node, ast.ImportFrom) and depth < 5:
        alias = next(a for a in node.names if (a.asname or a.name) == name)
        source = _module_file(_absolute(path, node))
        if source is not None:
            return _class_of(source, alias.name, depth + 1)
    return None


def _absolute(path: Path, node: ast.ImportFrom) -> str:
    """The module an import statement in the module at `path` names."""
    module = node.module or ""
    if node.level:
        package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-node.level])
        module = f"{package}.{module}".strip(".") if module else package
    return module


def _resolve_in(path: Path, names: list[str], depth: int = 0) -> bool:
    node = _module_name(path, names[0])
    if node is None:
        return False
    if isinstance(node, ast.ClassDef):
        return _class_members_ok(path, node, names[1:], depth)
    if isinstance(node, ast.ImportFrom) and depth < 5:
        alias = next(a for a in node.names if (a.asname or a.name) == names[0])
        module = _absolute(path, node)
        if module.split(".")[0] in PACKAGES:
            source = _module_file(module)
            if source is not None and _module_name(source, alias.name) is not None:
                return _resolve_in(source, [alias.name, *names[1:]], depth + 1)
            if _module_file(f"{module}.{alias.name}") is not None:
                return _resolve_dotted(".".join([module, alias.name, *names[1:]]))
            return False
    return True  # a function, a value or a third-party import: its attributes are not ours


def _resolve_dotted(dotted: str) -> bool:
    parts = [p for p in dotted.split(".") if p]
    for cut in range(len(parts), 0, -1):
        source = _module_file(".".join(parts[:cut]))
        if source is not None:
            return cut == len(parts) or _resolve_in(source, parts[cut:])
    return False


def _expand_slashes(dotted: str) -> list[str]:
    """`ModelHost.begin/forward/finish` -> three names."""
    head, _, tail = dotted.partition("/")
    if not tail:
        return [dotted]
    stem = head.rsplit(".", 1)[0]
    return [head] + [f"{stem}.{t}" for t in tail.split("/")]


@cache
def _product_sources() -> tuple[tuple[Path, str], ...]:
    return tuple((REPO / name, (REPO / name).read_text()) for name in _files()
                 if name.endswith(".py") and name.split("/", 1)[0] in PRODUCT)


@cache
def _classes(name: str) -> list[tuple[Path, ast.ClassDef]]:
    """Every class of the product named `name` (only files that say `class <name>` parsed)."""
    needle = re.compile(rf"^\s*class {re.escape(name)}\b", re.M)
    return [(path, node) for path, text in _product_sources() if needle.search(text)
            for node in ast.walk(_tree(path))
            if isinstance(node, ast.ClassDef) and node.name == name]


# --- one doc ---------------------------------------------------------------------------

def _slug(heading: str) -> str:
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def _anchors(path: Path) -> frozenset[str]:
    anchors, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            anchors.add(_slug(line.lstrip("#")))
    return frozenset(anchors)


def _mentions(doc: str, text: str | None = None) -> Iterator[tuple[int, str, str, bool]]:
    """(line, kind, mention, whether it resolves) for every mention in `doc` (or in
    `text`, read as if it were `doc`)."""
    path = REPO / doc
    text = path.read_text() if text is None else text
    for line_no, raw in enumerate(text.splitlines(), 1):
        for target in _LINK.findall(raw):
            if "://" in target or target.startswith("mailto:"):
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            ok = linked.exists() and (not anchor or linked.suffix != ".md"
                                      or anchor in _anchors(linked))
            yield line_no, "link", target, ok
        for target in _MAKE.findall(raw):
            yield line_no, "make", target, target in _make_targets()
        line = _URL.sub(" ", _LINK.sub(lambda m: " " * len(m.group(0)), raw))
        line = re.sub(r"(?<=\w)'s\b", "", line)
        for match in _PATH.finditer(line):
            mention = match.group(0).rstrip(".,;:")
            ok = _path_exists(mention)
            if (not ok and mention.rpartition(".")[2] not in _FILE_SUFFIXES
                    and not set("*<") & set(mention)):
                ok = _resolve_dotted(mention.replace("/", "."))  # `pkg/mod.Name`
            yield line_no, "path", mention, ok or _ignored(mention)
        for match in _DOTTED.finditer(line):
            mention = match.group(0)
            if mention.rsplit(".", 1)[-1] in _FILE_SUFFIXES:
                continue
            for name in _expand_slashes(mention):
                yield line_no, "name", name, _resolve_dotted(name)
        for match in _CLASS_MEMBER.finditer(line):
            defined = _classes(match.group(1))
            if not defined or match.group(2) in _FILE_SUFFIXES:
                continue  # not a class of ours
            for name in _expand_slashes(match.group(0)):
                member = name.split(".", 1)[1]
                yield line_no, "member", name, any(_class_members_ok(source, cls, [member])
                                                   for source, cls in defined)
        for match in _RELATIVE_PY.finditer(line):
            if match.group(0).split("/", 1)[0] not in TOP_LEVEL:
                yield line_no, "file", match.group(0), _somewhere(match.group(0))


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_and_name_a_doc_mentions_exists(doc: str) -> None:
    mentions = list(_mentions(doc))
    problems = [f"{doc}:{line}: {kind} {mention!r}" for line, kind, mention, ok in mentions
                if not ok and (doc, mention) not in EXCEPTIONS]
    checked = len(mentions)
    assert checked, f"{doc}: no mention found; is the doc still there?"
    assert not problems, (f"{len(problems)} of {checked} mentions do not resolve:\n"
                          + "\n".join(problems))


SAMPLE = """\
Drift: `gateway/bulk.py`, gateway/bulk.InputCheck, `tasks.errors.NoSuchError`,
`batching.latency_model.CostModel.no_such_method`, `ModelEntry.no_such_member`,
`nowhere/feeder.py`, [a link](nowhere.md), [an anchor](models.md#no-such-heading), `make tset`.
Fine: `gateway/jobs/bulk_files.py`, `app/worker/`, `runtimes/pytorch/<family>.py`,
`infra/k8s/...`, `tests/tiny_*.py`, `tasks/envelope.coalesce`, `tasks.errors.ShoalError`,
`batching.latency_model.CostModel.admission`, `runtimes.sglang.SGLangRuntime`,
`app.worker.lifecycle.replies.Replier.progress`, `ModelHost.begin/forward/finish`, `feeder.py`,
`python -m bench.lone`, `bench/out/`, [models](models.md#lora-adapters), `make test`.
Not ours: `x-should-retry`, e.g. `/v1/embeddings`, make sure, `SHOAL_RUNTIME=onnx`,
`base/gateway.yaml`, https://github.com/o/r/blob/main/tasks/nope.py, `Pooling.include_prompt`,
`tasks`, an app.
"""


def test_the_check_sees_drift_and_nothing_else() -> None:
    """The resolver refuses what does not exist and leaves alone what is not a repository
    path or name (so a green run above means something)."""
    found = list(_mentions("docs/sample.md", SAMPLE))
    unresolved = [(line, mention) for line, _, mention, ok in found if not ok]
    assert unresolved == [
        (1, "gateway/bulk.py"), (1, "gateway/bulk.InputCheck"), (1, "tasks.errors.NoSuchError"),
        (2, "batching.latency_model.CostModel.no_such_method"), (2, "ModelEntry.no_such_member"),
        (3, "nowhere.md"), (3, "models.md#no-such-heading"), (3, "tset"), (3, "nowhere/feeder.py"),
    ]
    assert all(line <= 8 for line, *_ in found)  # nothing from "Not ours" on


