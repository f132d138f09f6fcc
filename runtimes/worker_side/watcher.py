"""Notice a runtime child's death when it happens, and bring its replacement up then.

Without a watcher a child that dies between batches (an OOM kill, a stray SIGKILL, a
crash in a background thread) is noticed only when the next batch is sent to it, and
that batch pays the restart. A `ChildWatcher` is one daemon thread per `Supervisor`
that waits on the current child's pidfd (readable once the process has exited) and on a
wake-up pipe (the supervisor's `changed`: the child was replaced, a restart began or
gave up, the runtime closed). When the child dies it calls `Supervisor.ready_child`,
which replaces it (the spare promoted, else a fresh child) and brings the replacement
up, exactly as a batch would have; a batch that comes meanwhile waits for it (or is
refused while a failed restart's replacement imports, as before).

It also brings up a replacement that no thread is waiting for: after a failed restart
the worker's batches are refused while the next child imports, and nothing else would
promote it once it listens; the watcher does, so the runtime serves (and the worker's
pool state says so) as soon as it can, not when a request next arrives.

A death under a running batch is the batch's to settle (restart, bisection): whichever
thread comes first replaces the child, the other finds it replaced
(`Supervisor.replace_dead`). A restart that gives up (RESTART_ATTEMPTS failed starts) is
not retried here: the next batch fails with its error (a runtime that cannot start fails
clearly, as when a batch's own restart gives up), and the one after tries again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import subprocess
import threading

from runtimes.base import RuntimeClosed, RuntimeStartError
from runtimes.worker_side.children import describe_exit
from runtimes.worker_side.runtime_child import RuntimeChild
from runtimes.worker_side.supervisor import RestartPending, Supervisor

log = logging.getLogger(__name__)

IMPORT_POLL_S = 0.05  # how often a failed restart's importing replacement is looked at
# How long the watcher lets another thread finish reaping a child its pidfd says is gone.
REAP_WAIT_S = 1.0


def _serving(child: RuntimeChild) -> bool:
    """Up and connected to (not a spare waiting for its promotion)."""
    return child.sock is not None and not child.spare


class ChildWatcher:
    """The thread that watches `supervisor`'s current child (see the module doc). `close`
    ends it; the supervisor must be closed first (or at once after)."""

    def __init__(self, supervisor: Supervisor, name: str = "shoal-runtime-watcher") -> None:
        self._supervisor = supervisor
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._stopping = False
        self.deaths_noticed = 0  # children found dead by this thread (not by a batch)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Look at the supervisor's child again (any thread; never blocks)."""
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    def close(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self.wake()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            for fd in (self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _run(self) -> None:
        gave_up_on: RuntimeChild | None = None  # a restart given up: wait for a new child
        while not self._stopping and not self._supervisor.closed:
            child = self._supervisor.child
            if child is not None and child is not gave_up_on and not _serving(child):
                # A replacement nobody waits for (a failed restart's, refused meanwhile).
                gave_up_on = None if self._bring_up() else child
                continue
            if child is None or child is gave_up_on:
                self._wait(None)
                continue
            if self._wait(child) and not self._stopping and not self._supervisor.closed:
                self.deaths_noticed += 1
                # Its pidfd says it exited, but poll() reads None while another thread (a
                # batch that lost its connection) holds Popen's waitpid lock: let that
                # thread reap it, or the supervisor takes the dead child for a live one and
                # this loop spins on it, taking the supervisor's lock from that thread.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.proc.wait(REAP_WAIT_S)
                log.warning("model runtime pid %d died between batches (%s); replacing it "
                            "now", child.pid, describe_exit(child.proc.returncode))
                gave_up_on = None if self._bring_up() else self._supervisor.child

    def _bring_up(self) -> bool:
        """The supervisor's child, replaced if dead and brought up: False if that failed
        (the restart gave up, or the runtime closed). Asked as a batch asks
        (`wait=False`): while a failed restart's replacement imports, the supervisor's
        lock is not held (batches meanwhile are refused, not kept waiting behind this
        thread); it asks again once the replacement listens."""
        try:
            while not self._stopping:
                try:
                    self._supervisor.ready_child(wait=False, watcher=True)
                    return True
                except RestartPending:
                    self._await_import()
            return False
        except RuntimeClosed:
            return False
        except RuntimeStartError as exc:
            log.error("bringing the model runtime back failed; the next batch fails with "
                      "this, the one after tries again: %s", exc)
            return False
        except Exception:
            log.exception("bringing the model runtime back failed")
            return False

    def _await_import(self) -> None:
        """Until the importing replacement listens, dies, or the runtime closes. Polled
        (every IMPORT_POLL_S; a file appearing wakes no select): only during a failed
        restart, and what the refused batches wait for is the import, seconds."""
        while not self._stopping and not self._supervisor.closed:
            child = self._supervisor.child
            if child is None or child.listening() or self._supervisor.ready_in() is None:
                return
            if self._wait(child, IMPORT_POLL_S):
                return  # it died: the supervisor's next start counts it

    def _wait(self, child: RuntimeChild | None, timeout: float | None = None) -> bool:
        """Wait for `child` to exit (True) or a wake-up or `timeout` (False); `child` None:
        a wake-up."""
        pidfd = None
        if child is not None:
            if child.proc.poll() is not None:
                return True
            try:
                pidfd = os.pidfd_open(child.pid)
            except ProcessLookupError:  # exited and reaped meanwhile
                return True
        try:
            fds = [self._wake_r] if pidfd is None else [self._wake_r, pidfd]
            ready, _, _ = select.select(fds, [], [], timeout)
            if self._wake_r in ready:
                with contextlib.suppress(BlockingIOError, OSError):
                    os.read(self._wake_r, 4096)
            return pidfd is not None and pidfd in ready
        finally:
            if pidfd is not None:
                os.close(pidfd)
