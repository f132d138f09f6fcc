"""The life of a `ProcessRuntime`'s child processes: spawn, connect, stop, the spare,
and the replacement of one that died.

The child (`python -m runtimes.child_side.server`) is spawned, never forked, and reached over a
private Unix socket (`runtimes.wire.protocol`, `runtimes.wire.frames`): one connection for
batches, one for loads and unloads. After a death the next child is spawned at once
(without waiting for it), so it loads while the batch's replies go out.

Spare runtime (`spare=True`, the worker's SHOAL_RUNTIME_SPARE). Most of a fresh
child's start is importing torch and transformers (~7 s of ~7.5 s for MiniLM on a
2-core host), so one more child is kept started with everything imported and no
model (`runtimes.child_side.server --spare`; no CUDA context either). A death promotes it: it
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

Not waiting for an import (`ready_child(wait=False)`, what the worker's batches ask).
After a failed start (a replacement killed while it loads, say) the next replacement
is the spare started at the promotion, still importing for seconds (~7 on a 2-core
host; without spares, a fresh child, importing and then loading). Rather than leave
the worker's requests unanswered that long, a batch that asks for the runtime while a
failed restart's replacement has not finished importing gets `RestartPending` at once
(with the seconds until it should be ready: `ready_in`, from the starts measured when
each child was connected to, `runtimes.worker_side.start_times`), and the runtime
answers it MODEL_UNAVAILABLE (503). No batch waits for the import: the process imports
on its own, and the runtime's watcher (`runtimes.worker_side.watcher`) promotes it as
soon as it listens (it loads what is resident, a fraction of a second); `changed` tells
the worker when the refusals begin and end. While a promoted spare is still importing,
the next spare waits for it to be up: two imports at once would each take twice as long
on a small host. The starts-in-a-row count survives those refusals, so a runtime that
cannot start still fails with `RuntimeStartError` at its RESTART_ATTEMPTS-th failed
start (then the count starts over: the next batch tries again). After a crash with no
failed start (the spare just promoted, or a bisection's restarts) batches still wait:
the promoted spare is warm, and a bisection must run to blame a poison request.
"""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from batching.pool import LORA_SEPARATOR
from runtimes.base import RuntimeClosed, RuntimeStartError
from runtimes.wire.frames import Load
from runtimes.worker_side.children import describe_exit
from runtimes.worker_side.runtime_child import RuntimeChild
from runtimes.worker_side.start_times import StartTimes

log = logging.getLogger(__name__)

_MAX_SOCKET_PATH = 96  # sun_path holds 107 bytes on Linux; the server adds ".staging"
# Starts in a row (the first after a death, then retries) before a restart gives up:
# two kills landing in one restart are rare; a third failure means it cannot start.
RESTART_ATTEMPTS = 3

__all__ = ["RESTART_ATTEMPTS", "RestartPending", "RuntimeChild", "Supervisor"]


class RestartPending(RuntimeError):
    """A restart already failed and its next replacement is still importing: a batch
    asking for the runtime is not kept waiting for seconds (see the module doc)."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s  # when the replacement should be ready


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
        # Failed starts since the last child that came up (kept across `ready_child`
        # calls: a refusal while the next one imports does not start the count over).
        self._failed_in_a_row = 0
        self._give_ups = 0  # restarts given up so far (a thread that waited meets it too)
        self._last_give_up: RuntimeStartError | None = None
        # A give-up no batch has seen (the watcher's): the next batch fails with it rather
        # than start another restart, so a runtime that cannot start fails clearly.
        self.give_up_owed = False
        self.start_times = StartTimes()  # what a refusal's retry_after_s is made of
        # Called (from any thread, no lock held) when the current child changes or batches
        # start or stop being refused: the watcher wakes, the worker says so in its pool
        # state (`ProcessRuntime.watch_availability`).
        self.changed: Callable[[], None] = lambda: None

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
        self.changed()
        for process in (child, spare):
            if process is not None:
                how = process.stop(grace=1.0)
                log.info("model runtime pid %d%s stopped (%s)", process.pid,
                         " (the spare)" if process is spare else "", how)
        shutil.rmtree(self._dir, ignore_errors=True)

    def ready_child(self, wait: bool = True, watcher: bool = False) -> RuntimeChild:
        """The current child, started (or restarted) and ready for batches. A restart that
        fails is tried again, RESTART_ATTEMPTS starts in a row (see the module doc).
        `wait=False`: raises RestartPending instead of waiting for the import of a failed
        restart's next replacement. `watcher`: asked by the watcher, whose give-up the next
        batch is told of (`give_up_owed`)."""
        if not wait:
            # Before taking _starting: a control call may hold it, waiting for the import.
            self._refuse_while_importing()
        give_ups = self._give_ups
        with self._starting:
            if (self._give_ups != give_ups or self.give_up_owed) \
                    and self._last_give_up is not None:
                # The restart this thread waited for gave up meanwhile (the watcher's, or
                # another batch's), or no batch has seen the watcher's give-up yet: it
                # fails too, rather than start the count over.
                self.give_up_owed = False
                raise RuntimeStartError(str(self._last_give_up))
            while True:
                child = self._child
                if child is not None and child.sock is not None \
                        and child.proc.poll() is not None:
                    # Died between batches: nothing about to run is to blame. (One that
                    # dies before it is up fails its start below, and counts.)
                    self.replace_dead(child, "died while idle", respawn=False)
                    child = None
                if child is None:
                    child = self._replace()
                if child.sock is not None and not child.spare:
                    return child
                if not wait:
                    self._refuse_while_importing()
                try:
                    self._bring_up(child)
                    refused, self._failed_in_a_row = self._failed_in_a_row, 0
                    if refused:
                        self.changed()  # batches are served again
                    return child
                except RuntimeStartError as exc:
                    child.stop(grace=1.0)
                    self._forget(child)
                    if self._closed:
                        raise RuntimeClosed("the runtime was closed while starting") from exc
                    if not self._started_once:
                        raise
                    self.start_failures += 1
                    self._failed_in_a_row += 1
                    if self._failed_in_a_row >= RESTART_ATTEMPTS:
                        log.error("the model runtime failed to start %d times in a row; "
                                  "giving up this restart", self._failed_in_a_row)
                        self._failed_in_a_row = 0  # the next batch tries again
                        self._give_ups += 1
                        self._last_give_up = exc
                        self.give_up_owed = watcher  # no batch sees this one raise
                        self.changed()
                        raise
                    log.warning("restarting the model runtime failed (%s); trying again "
                                "(start %d of %d)", exc, self._failed_in_a_row + 1,
                                RESTART_ATTEMPTS)
                except BaseException:
                    child.stop(grace=1.0)
                    self._forget(child)
                    raise

    def ready_in(self) -> float | None:
        """While batches are refused (a start failed since the last ready child and the
        next one is alive but not done importing): the seconds until it should be ready,
        from the measured starts (`StartTimes`; 1 before any was measured). Else None."""
        return self._ready_in(self._child)

    def _ready_in(self, child: RuntimeChild | None) -> float | None:
        if self._failed_in_a_row == 0 or child is None or child.sock is not None \
                or child.listening() or child.proc.poll() is not None:
            return None
        expected = self.start_times.ready_in(child)
        return 1.0 if expected is None else expected

    def _refuse_while_importing(self) -> None:
        """RestartPending while batches are refused (`ready_in`)."""
        child = self._child
        wait = self._ready_in(child)
        if wait is None or child is None:
            return
        retry_after = max(1, math.ceil(wait))
        raise RestartPending(
            f"the model runtime is restarting: its replacement failed to start and the "
            f"next one (pid {child.pid}) is still importing; retry in about "
            f"{retry_after}s", retry_after)

    def _bring_up(self, child: RuntimeChild) -> None:
        """Connect to a starting child; a promoted spare then loads what is resident."""
        try:
            child.connect(self.start_timeout, lambda: self._closed)
        finally:  # a spare's imports; a fresh child's, and its loads (even if it then dies)
            self.start_times.listened(child)
        if child.spare:
            loading = time.monotonic()
            self._load_resident(child)
            self.start_times.promoted(time.monotonic() - loading)
            child.spare = False
        with self._lock:
            self.resident.update(child.ready.models)
            self.device_bytes = child.ready.device_bytes or self.device_bytes
        self._started_once = True
        if child.replacing_since is not None:
            log.info("model runtime pid %d took over in %.2fs", child.pid,
                     time.monotonic() - child.replacing_since)
        # A spare promoted mid-import deferred the next one until now (see `_replace`).
        self.start_spare()

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
        self.changed()
        # The first child's spare starts once it is ready, and so does the next spare after
        # a promoted one still importing: two imports at once would each take twice as long
        # on a small host, and the callers wait for the first.
        if self._started_once and (spare is None or spare.listening()):
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
            if self._child is not child:
                return
            self._child = None
        self.changed()

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
        self.changed()
        log.warning("model runtime pid %d is gone: %s (%s)", child.pid, how, why)
        if respawn:
            self._replace()
        return how
