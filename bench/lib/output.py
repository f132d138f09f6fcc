"""Where a benchmark's results go: its table on stdout, everything as JSON if asked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(table: str, data: Any, json_path: Path | None) -> int:
    """Print the markdown table; write `data` to `json_path` (its folder made if need be)
    when given. Returns 0 (the exit status of a benchmark that ran)."""
    print(table)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return 0
