"""`shoal blobs sweep`: the blob store's orphaned claim blobs, deleted."""

from __future__ import annotations

import argparse


def sweep(args: argparse.Namespace) -> int:
    """Delete claim blobs older than --older-than (default SHOAL_BLOB_TTL_S): those of
    requests that were dead-lettered or lost. Gateways do this every
    SHOAL_BLOB_SWEEP_INTERVAL_S; this is for a cron job or a fleet without gateways."""
    from tasks.blobs import CLAIMS, blob_store
    from tasks.settings import get_settings

    settings = get_settings()
    older_than = settings.blob_ttl_s if args.older_than is None else args.older_than
    swept = blob_store(settings.blob_url).sweep(CLAIMS, older_than)
    print(f"swept {len(swept)} claim blobs older than {older_than:g} s")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    blobs = sub.add_parser("blobs", help="the blob store (claim checks)")
    actions = blobs.add_subparsers(dest="blobs_command", required=True)
    parser = actions.add_parser("sweep", help="delete orphaned claim blobs")
    parser.add_argument("--older-than", type=float, metavar="S",
                        help="age in seconds (default: SHOAL_BLOB_TTL_S)")
    parser.set_defaults(run=sweep)
