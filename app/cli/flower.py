"""`shoal flower`: Flower behind basic auth, its secrets passed in its environment.

Flower reads every option from a `FLOWER_<OPTION>` environment variable
(flower/command.py `apply_env_options`), so the basic-auth credentials and the
management API's URL (which holds RabbitMQ's password) travel there and never
on a command line, where `ps` shows them to every user of the machine.
The password is SHOAL_FLOWER_PASSWORD, or one generated on the first start
and kept in SHOAL_FLOWER_PASSWORD_FILE (mode 0600).
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path
from typing import Any

from tasks.broker_urls import split_urls


def flower_password(path: Path) -> tuple[str, bool]:
    """The password kept at `path`, made (and written 0600) if there is none yet; True
    when it was made now."""
    try:
        password = path.read_text().strip()
        if password:
            return password, False
    except FileNotFoundError:
        pass
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # URL-safe: no ',' (Flower splits FLOWER_BASIC_AUTH at commas) nor ':'.
    password = secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(password + "\n")
    return password, True


def flower_env(settings: Any, address: str, port: int) -> dict[str, str]:
    """The environment Flower runs with: basic auth on, the management API's URL."""
    env = dict(os.environ)
    if settings.flower_password is not None:
        password = settings.flower_password.get_secret_value()
    else:
        password, made = flower_password(settings.flower_password_file)
        where = settings.flower_password_file
        print(f"shoal flower: user {settings.flower_user!r}, password "
              f"{'generated into' if made else 'in'} {where}", file=sys.stderr)
    if "," in password or ":" in settings.flower_user:
        raise SystemExit("shoal flower: SHOAL_FLOWER_USER may not contain ':' nor "
                         "SHOAL_FLOWER_PASSWORD ','")
    env.update(FLOWER_BASIC_AUTH=f"{settings.flower_user}:{password}",
               # Flower takes one management API; SHOAL_MANAGEMENT_URL may list a cluster's.
               FLOWER_BROKER_API=split_urls(settings.management_url)[0],
               FLOWER_ADDRESS=address, FLOWER_PORT=str(port))
    # Basic auth covers the HTTP API as well; an unauthenticated API would be a way around.
    env.pop("FLOWER_UNAUTHENTICATED_API", None)
    return env


def run(args: argparse.Namespace) -> int:
    from tasks.settings import get_settings

    settings = get_settings()
    env = flower_env(settings, args.address, args.port)
    argv = [sys.executable, "-m", "celery", "-A", "app", "flower"]
    os.execve(sys.executable, argv, env)  # Flower takes this process over


def add_parser(sub: argparse._SubParsersAction) -> None:
    flower = sub.add_parser("flower", help="run Flower behind basic auth (SHOAL_FLOWER_*)")
    flower.add_argument("--address", default="127.0.0.1")
    flower.add_argument("--port", type=int, default=5555)
    flower.set_defaults(run=run)
