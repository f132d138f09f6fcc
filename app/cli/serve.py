"""`shoal gateway` and `shoal worker`: the two processes a deployment runs."""

from __future__ import annotations

import argparse
import os
import sys


def gateway(args: argparse.Namespace) -> int:
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


def worker(args: argparse.Namespace) -> int:
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


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("gateway", help="run the HTTP gateway")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--access-log", action="store_true")
    parser.add_argument("--workers", type=_positive,
                        help="gateway processes on one port (default: SHOAL_GATEWAY_WORKERS, 1)")
    parser.set_defaults(run=gateway)

    parser = sub.add_parser("worker", help="run a Celery worker serving SHOAL_MODELS")
    parser.add_argument("--models", help="comma-separated model ids (default: SHOAL_MODELS)")
    parser.add_argument("--hostname", default="shoal@%h")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("-E", "--events", action="store_true",
                        help="send task events from the start (as SHOAL_TASK_EVENTS=true); "
                        "otherwise Flower turns them on when it starts")
    parser.set_defaults(run=worker)
