"""Secrets kept out of output: passwords in URLs masked, RabbitMQ's guest kept on loopback.

`shoal settings` prints settings through `masked_settings`; the settings refuse
guest:guest for a broker or management API on another machine (`guest_off_loopback`).
"""

from __future__ import annotations

import ipaddress
from typing import Any
from urllib.parse import urlsplit, urlunsplit

MASK = "***"
# Settings that are key material or passwords whatever their form.
_SECRET_WORDS = ("password", "secret", "token")


def mask_url(url: str) -> str:
    """`url` with the password of its user info replaced by ***; several URLs separated
    by ';' (a broker's failover list) each masked. Anything unparseable is masked whole
    rather than shown."""
    return ";".join(_mask_one(part) for part in url.split(";"))


def _mask_one(url: str) -> str:
    if "@" not in url:
        return url  # no user info, nothing secret
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        userinfo = f"{parts.username or ''}:{MASK}"
        host = parts.netloc.rsplit("@", 1)[1]
        return urlunsplit(parts._replace(netloc=f"{userinfo}@{host}"))
    except ValueError:  # a port that is not a number, say
        return MASK


def masked_settings(values: dict[str, Any]) -> dict[str, Any]:
    """A settings dump (`model_dump(mode="json")`) safe to print: every `*_url` with its
    password masked, every password, secret or token replaced by ***."""
    out: dict[str, Any] = {}
    for name, value in values.items():
        if isinstance(value, str) and name.endswith("_url"):
            out[name] = mask_url(value)
        elif any(word in name for word in _SECRET_WORDS) and not name.endswith("_file"):
            out[name] = MASK if value else value  # None or "" says it is unset: keep that
        else:
            out[name] = value
    return out


def is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


def guest_off_loopback(urls: str) -> str | None:
    """The host of the first of `urls` (';'-separated) that logs in as guest:guest to a
    host other than this machine; None if there is none."""
    for url in urls.split(";"):
        try:
            parts = urlsplit(url.strip())
            host = parts.hostname or ""
        except ValueError:
            continue  # not ours to judge: the client that uses it will say what is wrong
        # No host: the client's default, this machine.
        if parts.username == "guest" and parts.password == "guest" and host \
                and not is_loopback(host):
            return host
    return None
