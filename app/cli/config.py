"""`shoal settings` and `shoal queues`: the configuration in force, as this process reads it."""

from __future__ import annotations

import argparse
import json


def show_settings(_: argparse.Namespace) -> int:
    from tasks.redact import masked_settings
    from tasks.settings import get_settings

    # Passwords in URLs and key material as ***: this output ends up in tickets and logs.
    print(json.dumps(masked_settings(get_settings().model_dump(mode="json")), indent=2))
    return 0


def show_queues(_: argparse.Namespace) -> int:
    from tasks.catalog import load_catalog
    from tasks.settings import get_settings
    from tasks.topology import queue_for

    settings = get_settings()
    for entry in load_catalog(settings.catalog_dir).select(settings.models):
        mq = queue_for(entry.id, settings, entry.queue_type)
        print(f"{entry.id}\t{mq.name}\t{mq.dead_letter_queue}\t{mq.arguments['x-queue-type']}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("settings", help="print the settings in force").set_defaults(
        run=show_settings)
    sub.add_parser("queues", help="print each served model's queues").set_defaults(
        run=show_queues)
