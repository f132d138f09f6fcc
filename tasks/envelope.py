"""The task message: Celery protocol v2 with shoal's annotations in headers.

Any Celery client can produce these messages and Flower understands them;
shoal's gateway builds them directly (no Celery import) and workers read the
`shoal_*` headers to schedule a message without decoding its body.

An image over SHOAL_CLAIM_CHECK_BYTES travels as a claim check instead of its bytes:
the item is `{"image": {"claim": {"key", "size", "sha256"}}}` (see `tasks.claims`) and
the header `shoal_claims` says how many items are claims, so a worker starts fetching
them from the blob store before it schedules the request. Everything else about the
message is unchanged; Celery clients keep sending images inline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Protocol

import msgpack

from tasks import ids
from tasks.names import OPERATION_OF_TASK, TASK_OF_OPERATION
from tasks.served import RESULT_CONTRACT, give_shared
from tasks.token_estimate import Estimate

CONTENT_TYPE = "application/x-msgpack"
CONTENT_ENCODING = "binary"
# The `status` of a Celery rpc result message: a streamed request's PROGRESS states (its
# output so far) come before its one SUCCESS or FAILURE.
SUCCESS, FAILURE, PROGRESS = "SUCCESS", "FAILURE", "PROGRESS"
# What every Celery rpc result message carries beside its task id, status and result: the
# same for all results of one reply message (sent once under "envelope", contract 2).
RPC_ENVELOPE = ("traceback", "children", "date_done")

H_MODEL = "shoal_model"
H_OP = "shoal_op"
H_ITEMS = "shoal_items"
H_COST = "shoal_cost"  # estimated tokens of the whole request
H_LONGEST = "shoal_longest"  # estimated tokens of its longest item
H_DEADLINE = "shoal_deadline"  # epoch milliseconds
# Epoch microseconds when the request was sent: an integer, because AMQP libraries write
# a Python float as a 32-bit one, far too coarse for an epoch.
H_SENT = "shoal_sent_us"
H_LORA = "shoal_lora"
# Set by shoal gateways: "my replies may come several to a message" (see
# app.worker.lifecycle.replies).
H_REPLY_BATCH = "shoal_reply_batch"
# On a reply message that carries {"results": [...]} instead of one result.
H_MULTI = "shoal_multi"
# Set by shoal gateways (new ones): the result contract their reply reader reads
# (`tasks.served.RESULT_CONTRACT`). From 2 a worker may send what a reply message's
# results share once, as {"results": [...], "shared": {...}, "envelope": {...}}
# (`decode_results` puts it back: "shared" into each successful result, "envelope",
# RPC_ENVELOPE, into each rpc result); without it (a Celery client, an older gateway)
# every result is whole.
H_RESULT_CONTRACT = "shoal_result_contract"
# On a message that carries several requests (see `coalesce`): how many.
H_COALESCED = "shoal_coalesced"
# How many of the request's binary parts are claim checks (`tasks.claims`): the worker
# fetches them from the blob store before the request is scheduled. Such a request always
# travels in a message of its own (never coalesced), so the header is its own.
H_CLAIMS = "shoal_claims"
# A bulk job's part (1): a worker runs it after the requests callers wait for.
H_BULK = "shoal_bulk"
# The request's W3C trace context (`tasks.tracing`), under the names OpenTelemetry's Celery
# instrumentation writes, so a traced Celery client's trace goes on in the worker.
H_TRACEPARENT = "traceparent"
H_TRACESTATE = "tracestate"
# A coalesced message's members' trace contexts, in member order: `[traceparent,
# tracestate]` or None each. A header, not a column of the body's rows, so that a worker
# that predates it reads the message as before (its rows keep their arity).
H_TRACES = "shoal_traces"
# Longer is no W3C trace context (traceparent is 55 characters, tracestate at most 512).
_MAX_TRACE_CHARS = 512

_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


def now_ms() -> int:
    return int(time.time() * 1000)


def sent_now_ms() -> float:
    """The time a request is sent, in epoch milliseconds to the microsecond: queue times of
    an idle stack are a fraction of a millisecond."""
    return round(time.time() * 1000, 3)


@dataclass(frozen=True, slots=True)
class Annotations:
    """What a worker needs to schedule a message, read from its headers."""

    model: str
    op: str
    items: int
    cost: int
    longest: int
    deadline_ms: int | None
    sent_ms: float | None
    lora: str | None = None
    claims: int = 0  # binary parts carried as claim checks (H_CLAIMS)
    bulk: bool = False  # a bulk job's part (H_BULK)
    traceparent: str | None = None  # its W3C trace context (H_TRACEPARENT, H_TRACES)
    tracestate: str | None = None

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
            headers[H_SENT] = round(self.sent_ms * 1000)
        if self.lora:
            headers[H_LORA] = self.lora
        if self.claims:
            headers[H_CLAIMS] = self.claims
        if self.bulk:
            headers[H_BULK] = 1
        if self.traceparent:
            headers[H_TRACEPARENT] = self.traceparent
            if self.tracestate:
                headers[H_TRACESTATE] = self.tracestate
        return headers


class EstimatingEntry(Protocol):
    """What annotating needs of a catalog entry: `tasks.catalog.ModelEntry` (tasks does not
    import app, which Celery clients may not have configured)."""

    @property
    def id(self) -> str: ...

    @property
    def operation(self) -> str: ...

    def estimate(self, kwargs: Any) -> Estimate: ...


def annotate(task_name: str, kwargs: Any, entry: EstimatingEntry | None,
             deadline_ms: int | None = None, sent_ms: float | None = None) -> Annotations:
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
        sent_ms=sent_now_ms() if sent_ms is None else sent_ms,
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
            sent_ms=None if headers.get(H_SENT) is None else int(headers[H_SENT]) / 1000,
            lora=headers.get(H_LORA),
            claims=int(headers.get(H_CLAIMS) or 0),
            bulk=bool(headers.get(H_BULK)),
            traceparent=trace_field(headers.get(H_TRACEPARENT)),
            tracestate=trace_field(headers.get(H_TRACESTATE)),
        )
    except (KeyError, TypeError, ValueError):
        return None


def trace_field(value: Any) -> str | None:
    """A trace context string as received, or None for anything that cannot be one (it is
    parsed only where tracing is on: `tasks.tracing.context_of`)."""
    return value if isinstance(value, str) and 0 < len(value) <= _MAX_TRACE_CHARS else None


def with_trace(annotations: Annotations, headers: dict[str, Any]) -> Annotations:
    """`annotations` made without the headers (a Celery client's that wrote no shoal
    annotations) with the trace context the headers carry."""
    traceparent = trace_field(headers.get(H_TRACEPARENT))
    if traceparent is None:
        return annotations
    return replace(annotations, traceparent=traceparent,
                   tracestate=trace_field(headers.get(H_TRACESTATE)))


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


def task_part(entry: EstimatingEntry, kwargs: dict[str, Any], timeout_ms: int,
              claims: int = 0, bulk: bool = False) -> Part:
    """A request to `entry`'s operation, annotated and due in `timeout_ms`, before it is
    framed: alone (`single_message`) or with others (`coalesce`). `claims`: how many of its
    binary parts are claim checks (see `tasks.claims`); `bulk`: a bulk job's part."""
    sent = sent_now_ms()
    annotations = annotate(TASK_OF_OPERATION[entry.operation], kwargs, entry,
                           deadline_ms=int(sent) + timeout_ms, sent_ms=sent)
    if claims or bulk:
        annotations = replace(annotations, claims=claims, bulk=bulk)
    return Part(ids.task_id(), annotations, task_body(kwargs))


def single_message(part: Part, origin: str, reply_batch: bool = True,
                   contract: int = RESULT_CONTRACT) -> TaskMessage:
    """A request as a message of its own: a plain Celery task message. `contract`: the
    result contract its replies may use (H_RESULT_CONTRACT; 1 says nothing)."""
    headers = task_headers(part.task_id, TASK_OF_OPERATION[part.annotations.op],
                           part.annotations, origin)
    if reply_batch:
        headers[H_REPLY_BATCH] = 1
    if contract > 1:
        headers[H_RESULT_CONTRACT] = contract
    return TaskMessage(part.task_id, headers, part.body)


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
    """The Celery rpc results in a reply: one, or several under `results` if `multi`, each
    successful result whole (what they share, sent once under `shared`, put back)."""
    decoded = msgpack.unpackb(body, raw=False)
    results = decoded.get("results") if multi and isinstance(decoded, dict) else [decoded]
    if not isinstance(results, list) or not all(
        isinstance(r, dict) and "status" in r for r in results
    ):
        raise ValueError("not a Celery result message")
    if multi and "envelope" in decoded:
        give_shared(results, decoded["envelope"], RPC_ENVELOPE)
    if multi and "shared" in decoded:
        give_shared((r.get("result") for r in results if r["status"] == SUCCESS),
                    decoded["shared"])
    return results


# --- several requests in one message (shoal gateway -> shoal worker only) ------------------

@dataclass(frozen=True, slots=True)
class Part:
    """One request carried by a coalesced message: its id, annotations and Celery body
    (kept encoded: the runtime decodes it), and how often it was returned before."""

    task_id: str
    annotations: Annotations
    body: bytes
    returns: int = 0


def coalesce(model: str, op: str, parts: list[Part], origin: str,
             reply_batch: bool = True, contract: int = RESULT_CONTRACT) -> TaskMessage:
    """One message carrying `parts` (requests of `model`, operation `op`).

    Between a shoal gateway and shoal workers only: Celery clients never see it.
    Headers: the task and the model (for routing and logs) and `shoal_coalesced`;
    the body: a msgpack list of `[task_id, items, cost, longest, deadline_ms,
    sent_ms, lora, returns, body]`, each `body` the request's own Celery body.
    Every request keeps its own id, deadline, result and Flower task.
    """
    message_id = ids.task_id()
    task_name = TASK_OF_OPERATION[op]
    deadlines = [p.annotations.deadline_ms for p in parts]
    headers: dict[str, Any] = {
        "lang": "py", "task": task_name, "id": message_id, "root_id": message_id,
        "parent_id": None, "group": None, "retries": 0, "eta": None,
        "expires": None, "timelimit": [None, None], "origin": origin,
        "argsrepr": "()", "kwargsrepr": f"{{'model': {model!r}, 'requests': {len(parts)}}}",
        H_MODEL: model, H_OP: op, H_COALESCED: len(parts),
        H_ITEMS: sum(p.annotations.items for p in parts),
        H_COST: sum(p.annotations.cost for p in parts),
        H_LONGEST: max((p.annotations.longest for p in parts), default=0),
    }
    if deadlines and None not in deadlines:
        headers[H_DEADLINE] = max(d for d in deadlines if d is not None)
    if parts and all(p.annotations.bulk for p in parts):
        headers[H_BULK] = 1  # bulk job parts together (an OpenAI batch's lines): all bulk
    if reply_batch:
        headers[H_REPLY_BATCH] = 1
    if contract > 1:
        headers[H_RESULT_CONTRACT] = contract
    if any(p.annotations.traceparent for p in parts):
        headers[H_TRACES] = [[a.traceparent, a.tracestate] if a.traceparent else None
                             for a in (p.annotations for p in parts)]
    body = msgpack.packb(
        [[p.task_id, a.items, a.cost, a.longest, a.deadline_ms, a.sent_ms, a.lora,
          p.returns, p.body] for p in parts for a in (p.annotations,)],
        use_bin_type=True)
    return TaskMessage(message_id, headers, body)


def read_coalesced(headers: dict[str, Any], body: bytes) -> list[Part]:
    """The requests of a coalesced message; raises ValueError on anything malformed."""
    model, op = headers.get(H_MODEL), headers.get(H_OP)
    if not isinstance(model, str) or not isinstance(op, str):
        raise ValueError("a coalesced message needs shoal_model and shoal_op headers")
    bulk = bool(headers.get(H_BULK))
    try:
        parts = [Part(task_id, Annotations(model, op, int(items), int(cost), int(longest),
                                           deadline, sent, lora, bulk=bulk), bytes(part_body),
                      int(returns))
                 for task_id, items, cost, longest, deadline, sent, lora, returns, part_body
                 in msgpack.unpackb(body, raw=False)]
    except Exception as exc:  # msgpack and unpacking raise several unrelated types
        raise ValueError(f"malformed coalesced message: {exc}") from exc
    if not all(isinstance(p.task_id, str) and p.task_id for p in parts):
        raise ValueError("malformed coalesced message: every request needs a task id")
    traces = headers.get(H_TRACES)
    if isinstance(traces, list | tuple) and len(traces) == len(parts):
        parts = [_traced(part, trace) for part, trace in zip(parts, traces, strict=True)]
    return parts


def _traced(part: Part, trace: Any) -> Part:
    """A member with its entry of H_TRACES (ignored unless well formed: a trace context
    is no reason to refuse a request)."""
    if not isinstance(trace, list | tuple) or len(trace) != 2:
        return part
    traceparent = trace_field(trace[0])
    if traceparent is None:
        return part
    return replace(part, annotations=replace(part.annotations, traceparent=traceparent,
                                             tracestate=trace_field(trace[1])))
