"""The `shoal` command: run the gateway or a worker, inspect settings and queues."""

from __future__ import annotations

import argparse
import json
import os
import sys

from app.cli import export, flower, jobs, keys, models


def _gateway(args: argparse.Namespace) -> int:
    """uvicorn serving `gateway.app:create_app`; with N > 1 workers, uvicorn's own supervisor
    runs N processes on one socket, each creating its app (so its own Broker and exclusive
    reply queue) after the spawn. Their Prometheus counters are summed through a fresh
    PROMETHEUS_MULTIPROC_DIR, set here before they start and removed when they have stopped."""
    import uvicorn

    from tasks.settings import get_settings

    settings = get_settings()
    workers = args.workers or settings.gateway_workers
    options = {
        "factory": True,
        "host": args.host or settings.host,
        "port": args.port or settings.port,
        "loop": "uvloop",
        # httptools with header size, read time and connection limits
        # (gateway/edge/http_protocol.py); a string, since uvicorn's supervisor pickles the
        # options for its workers.
        "http": "gateway.edge.http_protocol:EdgeProtocol",
        "timeout_keep_alive": settings.gateway_keep_alive_s,
        # SIGTERM: uvicorn waits this long for the requests in flight, then the lifespan
        # closes the broker (gateway/edge/sigterm_drain.py); a drain delay comes out of the
        # same grace.
        "timeout_graceful_shutdown": max(
            settings.shutdown_grace_s - settings.gateway_drain_delay_s, 1.0),
        "log_level": args.log_level,
        "access_log": args.access_log,
    }
    if workers == 1:  # one process, in this one: no supervisor, no metrics folder
        uvicorn.run("gateway.app:create_app", **options)
        return 0
    import shutil
    import tempfile

    # Always a fresh folder: prometheus_client sums every file in it, a stale one included.
    metrics_dir = tempfile.mkdtemp(prefix="shoal-gateway-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # inherited by the spawned workers
    try:
        uvicorn.run("gateway.app:create_app", workers=workers, **options)
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _worker(args: argparse.Namespace) -> int:
    if args.models:
        os.environ["SHOAL_MODELS"] = args.models
    argv = [
        "celery", "-A", "app", "worker",
        "--pool", "threads", "--concurrency", "1",
        "--without-gossip", "--without-mingle",
        "--loglevel", args.log_level,
        "--hostname", args.hostname,
    ]
    if args.events:  # else SHOAL_TASK_EVENTS decides (worker_send_task_events)
        argv.append("--events")
    from celery.__main__ import main as celery_main

    sys.argv = argv
    celery_main()
    return 0


def _settings(_: argparse.Namespace) -> int:
    from tasks.redact import masked_settings
    from tasks.settings import get_settings

    # Passwords in URLs and key material as ***: this output ends up in tickets and logs.
    print(json.dumps(masked_settings(get_settings().model_dump(mode="json")), indent=2))
    return 0


def _queues(_: argparse.Namespace) -> int:
    from tasks.catalog import load_catalog
    from tasks.settings import get_settings
    from tasks.topology import queue_for

    settings = get_settings()
    for entry in load_catalog(settings.catalog_dir).select(settings.models):
        mq = queue_for(entry.id, settings, entry.queue_type)
        print(f"{entry.id}\t{mq.name}\t{mq.dead_letter_queue}\t{mq.arguments['x-queue-type']}")
    return 0


def _blobs_sweep(args: argparse.Namespace) -> int:
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


def _bench(argv: list[str]) -> int:
    from app.cli.bench import main as bench_main

    return bench_main(argv)


def _tune(argv: list[str]) -> int:
    from app.cli.tune import main as tune_main

    return tune_main(argv)


def _onboard(argv: list[str]) -> int:
    from app.cli.onboard import main as onboard_main

    return onboard_main(argv)


# Commands whose arguments belong to their own parser (imported only when used).
_DELEGATED = {"bench": (_bench, "load a gateway, find the knee (app/cli/bench.py)"),
              "tune": (_tune, "tune a model's batching profile (app/cli/tune.py)"),
              "onboard": (_onboard, "a model's files to a verified, tuned catalog entry "
                          "(app/cli/onboard.py)")}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in _DELEGATED:
        return _DELEGATED[argv[0]][0](argv[1:])
    parser = argparse.ArgumentParser(prog="shoal", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gateway = sub.add_parser("gateway", help="run the HTTP gateway")
    gateway.add_argument("--host")
    gateway.add_argument("--port", type=int)
    gateway.add_argument("--log-level", default="info")
    gateway.add_argument("--access-log", action="store_true")
    gateway.add_argument("--workers", type=_positive,
                         help="gateway processes on one port (default: SHOAL_GATEWAY_WORKERS, 1)")
    gateway.set_defaults(run=_gateway)

    worker = sub.add_parser("worker", help="run a Celery worker serving SHOAL_MODELS")
    worker.add_argument("--models", help="comma-separated model ids (default: SHOAL_MODELS)")
    worker.add_argument("--hostname", default="shoal@%h")
    worker.add_argument("--log-level", default="info")
    worker.add_argument("-E", "--events", action="store_true",
                        help="send task events from the start (as SHOAL_TASK_EVENTS=true); "
                        "otherwise Flower turns them on when it starts")
    worker.set_defaults(run=_worker)

    sub.add_parser("settings", help="print the settings in force").set_defaults(run=_settings)
    sub.add_parser("queues", help="print each served model's queues").set_defaults(run=_queues)
    models.add_parser(sub)
    export.add_parser(sub)
    keys.add_parser(sub)
    flower.add_parser(sub)
    jobs.add_parsers(sub)
    blobs = sub.add_parser("blobs", help="the blob store (claim checks)")
    blobs_sub = blobs.add_subparsers(dest="blobs_command", required=True)
    sweep = blobs_sub.add_parser("sweep", help="delete orphaned claim blobs")
    sweep.add_argument("--older-than", type=float, metavar="S",
                       help="age in seconds (default: SHOAL_BLOB_TTL_S)")
    sweep.set_defaults(run=_blobs_sweep)
    for name, (_, text) in _DELEGATED.items():  # listed in --help; handled above
        sub.add_parser(name, help=text, add_help=False)

    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
