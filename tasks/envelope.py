"""The task message: Celery protocol v2 with shoal's annotations in headers.

Any Celery client can produce these messages and Flower understands them;
shoal's gateway builds them directly (no Celery import) and workers read the
`shoal_*` headers to schedule a message without decoding its body.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

import msgpack

from tasks.cost import Estimate
from tasks.names import OPERATION_OF_TASK, TASK_OF_OPERATION

CONTENT_TYPE = "application/x-msgpack"
CONTENT_ENCODING = "binary"

H_MODEL = "shoal_model"
H_OP = "shoal_op"
H_ITEMS = "shoal_items"
H_COST = "shoal_cost"  # estimated tokens of the whole request
H_LONGEST = "shoal_longest"  # estimated tokens of its longest item
H_DEADLINE = "shoal_deadline"  # epoch milliseconds
H_SENT = "shoal_sent"  # epoch milliseconds, when the message was published
H_LORA = "shoal_lora"
# Set by shoal gateways: "my replies may come several to a message" (see app.replies).
H_REPLY_BATCH = "shoal_reply_batch"
# On a reply message that carries {"results": [...]} instead of one result.
H_MULTI = "shoal_multi"

_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True, slots=True)
class Annotations:
    """What a worker needs to schedule a message, read from its headers."""

    model: str
    op: str
    items: int
    cost: int
    longest: int
    deadline_ms: int | None
    sent_ms: int | None
    lora: str | None = None

    def as_headers(self) -> dict[str, Any]:
        headers: dict[str, Any] = {
            H_MODEL: self.model,
            H_OP: self.op,
            H_ITEMS: self.items,
            H_COST: self.cost,
            H_LONGEST: self.longest,
        }
        if self.deadline_ms is not None:
            headers[H_DEADLINE] = self.deadline_ms
        if self.sent_ms is not None:
            headers[H_SENT] = self.sent_ms
        if self.lora:
            headers[H_LORA] = self.lora
        return headers


class EstimatingEntry(Protocol):
    """What annotating needs of a catalog entry: `app.catalog.ModelEntry` (tasks does not
    import app, which Celery clients may not have configured)."""

    @property
    def id(self) -> str: ...

    @property
    def operation(self) -> str: ...

    def estimate(self, kwargs: Any) -> Estimate: ...


def annotate(task_name: str, kwargs: Any, entry: EstimatingEntry | None,
             deadline_ms: int | None = None, sent_ms: int | None = None) -> Annotations:
    """The annotations of a request to `entry`: what a gateway, a Celery client's publish
    hook and a worker given a message without them all write, from the entry's estimate.

    The operation is the task's, not the entry's, so a task sent to a model that serves
    another is refused by the runtime as UNSUPPORTED_OPERATION. Without an entry (a model
    not in the catalog) only the model is known, and the worker answers MODEL_NOT_FOUND.
    """
    request = kwargs if isinstance(kwargs, dict) else {}
    items, cost, longest = entry.estimate(request) if entry is not None else (0, 0, 0)
    options = request.get("options")
    lora = options.get("lora") if isinstance(options, dict) else None
    return Annotations(
        model=entry.id if entry is not None else str(request.get("model", "")),
        op=OPERATION_OF_TASK.get(task_name, "unknown"),
        items=items,
        cost=cost,
        longest=longest,
        deadline_ms=deadline_ms,
        sent_ms=now_ms() if sent_ms is None else sent_ms,
        lora=lora if isinstance(lora, str) else None,
    )


def read_annotations(headers: dict[str, Any]) -> Annotations | None:
    """The annotations of a received message, or None if it carries none."""
    try:
        return Annotations(
            model=headers[H_MODEL],
            op=headers[H_OP],
            items=int(headers[H_ITEMS]),
            cost=int(headers[H_COST]),
            longest=int(headers.get(H_LONGEST, 0)),
            deadline_ms=headers.get(H_DEADLINE),
            sent_ms=headers.get(H_SENT),
            lora=headers.get(H_LORA),
        )
    except (KeyError, TypeError, ValueError):
        return None


def expires_iso(deadline_ms: int) -> str:
    return datetime.fromtimestamp(deadline_ms / 1000, tz=UTC).isoformat()


def task_headers(task_id: str, task_name: str, annotations: Annotations, origin: str) -> dict:
    """Celery protocol v2 headers plus shoal's annotations."""
    headers = {
        "lang": "py",
        "task": task_name,
        "id": task_id,
        "shadow": None,
        "eta": None,
        "expires": expires_iso(annotations.deadline_ms) if annotations.deadline_ms else None,
        "group": None,
        "group_index": None,
        "retries": 0,
        "timelimit": [None, None],
        "root_id": task_id,
        "parent_id": None,
        "argsrepr": "()",
        "kwargsrepr": f"{{'model': {annotations.model!r}, 'items': {annotations.items}}}",
        "origin": origin,
        "ignore_result": False,
    }
    headers.update(annotations.as_headers())
    return headers


def task_body(kwargs: dict[str, Any]) -> bytes:
    """Celery protocol v2 body `[args, kwargs, embed]`, msgpack-encoded."""
    return msgpack.packb([[], kwargs, _EMBED], use_bin_type=True)


@dataclass(frozen=True, slots=True)
class TaskMessage:
    task_id: str
    headers: dict[str, Any]
    body: bytes


def task_message(entry: EstimatingEntry, kwargs: dict[str, Any], origin: str,
                 timeout_ms: int, reply_batch: bool = True) -> TaskMessage:
    """The message of a request to `entry`'s operation, annotated and due in `timeout_ms`.

    `reply_batch` tells the worker the caller's reply consumer reads several results to
    a message (`gateway.broker.Broker` does; see app.replies)."""
    task_id = str(uuid.uuid4())
    sent = now_ms()
    task_name = TASK_OF_OPERATION[entry.operation]
    annotations = annotate(task_name, kwargs, entry, deadline_ms=sent + timeout_ms, sent_ms=sent)
    headers = task_headers(task_id, task_name, annotations, origin)
    if reply_batch:
        headers[H_REPLY_BATCH] = 1
    return TaskMessage(task_id, headers, task_body(kwargs))


def decode_body(body: bytes) -> dict[str, Any]:
    """The kwargs of a task body; raises ValueError on anything malformed."""
    try:
        decoded = msgpack.unpackb(body, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ValueError(f"task body is not msgpack: {exc}") from exc
    if (
        not isinstance(decoded, list | tuple)
        or len(decoded) != 3
        or not isinstance(decoded[1], dict)
    ):
        raise ValueError("task body is not a Celery protocol v2 [args, kwargs, embed] triple")
    return decoded[1]


def decode_results(body: bytes, multi: bool) -> list[dict[str, Any]]:
    """The Celery rpc results in a reply: one, or several under `results` if `multi`."""
    decoded = msgpack.unpackb(body, raw=False)
    results = decoded.get("results") if multi and isinstance(decoded, dict) else [decoded]
    if not isinstance(results, list) or not all(
        isinstance(r, dict) and "status" in r for r in results
    ):
        raise ValueError("not a Celery result message")
    return results
