"""Another revision of this repository, checked out beside it, to measure against."""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """REV checked out in a temporary git worktree, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="shoal-before-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(path),
                    rev], check=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],
                       check=False)
