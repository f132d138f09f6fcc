"""The Celery app every process shares: clients send with it, workers consume with it.

A worker gets its consumer class (`worker_consumer`) and its model-queue consumer from
app/celery.py (`celery -A app worker` finds it there); importing this module loads no
worker code.

msgpack and JSON only (never pickle), the rpc result backend (results go to
the caller's `reply_to`), publisher confirms for clients (a worker confirms
its results asynchronously instead, see app.worker.lifecycle.replies), task events off unless
SHOAL_TASK_EVENTS or `-E` (Flower turns them on when it starts). shoal tasks are
routed to the queue of the model named in their kwargs.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from celery import Celery
from celery.signals import before_task_publish

from tasks.broker_urls import celery_broker_url, split_urls
from tasks.envelope import annotate, now_ms
from tasks.names import OPERATION_OF_TASK
from tasks.queues import model_kombu_queue
from tasks.settings import get_settings

if TYPE_CHECKING:
    from tasks.catalog import Catalog

log = logging.getLogger(__name__)
settings = get_settings()

_several_brokers = len(split_urls(settings.broker_url)) > 1
# Several `;`-separated URLs (a cluster's nodes) fail over in turn (tasks.broker_urls).
app = Celery("shoal", broker=celery_broker_url(settings.broker_url), backend="rpc://")
app.conf.update(
    task_serializer="msgpack",
    result_serializer="msgpack",
    accept_content=["msgpack", "json"],
    result_accept_content=["msgpack", "json"],
    # Flower reads the app's event serializer; msgpack costs the worker a fraction of JSON.
    event_serializer="msgpack",
    broker_heartbeat=settings.broker_heartbeat,
    broker_connection_retry_on_startup=True,
    # Failover: a worker never gives up on its broker (kombu's default is 100 attempts,
    # then the worker exits); it tries each URL in turn, at most
    # SHOAL_BROKER_RECONNECT_MAX_S apart (the worker's consumer class, set by app/celery.py).
    broker_failover_strategy="round-robin",
    broker_connection_max_retries=None,
    broker_connection_timeout=settings.broker_connect_timeout_s,
    # A Celery client's publish retries on the next URL: enough retries to go round.
    task_publish_retry_policy={"max_retries": 3 + len(split_urls(settings.broker_url)),
                               "interval_start": 0, "interval_step": 0.2, "interval_max": 1},
    # On a cluster (several URLs), Celery's default queue must be replicated too: a durable
    # classic queue is unavailable while its node is down, and a worker that cannot
    # declare it stops. One URL keeps it classic, as before (a queue cannot change type:
    # an existing classic `{prefix}.default` must be deleted before moving to a cluster).
    task_default_queue_type="quorum" if _several_brokers and settings.queue_type == "quorum"
    else "classic",
    # shoal's model queues are consumed by its own step; this only concerns plain Celery
    # tasks (acks_late ones are redelivered after a connection loss, not run twice at once).
    worker_cancel_long_running_tasks_on_connection_loss=True,
    broker_transport_options={"confirm_publish": True},
    # Celery's convention: task events only with -E (this setting), or once Flower or
    # `celery control enable_events` enables them; they cost the worker CPU per request.
    worker_send_task_events=settings.task_events,
    task_send_sent_event=False,
    worker_prefetch_multiplier=1,
    task_default_queue=f"{settings.queue_prefix}.default",
    result_expires=None,
    worker_hijack_root_logger=True,
)


def route_to_model_queue(
    name: str, args: Any, kwargs: Any, options: Any, task: Any = None, **_: Any
) -> dict[str, Any] | None:
    """Send shoal.* tasks to the queue of `kwargs['model']` (declared with its arguments,
    of the type its catalog entry gives it: the one the gateway and the workers declare)."""
    if name not in OPERATION_OF_TASK or not isinstance(kwargs, dict) or "model" not in kwargs:
        return None
    model = str(kwargs["model"])
    catalog = _configured_catalog()
    entry = catalog.get(model) if catalog is not None else None
    queue = model_kombu_queue(model, settings, entry.queue_type if entry is not None else None)
    return {"queue": queue, "exchange": queue.exchange, "routing_key": queue.routing_key}


app.conf.task_routes = (route_to_model_queue,)


@before_task_publish.connect
def _annotate_shoal_task(
    sender: str | None = None, body: Any = None, headers: dict | None = None,
    properties: dict | None = None, **_: Any,
) -> None:
    """Give messages from plain Celery clients the headers a gateway would write, from
    the model's catalog entry. A model the catalog does not know gets none: the worker
    answers MODEL_NOT_FOUND."""
    if sender not in OPERATION_OF_TASK or headers is None or "shoal_model" in headers:
        return
    kwargs = body[1] if isinstance(body, list | tuple) and len(body) == 3 else {}
    deadline_ms = None
    expires = headers.get("expires")
    if expires:
        from datetime import datetime

        deadline_ms = int(datetime.fromisoformat(expires).timestamp() * 1000)
        if properties is not None:
            properties["expiration"] = str(max(1, deadline_ms - now_ms()))
    model = kwargs.get("model") if isinstance(kwargs, dict) else None
    catalog = _configured_catalog()
    entry = catalog.get(model) if catalog is not None and isinstance(model, str) else None
    if entry is not None:
        headers.update(annotate(sender, kwargs, entry, deadline_ms=deadline_ms).as_headers())


def _configured_catalog() -> Catalog | None:
    """The catalog, read when a client first publishes (importing tasks.client reads no
    files) and then kept by load_catalog; None if it cannot be read, tried again next time."""
    from tasks.catalog import CatalogError, load_catalog

    try:
        return load_catalog(settings.catalog_dir)
    except CatalogError as exc:
        log.warning("a Celery task goes without shoal headers (the worker will estimate "
                    "them): %s", exc)
        return None
