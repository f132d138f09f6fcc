"""The life of a `ProcessRuntime`'s child processes: spawn, connect, stop, the spare,
and the replacement of one that died.

The child (`python -m runtimes.server`) is spawned, never forked, and reached over a
private Unix socket (`runtimes.protocol`, `runtimes.frames`): one connection for
batches, one for loads and unloads. After a death the next child is spawned at once
(without waiting for it), so it loads while the batch's replies go out.

Spare runtime (`spare=True`, the worker's SHOAL_RUNTIME_SPARE). Most of a fresh
child's start is importing torch and transformers (~7 s of ~7.5 s for MiniLM on a
2-core host), so one more child is kept started with everything imported and no
model (`runtimes.server --spare`; no CUDA context either). A death promotes it: it
loads what its predecessor had resident (models, then their LoRA adapters, over
its control connection) and serves, and the next spare starts importing at once
(at lower CPU priority). Every restart uses the spare when there is one, the
steps of a bisection included; a spare that is still importing is waited for (it
is ahead of a fresh child); without one (it died, or is off) a fresh child starts
with the models to load, as before. `spare_promotions` counts the promotions.

Restart failures. A replacement that dies or fails while starting (killed while
it loads, say) is replaced again, up to RESTART_ATTEMPTS starts in a row, before
the batch's or load's wait for it raises `RuntimeStartError`: an external kill
during a restart is retried like any other, and a runtime that cannot start at
all (its weights gone bad) fails clearly instead of looping. The very first start
is not retried (a wrong catalog entry fails at once). `start_failures` counts
them.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from runtimes.base import RuntimeClosed, RuntimeStartError
from runtimes.children import OutputTail, describe_exit
from runtimes.frames import (
    BATCH_REPLY_DECODER,
    CONTROL_REPLY_DECODER,
    Failed,
    Load,
    Loaded,
    Ready,
    Rejected,
)
from runtimes.pool import LORA_SEPARATOR
from runtimes.protocol import MalformedFrame, ProtocolError, encode_frame, recv_frame
from runtimes.turns import Turns

log = logging.getLogger(__name__)

_MAX_SOCKET_PATH = 96  # sun_path holds 107 bytes on Linux; the server adds ".staging"
# Starts in a row (the first after a death, then retries) before a restart gives up:
# two kills landing in one restart are rare; a third failure means it cannot start.
RESTART_ATTEMPTS = 3


class RuntimeChild:
    """One incarnation of the runtime process: the process, its output, its connection."""

    def __init__(self, argv: list[str], env: Mapping[str, str], socket_path: Path,
                 spare: bool = False) -> None:
        self.socket_path = socket_path
        # A spare (`runtimes.server --spare`) holds no model until it is promoted and
        # told to load; True until then.
        self.spare = spare
        self.replacing_since: float | None = None  # when it was chosen to replace a dead one
        self.started = time.monotonic()
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


class Supervisor:
    """A `ProcessRuntime`'s current child and its spare: starts, restarts and promotes
    them (see the module doc). Counters for metrics: `restarts` (replacement children,
    spawned or promoted, failed starts included), `spare_promotions`, `start_failures`.

    `resident` (model or LoRA key -> measured bytes) is the runtime's, shared under
    `lock`: a fresh child loads what it holds before it is ready, a promoted spare loads
    it over its control connection, and a ready frame's models are added to it, so that
    what the worker believes loaded stays loaded. `device_bytes` is the device's memory,
    from the children's ready frames.
    """

    def __init__(self, argv: list[str], env: Mapping[str, str], resident: dict[str, int],
                 lock: threading.Lock, start_timeout: float, spare: bool) -> None:
        self._argv = argv
        self._env = env
        self.resident = resident
        self._lock = lock  # guards _child, _spare, _closed and resident
        self.start_timeout = start_timeout
        self.device_bytes: int | None = None  # the device's memory, from the child
        self.restarts = 0
        self.spare_promotions = 0  # restarts that promoted the spare
        self.start_failures = 0  # replacements that failed to start (and were retried)
        self._use_spare = spare
        self._dir = Path(tempfile.mkdtemp(prefix="shoal-runtime-"))  # mode 0700: private
        self._starting = threading.Lock()  # one thread spawns and connects a child
        self._closed = False
        self._child: RuntimeChild | None = None
        self._spare: RuntimeChild | None = None
        self._spawned = 0  # children and spares started (names their sockets)
        self._started_once = False  # a child was ready once: later starts are restarts

    @property
    def child(self) -> RuntimeChild | None:
        """The current child (None: none now, the next is started when needed)."""
        return self._child

    @property
    def spare(self) -> RuntimeChild | None:
        return self._spare

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop the child and the spare (a batch on the child then fails: RuntimeClosed)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            child, self._child = self._child, None
            spare, self._spare = self._spare, None
        for process in (child, spare):
            if process is not None:
                how = process.stop(grace=1.0)
                log.info("model runtime pid %d%s stopped (%s)", process.pid,
                         " (the spare)" if process is spare else "", how)
        shutil.rmtree(self._dir, ignore_errors=True)

    def ready_child(self) -> RuntimeChild:
        """The current child, started (or restarted) and ready for batches. A restart that
        fails is tried again, RESTART_ATTEMPTS starts in all (see the module doc)."""
        with self._starting:
            attempt = 1
            while True:
                child = self._child
                if child is not None and child.proc.poll() is not None:
                    # Died between batches: nothing about to run is to blame.
                    self.replace_dead(child, "died while idle", respawn=False)
                    child = None
                if child is None:
                    child = self._replace()
                if child.sock is not None and not child.spare:
                    return child
                try:
                    self._bring_up(child)
                    return child
                except RuntimeStartError as exc:
                    child.stop(grace=1.0)
                    self._forget(child)
                    if self._closed:
                        raise RuntimeClosed("the runtime was closed while starting") from exc
                    if not self._started_once:
                        raise
                    self.start_failures += 1
                    if attempt >= RESTART_ATTEMPTS:
                        log.error("the model runtime failed to start %d times in a row; "
                                  "giving up this restart", attempt)
                        raise
                    attempt += 1
                    log.warning("restarting the model runtime failed (%s); trying again "
                                "(start %d of %d)", exc, attempt, RESTART_ATTEMPTS)
                except BaseException:
                    child.stop(grace=1.0)
                    self._forget(child)
                    raise

    def _bring_up(self, child: RuntimeChild) -> None:
        """Connect to a starting child; a promoted spare then loads what is resident."""
        child.connect(self.start_timeout, lambda: self._closed)
        if child.spare:
            self._load_resident(child)
            child.spare = False
        with self._lock:
            self.resident.update(child.ready.models)
            self.device_bytes = child.ready.device_bytes or self.device_bytes
        self._started_once = True
        if child.replacing_since is not None:
            log.info("model runtime pid %d took over in %.2fs", child.pid,
                     time.monotonic() - child.replacing_since)

    def _load_resident(self, child: RuntimeChild) -> None:
        """Load into a promoted spare what its predecessor had: the models, then their LoRA
        adapters (the bytes each takes are measured again)."""
        with self._lock:
            keys = list(self.resident)
        ordered = [k for k in keys if LORA_SEPARATOR not in k] + \
                  [k for k in keys if LORA_SEPARATOR in k]
        deadline = time.monotonic() + self.start_timeout
        for key in ordered:
            model, _, lora = key.partition(LORA_SEPARATOR)
            reply = child.load(Load(model, lora or None), deadline - time.monotonic())
            with self._lock:
                if key in self.resident:  # not unloaded meanwhile
                    self.resident[key] = reply.bytes

    def _replace(self) -> RuntimeChild:
        """The next child: the spare, promoted, if there is one alive; else a fresh one
        that loads the resident models itself. Either way the next spare starts."""
        with self._lock:
            if self._closed:
                raise RuntimeClosed("the runtime is closed")
            if self._child is not None:  # the other thread (batch or control) replaced it
                return self._child
            spare, self._spare = self._spare, None
        if spare is not None and spare.proc.poll() is not None:
            log.warning("the spare runtime pid %d had died (%s); starting a fresh one; its "
                        "last output:\n%s", spare.pid, describe_exit(spare.proc.returncode),
                        spare.output_tail())
            spare.stop(grace=1.0)
            spare = None
        with self._lock:
            if self._closed:
                if spare is not None:
                    spare.stop(grace=1.0)
                raise RuntimeClosed("the runtime is closed")
            if self._child is not None:  # replaced meanwhile: the spare stays a spare
                if spare is not None and self._spare is None:
                    self._spare, spare = spare, None
                if spare is not None:
                    spare.stop(grace=1.0)
                return self._child
            if self._started_once:
                self.restarts += 1
            if spare is not None:
                self.spare_promotions += 1
                self._child = spare
                log.info("promoting the spare runtime pid %d", spare.pid)
            child = spare or self._spawn()
            if self._started_once:
                child.replacing_since = time.monotonic()
        if self._started_once:  # the first child's spare starts once it is ready
            self.start_spare()
        return child

    def start_spare(self) -> None:
        """Start a spare, unless spares are off or one exists."""
        with self._lock:
            if not self._use_spare or self._closed or self._spare is not None:
                return
            path = self._socket_path()
            self._spare = RuntimeChild([*self._argv, "--spare", "--socket", str(path)],
                                 self._env, path, spare=True)
            log.info("spare model runtime pid %d starting", self._spare.pid)

    def _socket_path(self) -> Path:
        self._spawned += 1
        path = self._dir / f"rt-{self._spawned}.sock"
        if len(str(path)) > _MAX_SOCKET_PATH:
            raise RuntimeStartError(f"socket path {path} is too long; set TMPDIR shorter")
        return path

    def _spawn(self) -> RuntimeChild:
        """A fresh child that loads the resident models before it is ready (under _lock)."""
        path = self._socket_path()
        models = [arg for key in self.resident
                  for arg in ("--lora" if LORA_SEPARATOR in key else "--model", key)]
        self._child = RuntimeChild([*self._argv, *models, "--socket", str(path)], self._env, path)
        return self._child

    def _forget(self, child: RuntimeChild) -> None:
        with self._lock:
            if self._child is child:
                self._child = None

    def replace_dead(self, child: RuntimeChild, why: str, respawn: bool = True) -> str:
        """Reap a child that died or broke its connection; start the next one loading (a
        fresh child starts at once; a promoted spare loads when the next batch waits)."""
        if self._closed:
            raise RuntimeClosed("the runtime was closed while a batch was running")
        how = child.stop(grace=5.0)
        with self._lock:
            if self._child is not child:
                return how  # the other thread (batch or control) replaced it already
            self._child = None
        log.warning("model runtime pid %d is gone: %s (%s)", child.pid, how, why)
        if respawn:
            self._replace()
        return how
