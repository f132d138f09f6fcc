"""A `ProcessRuntime`'s control connection to its child: loads, unloads and pings, each
answered, and cancels, told unanswered beside them.

The child reads a control connection beside its batch connection (both connected by
`runtimes.worker_side.runtime_child`), so a load runs while batches do. One load
or unload at a time waits for its reply; a cancel (a revoke: a batch of the child's
pipeline whose requests are all cancelled before it reaches the device skips it) is
written between frames and never waits long, since its caller is the worker's loop. A
child that dies under a load is replaced through the supervisor, and the load fails.
"""

from __future__ import annotations

import logging
import threading

from runtimes.base import LoadFailed
from runtimes.wire.frames import CONTROL_REPLY_DECODER, Cancel, ControlReply, Load, Ping, Unload
from runtimes.wire.protocol import (
    FrameTooLarge,
    MalformedFrame,
    ProtocolError,
    encode_frame,
    recv_frame,
)
from runtimes.worker_side.runtime_child import RuntimeChild
from runtimes.worker_side.supervisor import Supervisor

log = logging.getLogger(__name__)

# How long a cancel waits for another frame being written on the control connection (a
# load's few bytes) before it gives up telling the child: the caller is the worker's loop.
CANCEL_WRITE_WAIT_S = 0.05


class ControlChannel:
    """The control connection of whichever child serves now (`Supervisor.ready_child`)."""

    def __init__(self, children: Supervisor) -> None:
        self._children = children
        self._calling = threading.Lock()  # one load, unload or ping at a time
        # One frame's bytes at a time on the connection: a cancel goes beside a load that
        # waits for its reply.
        self._writing = threading.Lock()

    def call(self, frame: Load | Unload | Ping, doing: str) -> ControlReply:
        """Send `frame` to the ready child (waiting for one) and read its reply; LoadFailed
        (`doing` says what was being done) if the child died meanwhile or answered
        nonsense."""
        with self._calling:
            child = self._children.ready_child()
            assert child.control is not None
            try:
                with self._writing:
                    child.control.sendall(encode_frame(frame))
                reply = recv_frame(child.control, CONTROL_REPLY_DECODER)
            except MalformedFrame as exc:
                raise LoadFailed(f"unexpected reply from the model runtime: {exc}") from exc
            except (OSError, EOFError, ProtocolError) as exc:
                how = self._children.replace_dead(child, f"control connection lost: {exc}")
                raise LoadFailed(f"the model runtime died while {doing} ({how})") from exc
        return reply

    def tell_cancelled(self, child: RuntimeChild, ids: list[str]) -> None:
        """Send the child a `Cancel` (unanswered: a load waiting for its reply is not
        disturbed). Skipped when the child is not serving yet (a promoted spare's loads
        use the connection), when another frame is being written for more than a moment,
        or when the child is gone (its batches fail anyway)."""
        if child.control is None or child.sock is None or child.spare:
            return
        try:
            payload = encode_frame(Cancel(ids))
        except FrameTooLarge:
            return
        if not self._writing.acquire(timeout=CANCEL_WRITE_WAIT_S):
            log.warning("the control connection was busy: %d cancelled requests were not "
                        "told to the model runtime", len(ids))
            return
        try:
            child.control.sendall(payload)
        except OSError as exc:
            log.info("could not tell the model runtime of %d cancelled requests: %s",
                     len(ids), exc)
        finally:
            self._writing.release()
