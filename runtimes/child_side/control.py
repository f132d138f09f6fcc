"""The runtime process's control connection: loads, unloads, pings and cancels.

The worker's second connection (`runtimes.child_side.server` accepts it after the batch
connection). Loads and unloads run on a thread of their own, beside the batches of the
models already loaded, answered in order; a `Cancel` (requests whose callers left) is
taken at once, unanswered, even while a load runs. The frames are `runtimes.wire.frames`.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from typing import TYPE_CHECKING

from runtimes.child_side.pipeline import release_cached_memory
from runtimes.wire.frames import (
    CONTROL_REQUEST_DECODER,
    Cancel,
    ControlReply,
    ControlRequest,
    Failed,
    Load,
    Loaded,
    Ping,
    Pong,
    Rejected,
    Unload,
    Unloaded,
)
from runtimes.wire.protocol import (
    ConnectionClosed,
    MalformedFrame,
    ProtocolError,
    encode_frame,
    recv_frame,
)
from tasks.catalog import Catalog

if TYPE_CHECKING:
    from runtimes.child_side.host import ModelHost

log = logging.getLogger("runtimes.child_side.server")


def control(host: ModelHost, catalog: Catalog, frame: Load | Unload | Ping,
            imported: threading.Event | None = None) -> ControlReply:
    """The reply to one control frame (a load, an unload, a ping; a cancel has none). A
    load first waits for `imported` (the background imports): transformers' lazy module
    is not safe to import from two threads at once (a racing load failed with "cannot
    import name 'AutoModel'")."""
    if isinstance(frame, Ping):
        return Pong(os.getpid())
    model, lora = frame.model, frame.lora
    if not isinstance(frame, Load):
        if lora is None:
            host.unload(model)
        else:
            host.unload_lora(model, lora)
        return Unloaded(model)
    entry = catalog.get(model)
    if entry is None:
        return Failed(f"{model} is not in the runtime's catalog")
    started = time.perf_counter()
    if imported is not None:
        imported.wait()
    try:
        measured = host.load_one(entry) if lora is None else host.load_lora(model, lora)
    except Exception as exc:  # bad weights, missing files, out of memory: not our death
        log.exception("loading %s failed", model)
        release_cached_memory(host.device)
        return Failed(f"{type(exc).__name__}: {exc}")
    return Loaded(model, measured, time.perf_counter() - started)


def serve_control(conn: socket.socket, host: ModelHost, catalog: Catalog,
                  imported: threading.Event | None = None) -> None:
    """Answer control frames until the worker hangs up (on a thread of its own). A
    `Cancel` is taken at once, unanswered, even while a load runs: the loads, unloads and
    pings are answered in order on another thread."""
    requests: queue.Queue[Load | Unload | Ping | Rejected | None] = queue.Queue()
    threading.Thread(target=_answer_control, args=(conn, requests, host, catalog, imported),
                     name="runtime-control-answers", daemon=True).start()
    try:
        while True:
            try:
                frame: ControlRequest | Rejected = recv_frame(conn, CONTROL_REQUEST_DECODER)
            except (ConnectionClosed, OSError):
                return
            except MalformedFrame as exc:
                frame = Rejected(f"unknown control frame: {exc}")
            except ProtocolError as exc:
                log.error("control connection: %s", exc)
                return
            if isinstance(frame, Cancel):
                host.cancel(frame.ids)
            else:
                requests.put(frame)
    finally:
        requests.put(None)


def _answer_control(conn: socket.socket,
                    requests: queue.Queue[Load | Unload | Ping | Rejected | None],
                    host: ModelHost, catalog: Catalog, imported: threading.Event | None
                    ) -> None:
    while (frame := requests.get()) is not None:
        reply = frame if isinstance(frame, Rejected) else control(host, catalog, frame,
                                                                  imported)
        try:
            conn.sendall(encode_frame(reply))
        except OSError:
            return
