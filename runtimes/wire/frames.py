"""The frames between a worker (`runtimes.worker_side.process`) and its runtime process
(`runtimes.child_side.server`), defined once for both sides.

Each frame is a `msgspec.Struct` tagged by its `frame` field, so a connection's reader
decodes the union of what may come on it into the right type in one pass (the
`*_DECODER`s below, made once per process: no per-frame construction on the hot path).
On the wire it is a msgpack map (`runtimes.wire.protocol` adds the length prefix); the items
a batch repeats per request (`RunRequest`, `RunOutcome`, `StreamDelta`) are msgpack
arrays, without their field names.

Batch connection (the worker sends, the runtime answers; replies in the order sent):

    Ready                     the runtime's first frame, once both connections are accepted
    Ping                   -> Pong
    Run                    -> Outcomes | Failed
    Probe                  -> the same, for one request (id PROBE_ID): the adapter's own
                              small known-good request
    anything else          -> Rejected

    A `Run` with `deltas` is a conversation until its outcomes: after each decode step
    the runtime sends `Deltas` and waits for `Cancel` (requests whose callers left since;
    their rows stop), so a stream is paced by its reader and a cancel reaches the loop
    within one step.

Control connection (beside the batches):

    Load                   -> Loaded | Failed
    Unload                 -> Unloaded
    Ping                   -> Pong
    Cancel                 (no reply) requests whose callers left: read at once, even
                              while a load runs; a batch of the pipeline none of whose
                              runnable requests is left skips its device work and they
                              are answered CANCELLED (a batch on the device finishes)
    anything else          -> Rejected

`Failed` means the work raised (the worker decides which request is to blame); `fatal`
means the exception left the device unusable (a CUDA error): the runtime exits right
after replying so that the worker starts a fresh one. `Rejected` means the frame was not
understood.
"""

from __future__ import annotations

from typing import Any

import msgspec


class Frame(msgspec.Struct, tag_field="frame"):
    """A frame on a worker↔runtime connection (tagged by its `frame` field)."""


# --- the worker's frames ------------------------------------------------------------------


class RunRequest(msgspec.Struct, array_like=True):
    """One request of a `Run` (`runtimes.base.Request`)."""

    id: str
    op: str
    kwargs: Any  # the task's kwargs as the caller sent them: the adapter checks them, so a
    # malformed one fails its request alone (VALIDATION_ERROR), not the frame
    stream: bool = False
    # Epoch ms after which nobody wants its result: dropped before the device past it.
    deadline_ms: float | None = None


class Run(Frame, tag="run"):
    """Run a batch of `model`; with `deltas`, streamed requests send `Deltas` as they go."""

    model: str
    requests: list[RunRequest]
    deltas: bool = False
    # With tracing on: the W3C traceparent of the worker's span of this batch, which the
    # runtime's spans continue (`runtimes.child_side.spans`); None: not traced.
    trace: str | None = None


class Probe(Frame, tag="probe"):
    """Run `model`'s adapter's own known-good request (`runtimes.child_side.server.probe`)."""

    model: str


class Cancel(Frame, tag="cancel"):
    """The answer to `Deltas`: the requests of the batch whose callers left since. On the
    control connection, unanswered: requests of the batches in flight whose callers left."""

    ids: list[str]


class Ping(Frame, tag="ping"):
    """Is the runtime there (answered `Pong`)."""


class Load(Frame, tag="load"):
    """Load `model`, or with `lora` the LoRA adapter of that name of the loaded `model`."""

    model: str
    lora: str | None = None


class Unload(Frame, tag="unload"):
    """Free `model` with its LoRA adapters, or with `lora` only that adapter."""

    model: str
    lora: str | None = None


# --- the runtime's frames -----------------------------------------------------------------


class Ready(Frame, tag="ready"):
    """The runtime's first frame: its process, the models it loaded with the device bytes
    each takes, and the device's memory (None: unknown, and always for a spare, which
    touches no device until it loads)."""

    pid: int
    models: dict[str, int]
    device_bytes: int | None = None


class Pong(Frame, tag="pong"):
    pid: int


class RunOutcome(msgspec.Struct, array_like=True):
    """One request's outcome (`runtimes.base.Outcome`)."""

    id: str
    result: Any = None
    error_code: str | None = None
    error_message: str | None = None
    stats: dict[str, Any] = {}


class Outcomes(Frame, tag="outcomes"):
    """The outcomes of a `Run` or `Probe`, one per request, in the order sent; `shared`:
    what all their results share (model, batch, ...), sent once instead of in each result
    (`tasks.served.take_shared`; the worker puts it back, `give_shared`)."""

    outcomes: list[RunOutcome]
    shared: dict[str, Any] | None = None


class Failed(Frame, tag="failed"):
    """The batch (or load) raised: `reason` says what; `fatal`: the runtime exits next."""

    reason: str
    fatal: bool = False


class StreamDelta(msgspec.Struct, array_like=True):
    """`runtimes.base.Delta` on the wire."""

    id: str
    index: int
    text: str
    tokens: int


class Deltas(Frame, tag="deltas"):
    """A decode step's new output of a `Run` with `deltas` (answered `Cancel`)."""

    deltas: list[StreamDelta]


class Loaded(Frame, tag="loaded"):
    """`model` (or its adapter) is loaded: the device `bytes` it takes, the `seconds`
    loading took."""

    model: str
    bytes: int
    seconds: float


class Unloaded(Frame, tag="unloaded"):
    model: str


class Rejected(Frame, tag="rejected"):
    """The frame was not understood (`reason`); nothing was run."""

    reason: str


BatchRequest = Run | Probe | Ping
ControlRequest = Load | Unload | Ping | Cancel
BatchReply = Outcomes | Failed | Deltas | Ready | Pong | Rejected
ControlReply = Loaded | Unloaded | Failed | Pong | Rejected

# What each side's readers expect on each connection.
BATCH_REQUEST_DECODER = msgspec.msgpack.Decoder(BatchRequest)
CANCEL_DECODER = msgspec.msgpack.Decoder(Cancel)
CONTROL_REQUEST_DECODER = msgspec.msgpack.Decoder(ControlRequest)
BATCH_REPLY_DECODER = msgspec.msgpack.Decoder(BatchReply)
CONTROL_REPLY_DECODER = msgspec.msgpack.Decoder(ControlReply)
