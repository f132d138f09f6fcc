"""Turning the API-key check on: `install_auth` adds the middleware to the app when
SHOAL_API_KEYS_FILE is set (`gateway.auth.access` says what the keys do)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def install_auth(app: Any, settings: Any) -> None:
    """Add the API-key check to `app` when SHOAL_API_KEYS_FILE is set; a file that
    cannot be used stops the gateway here, saying why. (The middleware's modules are
    imported only then: a gateway without keys does not pay for them.)"""
    path = settings.api_keys_file
    if path is None:
        return
    # Import cost, not a circle: the keys file's parser (yaml, pydantic models) and the
    # rate limiter load only in a gateway that has keys.
    from gateway.auth.key_middleware import ApiKeyMiddleware, KeySource
    from gateway.auth.rate_limit import RateLimiter

    source = KeySource(Path(path), settings.api_keys_reload_s)
    limiter = RateLimiter(settings.redis_url, settings.queue_prefix)
    app.add_middleware(ApiKeyMiddleware, source=source, limiter=limiter)
    log.info("API keys: %d from %s", len(source.ring.keys), path)
