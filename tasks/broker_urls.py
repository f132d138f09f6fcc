"""Several broker URLs in one setting: the nodes of a RabbitMQ cluster, tried in turn.

SHOAL_BROKER_URL (and SHOAL_MANAGEMENT_URL) take one URL, or several separated by `;`,
which is Celery's and kombu's own failover convention: `celery -A app ...`, Flower and
the worker read the same string, and one URL works unchanged. A list setting beside it
would give two ways to say the same thing, and Celery would still need the string.
"""

from __future__ import annotations

from urllib.parse import urlsplit

SEPARATOR = ";"


def split_urls(value: str) -> list[str]:
    """The URLs of a `;`-separated list, in order, blanks and empty entries dropped.

    ValueError if there is none, or one is not a URL (no scheme or no host): a typo
    should stop a process at start, not send it reconnecting to nowhere for ever."""
    urls = [part.strip() for part in value.split(SEPARATOR) if part.strip()]
    if not urls:
        raise ValueError("no URL given (one, or several separated by ';')")
    for url in urls:
        parts = urlsplit(url)
        if not parts.scheme or not parts.hostname:
            # Said without the URL itself: it may hold a password.
            raise ValueError(f"entry {urls.index(url) + 1} of {len(urls)} is not a URL "
                             "(scheme://[user:password@]host[:port]/...)")
    return urls


def celery_broker_url(value: str) -> str:
    """What Celery's `broker_url` gets: the same list, normalised (kombu splits on `;`
    itself, but keeps blanks around its parts)."""
    return SEPARATOR.join(split_urls(value))


def endpoint(url: str) -> str:
    """host:port of a URL, for logs and metric labels (never its credentials)."""
    parts = urlsplit(url)
    host = parts.hostname or "?"
    return f"{host}:{parts.port}" if parts.port else host
