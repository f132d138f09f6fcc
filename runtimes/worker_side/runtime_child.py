"""One incarnation of a `ProcessRuntime`'s child process (`python -m runtimes.child_side.server`):
the process, its output, its connections (batches, and loads beside them), and how it
started; `runtimes.worker_side.supervisor` decides when one starts, replaces another, or stops.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from runtimes.base import RuntimeClosed, RuntimeStartError
from runtimes.wire.frames import (
    BATCH_REPLY_DECODER,
    CONTROL_REPLY_DECODER,
    Failed,
    Load,
    Loaded,
    Ready,
    Rejected,
)
from runtimes.wire.protocol import MalformedFrame, ProtocolError, encode_frame, recv_frame
from runtimes.worker_side.children import OutputTail, describe_exit
from runtimes.worker_side.turns import Turns

log = logging.getLogger(__name__)


class RuntimeChild:
    """One incarnation of the runtime process: the process, its output, its connection."""

    def __init__(self, argv: list[str], env: Mapping[str, str], socket_path: Path,
                 spare: bool = False) -> None:
        self.socket_path = socket_path
        # A spare (`runtimes.child_side.server --spare`) holds no model until it is promoted and
        # told to load; True until then.
        self.spare = spare
        self.replacing_since: float | None = None  # when it was chosen to replace a dead one
        self.started = time.monotonic()
        self.started_wall = time.time()  # to compare with its socket's mtime
        # Seconds from its start until it listened, measured when it is connected to.
        self.listened_after_s: float | None = None
        self.proc = subprocess.Popen(
            argv, env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            # Its own session: a Ctrl-C meant for the worker must not kill the
            # runtime under a running batch; the worker stops it itself.
            start_new_session=True,
        )
        self.pid = self.proc.pid
        self.sock: socket.socket | None = None  # batches
        self.turns = Turns()  # the batches in flight on it
        self.control: socket.socket | None = None  # loads and unloads, beside batches
        self.ready = Ready(0, {})  # its first frame, once connected
        assert self.proc.stdout is not None
        # The child's logs go to the worker's stderr; the tail explains a failed start.
        self.output = OutputTail(self.proc.stdout, f"runtime-{self.pid}-output", 40)

    def output_tail(self) -> str:
        return self.output.text()

    def listening(self) -> bool:
        """Its start-up (a spare's imports) is done and it waits for its worker."""
        return self.sock is not None or self.socket_path.exists()

    def _measure_listen(self) -> None:
        """Record how long it took to listen (a spare: its imports; a fresh child: imports
        and loads), from its socket's mtime (the bind). Read just before connecting: the
        server removes the file once its worker has connected, so a reading after
        `connect` finds nothing (a restart's Retry-After then had nothing to go on)."""
        try:
            self.listened_after_s = max(0.0, self.socket_path.stat().st_mtime
                                        - self.started_wall)
        except OSError:  # gone already: now is an upper bound
            self.listened_after_s = time.monotonic() - self.started

    def load(self, frame: Load, timeout: float) -> Loaded:
        """One load on the control connection of a promoted spare (raises
        RuntimeStartError if it fails or the process dies meanwhile)."""
        assert self.control is not None
        doing = f"loading {frame.model}" + (f" (LoRA {frame.lora})" if frame.lora else "")
        try:
            self.control.settimeout(max(timeout, 1.0))
            self.control.sendall(encode_frame(frame))
            reply = recv_frame(self.control, CONTROL_REPLY_DECODER)
            self.control.settimeout(None)
        except MalformedFrame as exc:
            raise RuntimeStartError(f"the model runtime (pid {self.pid}) failed {doing}: "
                                    f"{exc}") from exc
        except (OSError, EOFError, ProtocolError) as exc:
            self.proc.poll()
            raise RuntimeStartError(
                f"the model runtime (pid {self.pid}) failed while {doing} "
                f"({describe_exit(self.proc.returncode)}: {exc!r}); its last output:\n"
                f"{self.output_tail()}") from exc
        if not isinstance(reply, Loaded):
            why = reply.reason if isinstance(reply, Failed | Rejected) else None
            raise RuntimeStartError(f"the model runtime (pid {self.pid}) failed {doing}: "
                                    f"{why or repr(reply)[:200]}")
        return reply

    def connect(self, timeout: float, closed: Callable[[], bool]) -> None:
        """Wait for the socket (it appears once the start-up models are loaded), open the
        batch and the control connections, and read the ready frame."""
        deadline = self.started + timeout
        while not self.socket_path.exists():
            if closed():
                raise RuntimeClosed("the runtime was closed while starting")
            if self.proc.poll() is not None:
                raise RuntimeStartError(
                    f"the model runtime (pid {self.pid}) exited during start-up "
                    f"({describe_exit(self.proc.returncode)}); its last output:\n"
                    f"{self.output_tail()}"
                )
            if time.monotonic() > deadline:
                raise RuntimeStartError(
                    f"the model runtime (pid {self.pid}) was not ready within {timeout:.0f}s; "
                    f"its last output:\n{self.output_tail()}"
                )
            time.sleep(0.05)
        self._measure_listen()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(deadline - time.monotonic(), 5.0))
            sock.connect(str(self.socket_path))
            control.connect(str(self.socket_path))
            ready = recv_frame(sock, BATCH_REPLY_DECODER)
            sock.settimeout(None)
        except MalformedFrame as exc:
            sock.close()
            control.close()
            raise RuntimeStartError(f"unexpected first frame from the runtime: {exc}") from exc
        except (OSError, EOFError, ProtocolError) as exc:
            sock.close()
            control.close()
            if closed():
                raise RuntimeClosed("the runtime was closed while starting") from exc
            raise RuntimeStartError(
                f"the model runtime (pid {self.pid}) failed while connecting: {exc!r}; "
                f"its last output:\n{self.output_tail()}"
            ) from exc
        if not isinstance(ready, Ready) or ready.pid != self.pid:
            sock.close()
            control.close()
            raise RuntimeStartError(f"unexpected first frame from the runtime: {ready!r:.200}")
        self.sock, self.control, self.ready = sock, control, ready
        if not self.spare:  # a spare's readiness is told once it has loaded
            log.info("model runtime pid %d ready in %.1fs", self.pid,
                     time.monotonic() - self.started)

    def stop(self, grace: float) -> str:
        """End the process (politely first), reap it; how it ended. Safe to call twice."""
        for sock in (self.sock, self.control):
            if sock is not None:
                # Wakes a thread blocked in recv, and tells an idle server to exit.
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        if self.sock is None and self.proc.poll() is None:
            # Never connected (a spare, or a start given up): nothing to be polite to;
            # it would wait for its worker until its parent dies.
            self.proc.terminate()
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.output.join()
        for sock in (self.sock, self.control):
            if sock is not None:
                sock.close()
        return describe_exit(self.proc.returncode)
