"""API keys: `Authorization: Bearer <key>` (issue 14; being built)."""

from __future__ import annotations

from typing import Any


def install_auth(app: Any, settings: Any) -> None:
    """Add the API-key check to `app` when keys are configured (none yet)."""
