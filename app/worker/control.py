"""Celery remote-control commands of a shoal worker.

Operators see and steer the pool with them: `celery -A app inspect shoal_models`,
`celery -A app control shoal_load MODEL`, `celery -A app control shoal_unload MODEL`;
a gateway sends `shoal_cancel` for the requests whose callers left, and Celery's own
`revoke` releases held requests too. Gateways learn the pool
from the state message each worker publishes (`tasks.pool_state`). Registered when this
module is imported (`app.worker.steps` imports it).
"""

from __future__ import annotations

from typing import Any

from celery.utils.functional import maybe_list
from celery.worker import control

from app.worker.lifecycle.view import WorkerView
from app.worker.steps.model_queues import ModelQueueConsumer


@control.inspect_command()
def active_queues(state: Any) -> list[dict]:
    """Celery's `active_queues` plus the model queues, so Flower's broker tab lists them."""
    consumer = state.consumer
    queues = list(consumer.task_consumer.queues) if consumer.task_consumer else []
    step = _step(state)
    for kombu_consumer in (step.consumers if step else None) or []:
        queues.extend(kombu_consumer.queues)
    return [dict(q.as_dict(recurse=True)) for q in queues]


def _step(state: Any) -> ModelQueueConsumer | None:
    return next((s for s in state.consumer.steps if isinstance(s, ModelQueueConsumer)), None)


@control.inspect_command()
def shoal_models(state: Any) -> dict[str, Any]:
    """Each model this worker may serve: resident, loading or cold, pinned, its bytes."""
    step = _step(state)
    if step is None or step.view is None:
        return {"error": "not consuming yet"}
    return step.view.snapshot()


def _serving(state: Any, model: str) -> tuple[WorkerView | None, dict[str, str] | None]:
    """This worker's view and None, or None and the reply that says why not."""
    step = _step(state)
    if step is None or step.view is None:
        return None, {"error": "not consuming yet"}
    if not step.view.serves(model):
        return None, {"error": f"this worker does not serve {model!r} (SHOAL_MODELS)"}
    return step.view, None


@control.control_command(args=[("model", str)], signature="<model id>")
def shoal_load(state: Any, model: str) -> dict[str, Any]:
    """Start loading a model here (warm it before traffic comes)."""
    view, refused = _serving(state, model)
    if view is None:
        return refused or {}
    why = view.load(model)
    return {"error": why} if why is not None else {"ok": f"{model} is {view.state(model)}"}


@control.control_command(args=[("model", str)], signature="<model id>")
def shoal_unload(state: Any, model: str) -> dict[str, Any]:
    """Drop a model here (not a pinned one, nor one with requests held or running)."""
    view, refused = _serving(state, model)
    if view is None:
        return refused or {}
    why = view.unload(model)
    return {"error": why} if why is not None else {"ok": f"{model} unloaded"}


@control.control_command(args=[("task_ids", list)], signature="<task id> [...]")
def shoal_cancel(state: Any, task_ids: list[str]) -> dict[str, Any]:
    """Revoke requests (a gateway sends it for the callers that hung up, in batches): held,
    they are answered CANCELLED at once; running, the runtime drops them before the device
    or stops their generation at its next token (`app.worker.lifecycle.revokes`)."""
    step = _step(state)
    if step is None or step.view is None:
        return {"error": "not consuming yet"}
    return {"ok": step.view.cancel([str(t) for t in task_ids])}


# Celery's own `revoke` (`AsyncResult.revoke()`, `celery control revoke`) marks the ids
# revoked; shoal's requests are held by its dispatcher, not Celery's pool, so the command
# is wrapped to release them there at once too, as `shoal_cancel` does.
_celery_revoke = control.Panel.data["revoke"]


@control.control_command(name="revoke", variadic="task_id",
                         signature="[id1 [id2 [... [idN]]]]")
def revoke(state: Any, task_id: Any, terminate: bool = False, signal: Any = None,
           **kwargs: Any) -> Any:
    """Celery's revoke, then the requests held here released (`shoal_cancel`)."""
    reply = _celery_revoke(state, task_id, terminate=terminate, signal=signal, **kwargs)
    ids = list(maybe_list(task_id) or ())
    step = _step(state)
    if ids and step is not None and step.view is not None:
        step.view.cancel([str(t) for t in ids])
    return reply
