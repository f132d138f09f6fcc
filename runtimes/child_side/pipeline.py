"""The runtime process's batch pipeline: the device never waits for the host's work.

A batch's work has three stages (`runtimes.child_side.host.ModelHost`): `begin` (decode, check,
tokenize, pad into pinned memory), `forward` (queue the device work and the copy of
its outputs back) and `finish` (wait for the copy, pool, build and send the reply).
Each stage has a thread: the connection's reader begins batch N+1 while the device
thread runs batch N, and the finisher answers batch N-1. Replies go out in the order
the batches came (stage queues are FIFO), which is what the worker's side expects
(`runtimes.worker_side.process`). At most one batch waits between reading and the device, so
the pipeline holds three batches: one per stage. A lone batch (none other read and not
answered) is finished by the device thread itself: one thread's wake-up less on a lone
request's path, and nothing behind it to overlap.

A failure stays with its batch: an exception in any stage answers that batch
`Failed` (`runtimes.wire.frames`) and the next batch runs. An error that leaves the device unusable
(a CUDA error) is answered `fatal`, and the process exits right after sending it; the
batches behind it then see the connection close, as after a crash, and the worker
runs them again on a fresh process.

Frames that talk back and forth (a streamed batch's deltas) or must run alone (a
probe) wait until the pipeline is empty and then run in series on the reader
(`Pipeline.idle`).
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtimes.base import Outcome, Request
from runtimes.child_side import spans
from runtimes.child_side.spans import Stamps
from runtimes.wire.frames import Failed, Frame, Outcomes, RunOutcome
from runtimes.wire.protocol import encode_frame
from tasks import tracing
from tasks.served import take_shared

if TYPE_CHECKING:
    from runtimes.child_side.host import BatchWork, ModelHost

log = logging.getLogger(__name__)

EXIT_FATAL = 3  # the device is unusable after an error; the client restarts us


def leaves_device_unusable(exc: BaseException, device: str) -> bool:
    """After a CUDA error the context is corrupt and every later call fails;
    out-of-memory is not one of them (the next, smaller batch can succeed)."""
    if not device.startswith("cuda"):
        return False
    text = str(exc)
    return type(exc).__name__ == "AcceleratorError" or any(
        marker in text for marker in ("CUDA error", "CUBLAS_STATUS", "CUDNN_STATUS")
    )


def release_cached_memory(device: str) -> None:
    # Only where torch is loaded already: the ONNX runtime never imports it.
    if device.startswith("cuda") and "torch" in sys.modules:
        import torch

        try:
            torch.cuda.empty_cache()
        except Exception:  # the device may be what failed
            log.exception("could not release cached device memory")


def failed_reply(exc: BaseException, device: str, requests: int, model: str
                 ) -> tuple[Failed, bool]:
    """The reply to a batch that raised, and whether the process must exit after it."""
    log.error("batch of %d requests for %s failed", requests, model, exc_info=exc)
    fatal = leaves_device_unusable(exc, device)
    if not fatal:
        release_cached_memory(device)
    return Failed(repr(exc), fatal), fatal


def outcomes_reply(outcomes: list[Outcome]) -> Outcomes:
    """The frame of a batch's outcomes, the facts its results share sent once (their
    results are the frame's: taken apart in place)."""
    shared = take_shared([o.result for o in outcomes if o.result is not None])
    return Outcomes([
        RunOutcome(o.id, o.result, None if o.error_code is None else str(o.error_code),
                   o.error_message, o.stats)
        for o in outcomes
    ], shared)


def reply_bytes(reply: Frame) -> bytearray:
    try:
        return encode_frame(reply)
    except Exception as exc:  # too large, or a result msgpack cannot pack
        # Not fatal: the client bisects, and smaller batches give smaller replies.
        return encode_frame(Failed(f"reply could not be sent: {exc!r}"))


@dataclass(slots=True)
class _Item:
    model: str
    requests: list[Request]
    work: BatchWork | None = None  # None: `begin` raised (`failure`)
    failure: BaseException | None = None
    stamps: Stamps | None = None  # a traced batch's clocks (`runtimes.child_side.spans`)


class Pipeline:
    """The stages' threads and queues for one batch connection (see the module doc)."""

    def __init__(self, conn: socket.socket, host: ModelHost) -> None:
        self.conn = conn
        self.host = host
        # SimpleQueues hand a batch on in C, where queue.Queue runs a Python Condition per
        # put and get: 10.6 -> 5.8 us of CPU per hand-off (two per batch), measured
        # thread to thread. `_device_slot` is held while a batch waits for the device
        # thread, so at most one does (what Queue(maxsize=1) did).
        self._to_device: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._device_slot = threading.Lock()
        self._to_finish: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._in_flight = 0  # batches read and not yet answered
        self._changed = threading.Condition()
        for target, name in ((self._device, "runtime-device"), (self._finish, "runtime-finish")):
            threading.Thread(target=target, name=name, daemon=True).start()

    def submit(self, model: str, requests: list[Request]) -> None:
        """Begin a batch (on the caller's thread, the reader's) and pass it on."""
        with self._changed:
            self._in_flight += 1
        item = _Item(model, requests)
        if tracing.ENABLED and requests and requests[0].trace:
            item.stamps = Stamps(requests[0].trace)
            item.stamps.now()
        try:
            item.work = self.host.begin(model, requests)
        except Exception as exc:
            item.failure = exc
        if item.stamps is not None:
            item.stamps.now()
        self._device_slot.acquire()
        self._to_device.put(item)

    def idle(self) -> None:
        """Wait until every batch submitted has been answered."""
        with self._changed:
            self._changed.wait_for(lambda: self._in_flight == 0)

    def _device(self) -> None:
        while True:
            item = self._to_device.get()
            self._device_slot.release()
            if item.stamps is not None:
                item.stamps.now()
            if item.failure is None and item.work is not None:
                try:
                    self.host.forward(item.work)
                except Exception as exc:
                    item.failure = exc
            if item.stamps is not None:
                item.stamps.now()
            # A lone batch (the only one read and not answered: none is being finished, none
            # waits for the device) is answered here, without the finisher's wake-up (a
            # thread hand-off on its path); with another in flight it goes on to the
            # finisher, so the device takes the next batch at once and replies keep their
            # order (the finisher's are all older than this one).
            if self._in_flight == 1:
                self._answer(item)
            else:
                self._to_finish.put(item)

    def _finish(self) -> None:
        while True:
            self._answer(self._to_finish.get())

    def _answer(self, item: _Item) -> None:
        """Finish a batch and send its reply (the finisher's, or a lone batch's on the
        device thread)."""
        fatal = False
        if item.stamps is not None:
            item.stamps.now()
        if item.failure is None and item.work is not None:
            try:
                reply = outcomes_reply(self.host.finish(item.work))
            except Exception as exc:
                item.failure = exc
        if item.failure is not None:
            reply, fatal = failed_reply(item.failure, self.host.device,
                                        len(item.requests), item.model)
        self.host.forget_cancelled(item.requests)
        try:
            self.conn.sendall(reply_bytes(reply))
        except OSError:
            log.info("the worker went away before the reply; exiting")
            os._exit(0)
        if item.stamps is not None:
            item.stamps.now()
            spans.record(item.model, len(item.requests), item.stamps, item.failure)
        if fatal:
            log.error("the device is unusable after that error; exiting so a fresh "
                      "runtime starts")
            logging.shutdown()
            os._exit(EXIT_FATAL)
        with self._changed:
            self._in_flight -= 1
            self._changed.notify_all()
