"""A runtime whose models live in a child process, so that the worker survives them.

The child (`python -m runtimes.server`) is spawned, never forked, and reached
over a private Unix socket with msgpack frames. A segfault, an OOM kill, a
CUDA error or an exception in the model ends at most that child; the worker
restarts it and finds which request is to blame.

Restart and bisect policy. When a batch fails (the child dies, or replies
that the batch raised), it is split in halves and each half is run again
(after a restart if the child died), recursively. A request is blamed, with
POISON_INPUT, only when it fails *run alone after a batch containing it
failed*: two failures, the second with nothing else in the batch. So:

* an external kill (OOM killer, SIGKILL) during a batch costs one restart and
  the halves then succeed: every request gets its normal result. A lone
  request gets the same chance: its first failure is retried once.
* a poison request costs log2(batch) + 1 failures (restarts, for crashes),
  with no separate whole-batch retry: the halves already are the retry.
* a batch too big for device memory is split until it fits.

Before blaming a request, the runtime must have shown that it works: some
part of the batch succeeded after the first failure, or else the model's
probe is answered. The probe is a small request of the model's own
operation that its adapter must answer whenever it works
(`Adapter.probe`, sent as a probe frame, see `runtimes.server`). If it
fails too, or is refused, the runtime is not shown to work whatever the
input, and `run_batch` raises `RuntimeUnhealthy` rather than blaming
anyone. (Usually the other parts are the evidence, so the batch's replies
need not wait for the last restart.)

A batch that gets no reply within `batch_timeout` (when one is set) is a
hang: the child is killed and the batch bisected as after a crash. Without
a timeout a hung model blocks the calling thread, and the caller's
deadline is all that ends the wait. After a death the next child is
spawned at once (without waiting for it), so it loads while the batch's
replies go out.

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

Two batches in flight (`pipeline_depth`, the worker's SHOAL_RUNTIME_PIPELINE_DEPTH):
the child prepares the second while its device computes the first. A crash then
fails both; each is bisected on its own, on the next child, its frames sent alone from
its first failure on (nothing else in flight), so a request is still blamed only for a
failure of its own and every other request gets its result. A streamed batch and a
probe go alone (they talk back and forth on the connection).

Streams: a batch with streamed requests sends their deltas as it goes (see
`runtimes.server`). A request whose output has begun to go out is never run
again after a failure (its caller would read the beginning twice): it is
answered STREAM_INTERRUPTED, and only the rest of the batch is bisected.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from runtimes.base import Delta, OnDeltas, Outcome, Request
from runtimes.children import OutputTail, describe_exit
from runtimes.footprint import UNKNOWN_BYTES, estimate_bytes
from runtimes.pool import LORA_SEPARATOR, keys_of, lora_key
from runtimes.protocol import PROBE_ID, FrameTooLarge, ProtocolError, encode_frame, recv_frame
from runtimes.sources import resolve_source
from tasks.catalog import load_catalog
from tasks.errors import ErrorCode

log = logging.getLogger(__name__)

_MAX_SOCKET_PATH = 96  # sun_path holds 107 bytes on Linux; the server adds ".staging"
# Starts in a row (the first after a death, then retries) before a restart gives up:
# two kills landing in one restart are rare; a third failure means it cannot start.
RESTART_ATTEMPTS = 3
_SOURCE_ROOT = str(Path(__file__).resolve().parent.parent)


class RuntimeStartError(RuntimeError):
    """The runtime process did not become ready (its output tail is in the message)."""


class RuntimeClosed(RuntimeError):
    """The runtime was closed; it runs nothing more."""


class RuntimeUnhealthy(RuntimeError):
    """The runtime fails whatever the input, so no request of the batch is to blame."""


class LoadFailed(RuntimeError):
    """A model could not be loaded (the reason is the message); the runtime still serves
    the models it had."""


@dataclass(slots=True)
class _Call:
    """One `run_batch` call's state through its bisection."""

    on_deltas: OnDeltas | None
    streamed: set[str] = field(default_factory=set)  # its requests whose deltas went out
    works_after_failure: bool = False  # part of it succeeded after a failure; see _blame
    # Failed once: its frames from now on go alone. With another batch in flight a crash
    # fails both, and only a failure with nothing else in flight blames a request.
    alone: bool = False


class _Stale(ConnectionError):
    """A frame was not sent, or its reply not read, because one before it on the
    connection failed: the child never ran it alone, so its failure is no evidence."""


class _Turn:
    """A frame's place in its connection's order of replies."""

    def __init__(self, turns: _Turns, ticket: int) -> None:
        self._turns, self._ticket = turns, ticket

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Wait until the replies before this frame's are read, then read it (the block)."""
        turns = self._turns
        with turns.changed:
            turns.changed.wait_for(lambda: turns.read == self._ticket)
        try:
            if turns.broken:
                raise _Stale("an earlier frame on this connection failed")
            yield
        except BaseException:
            # What comes next on the connection may be the reply this one did not read
            # (late after a timeout): nobody reads it; the child is replaced.
            turns.broken = True
            raise
        finally:
            turns.done()


class _Turns:
    """The frames in flight on one batch connection, answered in the order sent."""

    def __init__(self) -> None:
        self._sending = threading.Lock()
        self.changed = threading.Condition()
        self.sent = 0
        self.read = 0
        self.broken = False  # a frame failed: the replies no longer match the frames

    @contextlib.contextmanager
    def send(self, alone: bool) -> Iterator[_Turn]:
        """Send a frame (the block); `alone`: first wait until nothing is in flight, and
        keep others from sending until the block ends (its replies are read in it)."""
        with self._sending:
            if alone:
                with self.changed:
                    self.changed.wait_for(lambda: self.read == self.sent)
            if self.broken:
                raise _Stale("an earlier frame on this connection failed")
            ticket = self.sent
            self.sent += 1
            try:
                yield _Turn(self, ticket)
            except BaseException:
                # Nothing or part was sent: the connection is broken and the child is
                # replaced; let the frames behind this one read (and fail) in turn.
                self.broken = True
                with self.changed:
                    self.changed.wait_for(lambda: self.read == ticket)
                self.done()
                raise
            if alone:
                self.done()

    def done(self) -> None:
        with self.changed:
            self.read += 1
            self.changed.notify_all()


@dataclass(frozen=True, slots=True)
class _Failure:
    kind: Literal["crash", "hang", "exception"]
    detail: str


class _Child:
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
        self.turns = _Turns()  # the batches in flight on it
        self.control: socket.socket | None = None  # loads and unloads, beside batches
        self.ready: dict[str, Any] = {}  # the ready frame
        assert self.proc.stdout is not None
        # The child's logs go to the worker's stderr; the tail explains a failed start.
        self.output = OutputTail(self.proc.stdout, f"runtime-{self.pid}-output", 40)

    def output_tail(self) -> str:
        return self.output.text()

    def listening(self) -> bool:
        """Its start-up (a spare's imports) is done and it waits for its worker."""
        return self.sock is not None or self.socket_path.exists()

    def load(self, frame: dict[str, Any], timeout: float) -> dict[str, Any]:
        """One load on the control connection of a promoted spare (raises
        RuntimeStartError if it fails or the process dies meanwhile)."""
        assert self.control is not None
        doing = f"loading {frame['model']}" + (f" (LoRA {frame['lora']})" if frame["lora"]
                                                 else "")
        try:
            self.control.settimeout(max(timeout, 1.0))
            self.control.sendall(encode_frame(frame))
            reply = recv_frame(self.control)
            self.control.settimeout(None)
        except (OSError, EOFError, ProtocolError) as exc:
            self.proc.poll()
            raise RuntimeStartError(
                f"the model runtime (pid {self.pid}) failed while {doing} "
                f"({describe_exit(self.proc.returncode)}: {exc!r}); its last output:\n"
                f"{self.output_tail()}") from exc
        if not isinstance(reply, dict) or "loaded" not in reply:
            why = reply.get("failed") or reply.get("error") if isinstance(reply, dict) \
                else None
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
            ready = recv_frame(sock)
            sock.settimeout(None)
        except (OSError, EOFError, ProtocolError) as exc:
            sock.close()
            control.close()
            if closed():
                raise RuntimeClosed("the runtime was closed while starting") from exc
            raise RuntimeStartError(
                f"the model runtime (pid {self.pid}) failed while connecting: {exc!r}; "
                f"its last output:\n{self.output_tail()}"
            ) from exc
        if not isinstance(ready, dict) or ready.get("ready") != self.pid:
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


class ProcessRuntime:
    """`runtimes.base.Runtime` backed by a child process; see the module doc for the policy.

    `run_batch` is called from up to `pipeline_depth` threads at a time (their batches
    share the connection and are answered in the order sent; each bisects its own on a
    failure), `load` and `unload` from one other thread (they run beside batches);
    `close` may come from any thread. Counters for metrics: `restarts` (replacement
    children, spawned or promoted, failed starts included), `poison_isolated`,
    `spare_promotions`, `start_failures`; `pid` is the current child's, `spare_pid` the
    spare's.

    `models` load at start. A child that replaces a dead one loads every model resident
    in its predecessor (`resident`) before it is ready, so that what the worker believes
    loaded stays loaded. With `spare`, a spare child is kept imported ahead to be that
    replacement (see the module doc).
    """

    def __init__(
        self,
        catalog_dir: Path | str,
        models: list[str],
        device: str = "cpu",
        threads: int = 0,
        chunk_tokens: int = 16_384,
        start_timeout: float = 300.0,
        env: Mapping[str, str] | None = None,
        batch_timeout: float | None = None,
        spare: bool = False,
        precision: str | None = None,
        pipeline_depth: int = 2,
    ) -> None:
        self.resident: dict[str, int] = dict.fromkeys(models, 0)  # model -> measured bytes
        self.device_bytes: int | None = None  # the device's memory, from the child
        self.start_timeout = start_timeout
        # Batches `run_batch` may be running at once (from as many threads): the child
        # computes one while it prepares the next (`runtimes.pipeline`).
        self.pipeline_depth = pipeline_depth
        self._catalog_dir = catalog_dir
        # A model that hangs (a deadlocked kernel, a stuck device) is killed
        # after this long and treated like a crash: restart, then bisect.
        self.batch_timeout = batch_timeout
        self.restarts = 0
        self.poison_isolated = 0
        self.spare_promotions = 0  # restarts that promoted the spare
        self.start_failures = 0  # replacements that failed to start (and were retried)
        self._use_spare = spare
        self._argv = [
            sys.executable, "-m", "runtimes.server",
            "--catalog-dir", str(catalog_dir), "--device", device,
            "--threads", str(threads), "--chunk-tokens", str(chunk_tokens),
            "--parent-pid", str(os.getpid()),
            *(["--precision", precision] if precision else []),
        ]
        # OpenMP threads that spin between ops steal the cores the worker,
        # gateway and broker need on a CPU host: measured on 2 cores, passive
        # waiting cut the runtime's CPU per sentence from ~10 ms to ~6.5 ms.
        # The child is spawned and never forks, so its fast tokenizers may encode a batch
        # on several threads (the usual `false` guards processes that fork after using
        # one): tokenizing is most of the runtime's CPU per text.
        self._env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ,
                     "TOKENIZERS_PARALLELISM": "true", **(env or {}), "PYTHONUNBUFFERED": "1"}
        # The child imports the very code the worker runs, installed or not.
        self._env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_SOURCE_ROOT, self._env.get("PYTHONPATH")) if p
        )
        self._dir = Path(tempfile.mkdtemp(prefix="shoal-runtime-"))  # mode 0700: private
        self._lock = threading.Lock()  # guards _child, _closed and resident
        self._starting = threading.Lock()  # one thread spawns and connects a child
        self._controlling = threading.Lock()  # one load or unload at a time
        self._closed = False
        self._child: _Child | None = None
        self._spare: _Child | None = None
        self._spawned = 0  # children and spares started (names their sockets)
        self._started_once = False  # a child was ready once: later starts are restarts
        self._cancelled: set[str] = set()  # requests of running batches whose callers left
        self._running: set[str] = set()  # the running batches' request ids
        try:
            self._ready_child()
            # Only now: on a small host its imports would slow the first start.
            self._start_spare()
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int | None:
        child = self._child
        return child.pid if child is not None else None

    @property
    def spare_pid(self) -> int | None:
        """The spare's process (None: no spare now, or spares are off)."""
        spare = self._spare
        return spare.pid if spare is not None else None

    def spare_ready(self) -> bool:
        """A spare is alive and done importing: a death now costs only the model loads."""
        spare = self._spare
        return spare is not None and spare.proc.poll() is None and spare.listening()

    def __enter__(self) -> ProcessRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- Runtime ----------------------------------------------------------------------

    def run_batch(self, model_id: str, requests: list[Request],
                  on_deltas: OnDeltas | None = None) -> list[Outcome]:
        if not requests:
            return []
        call = _Call(on_deltas if any(r.stream for r in requests) else None)
        ids = {r.id for r in requests}
        with self._lock:
            self._running |= ids
        try:
            return self._run(call, model_id, requests, failed_before=False)
        finally:
            with self._lock:
                self._running -= ids
                self._cancelled -= ids

    def cancel(self, request_ids: list[str]) -> None:
        """The next step of the running batch drops these requests' rows (any thread); ids
        of no running request are ignored."""
        with self._lock:
            self._cancelled.update(i for i in request_ids if i in self._running)

    def continuous(self, model_id: str) -> bool:
        return False

    def estimate_bytes(self, model: str, lora: str | None = None) -> int:
        """What `model` (or its LoRA adapter `lora`) should take once loaded, from its
        weight files (read here, in the worker: nothing is loaded or downloaded)."""
        entry = load_catalog(self._catalog_dir).get(model)
        source = None if entry is None else entry.source if lora is None \
            else entry.loras.get(lora)
        try:
            return estimate_bytes(resolve_source(source, local_only=True)) if source \
                else UNKNOWN_BYTES
        except Exception:  # not downloaded yet, or unreadable: the load will say
            return UNKNOWN_BYTES

    def load(self, model: str, lora: str | None = None) -> int:
        """Load `model` (or its LoRA adapter `lora`) in the child beside the batches that
        run meanwhile: the device bytes it takes. LoadFailed if it cannot (the child
        survives a bad model; if the load kills it, the next child starts without it)."""
        key = model if lora is None else lora_key(model, lora)
        reply = self._control({"op": "load", "model": model, "lora": lora}, f"loading {key}")
        if "loaded" not in reply:
            raise LoadFailed(str(reply.get("failed") or reply.get("error") or reply))
        with self._lock:
            self.resident[key] = int(reply["bytes"])
        return int(reply["bytes"])

    def unload(self, model: str, lora: str | None = None) -> None:
        """Free a model and its LoRA adapters, or only its adapter `lora`."""
        with self._lock:
            if lora is not None:
                self.resident.pop(lora_key(model, lora), None)
            else:
                for key in keys_of(model, self.resident):
                    del self.resident[key]
        self._control({"op": "unload", "model": model, "lora": lora},
                      f"unloading {model if lora is None else lora_key(model, lora)}")

    def _control(self, frame: dict[str, Any], doing: str) -> dict[str, Any]:
        with self._controlling:
            child = self._ready_child()
            assert child.control is not None
            try:
                child.control.sendall(encode_frame(frame))
                reply = recv_frame(child.control)
            except (OSError, EOFError, ProtocolError) as exc:
                how = self._replace_dead(child, f"control connection lost: {exc}")
                raise LoadFailed(f"the model runtime died while {doing} ({how})") from exc
        if not isinstance(reply, dict):
            raise LoadFailed(f"unexpected reply from the model runtime: {reply!r:.200}")
        return reply

    def close(self) -> None:
        """Stop the child and the spare (mid-batch too: the batch raises RuntimeClosed)."""
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

    # --- bisection --------------------------------------------------------------------

    def _run(self, call: _Call, model: str, requests: list[Request], failed_before: bool
             ) -> list[Outcome]:
        result = self._call(call, model, requests)
        if not isinstance(result, _Failure):
            if failed_before and any(o.ok for o in result):
                call.works_after_failure = True
            return result
        call.alone = True
        if call.streamed.intersection(r.id for r in requests):
            return self._interrupted(call, model, requests, result)
        if len(requests) > 1:
            log.warning("batch of %d requests for %s failed (%s: %s); splitting it",
                        len(requests), model, result.kind, result.detail)
            mid = len(requests) // 2
            return (self._run(call, model, requests[:mid], failed_before=True)
                    + self._run(call, model, requests[mid:], failed_before=True))
        if not failed_before:
            # A lone request's first failure may not be its fault (an OOM kill): once more.
            log.warning("request %s for %s failed alone (%s: %s); retrying it once",
                        requests[0].id, model, result.kind, result.detail)
            return self._run(call, model, requests, failed_before=True)
        return [self._blame(call, model, requests[0], result)]

    def _interrupted(self, call: _Call, model: str, requests: list[Request],
                     failure: _Failure) -> list[Outcome]:
        """A failed batch in which some requests had streamed: they end here, the rest
        run again (bisected, as any failed batch)."""
        outcomes: dict[str, Outcome] = {}
        rest = []
        for request in requests:
            if request.id in call.streamed:
                outcomes[request.id] = Outcome(
                    request.id, error_code=str(ErrorCode.STREAM_INTERRUPTED),
                    error_message=f"the model runtime failed ({failure.kind}: "
                                  f"{failure.detail}) after part of this request's output "
                                  "was streamed; that part stands, the rest will not come "
                                  "(retry the request)")
            else:
                rest.append(request)
        if rest:
            outcomes.update((o.id, o) for o in self._run(call, model, rest, failed_before=True))
        return [outcomes[r.id] for r in requests]

    def probe(self, model: str) -> str | None:
        """Run the model's probe: None when it was answered, else what went wrong."""
        result = self._exchange(_Call(None), {"op": "probe", "model": model}, [PROBE_ID])
        if isinstance(result, _Failure):
            return f"{result.kind}: {result.detail}"
        (outcome,) = result
        if not outcome.ok:
            # A refused probe proves nothing either way (and is a bug in the adapter's probe).
            return f"the probe was refused: {outcome.error_code}: {outcome.error_message}"
        return None

    def _blame(self, call: _Call, model: str, request: Request, failure: _Failure) -> Outcome:
        problem = None if call.works_after_failure else self.probe(model)
        if problem is not None:
            raise RuntimeUnhealthy(
                f"the model runtime for {model} fails even on a known-good request "
                f"({problem}); request {request.id} is not blamed"
            )
        self.poison_isolated += 1
        if failure.kind == "crash":
            message = f"this request crashed the model runtime ({failure.detail})"
        elif failure.kind == "hang":
            message = f"this request hung the model runtime ({failure.detail})"
        else:
            message = f"inference failed on this request: {failure.detail}"
        log.error("request %s for %s isolated as poison: %s", request.id, model, message)
        return Outcome(
            request.id, error_code=str(ErrorCode.POISON_INPUT),
            error_message=f"{message}; it failed alone, after failing its batch, and is not "
                          "retried (the other requests of the batch were run without it)",
        )

    # --- one round trip ---------------------------------------------------------------

    def _call(self, call: _Call, model: str, requests: list[Request]
              ) -> list[Outcome] | _Failure:
        frame = {"op": "run", "model": model, "deltas": call.on_deltas is not None,
                 "requests": [{"id": r.id, "op": r.op, "kwargs": r.kwargs, "stream": r.stream}
                              for r in requests]}
        return self._exchange(call, frame, [r.id for r in requests])

    def _exchange(self, call: _Call, frame: dict[str, Any], ids: list[str]
                  ) -> list[Outcome] | _Failure:
        """Send a run or probe frame; the outcomes (for `ids`, in order) or how it failed.

        Batches from several threads share the connection (the child answers them in
        the order they came, `runtimes.pipeline`): each waits for its turn to read. A
        frame that talks back (a stream's deltas) or must run alone (a probe) waits
        until nothing else is in flight and keeps the connection for its exchange."""
        try:
            payload = encode_frame(frame)
        except FrameTooLarge as exc:  # nothing was sent; halves may fit
            return _Failure("exception", str(exc))
        alone = call.alone or bool(frame.get("deltas")) or frame.get("op") == "probe"
        while True:
            child = self._ready_child()
            try:
                return self._send(call, child, payload, alone, ids)
            except _Stale as exc:
                # Another frame's failure broke the connection first: on the next child.
                self._replace_dead(child, f"connection lost: {exc}")

    def _send(self, call: _Call, child: _Child, payload: bytes, alone: bool, ids: list[str]
              ) -> list[Outcome] | _Failure:
        """One frame's exchange on `child` (see `_exchange`)."""
        assert child.sock is not None
        try:
            with child.turns.send(alone) as turn:
                child.sock.settimeout(self.batch_timeout)
                child.sock.sendall(payload)
                if alone:
                    reply = self._converse(call, child, ids)
            if not alone:
                with turn.reading():
                    reply = recv_frame(child.sock)
        except TimeoutError:
            why = f"no answer within the {self.batch_timeout:g}s batch timeout"
            self._replace_dead(child, why)
            return _Failure("hang", why)
        except _Stale:
            raise
        except (OSError, EOFError, ProtocolError) as exc:
            return _Failure("crash", self._replace_dead(child, f"connection lost: {exc}"))
        if isinstance(reply, dict) and "outcomes" in reply:
            return self._outcomes(child, reply["outcomes"], ids)
        if isinstance(reply, dict) and "failed" in reply:
            if reply.get("fatal"):
                return _Failure("crash", f"{reply['failed']}, then "
                                         f"{self._replace_dead(child, 'fatal device error')}")
            return _Failure("exception", str(reply["failed"]))
        self._replace_dead(child, "protocol error")
        raise RuntimeError(f"unexpected reply from the model runtime: {reply!r:.300}")

    def _converse(self, call: _Call, child: _Child, ids: list[str]) -> Any:
        """The replies to a frame sent alone, up to its last: a stream's deltas, each
        answered with the cancels since."""
        assert child.sock is not None
        reply = recv_frame(child.sock)
        while isinstance(reply, dict) and "deltas" in reply:
            self._forward(call, reply["deltas"])
            with self._lock:
                cancel = [i for i in ids if i in self._cancelled]
            child.sock.sendall(encode_frame({"cancel": cancel}))
            reply = recv_frame(child.sock)
        return reply

    def _forward(self, call: _Call, raw: Any) -> None:
        """Hand a step's deltas to the batch's `on_deltas` (the batch timeout then applies
        to each step, not to the whole stream)."""
        try:
            deltas = [Delta(str(d[0]), int(d[1]), str(d[2]), int(d[3])) for d in raw]
        except (TypeError, ValueError, IndexError):
            log.error("malformed deltas from the model runtime dropped: %r", raw)
            return
        call.streamed.update(d.id for d in deltas)
        if call.on_deltas is not None:
            try:
                call.on_deltas(deltas)
            except Exception:  # the worker's side of a stream must not fail the batch
                log.exception("delivering %d deltas failed", len(deltas))

    def _outcomes(self, child: _Child, raw: Any, ids: list[str]) -> list[Outcome]:
        try:
            outcomes = [
                Outcome(str(o["id"]), o.get("result"), o.get("error_code"),
                        o.get("error_message"), o.get("stats") or {})
                for o in raw
            ]
            ok = [o.id for o in outcomes] == ids
        except (TypeError, KeyError, AttributeError):
            ok = False
        if not ok:
            self._replace_dead(child, "protocol error")
            raise RuntimeError(f"the model runtime answered other requests: {raw!r:.300}")
        return outcomes

    # --- the child's life -------------------------------------------------------------

    def _ready_child(self) -> _Child:
        """The current child, started (or restarted) and ready for batches. A restart that
        fails is tried again, RESTART_ATTEMPTS starts in all (see the module doc)."""
        with self._starting:
            attempt = 1
            while True:
                child = self._child
                if child is not None and child.proc.poll() is not None:
                    # Died between batches: nothing about to run is to blame.
                    self._replace_dead(child, "died while idle", respawn=False)
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

    def _bring_up(self, child: _Child) -> None:
        """Connect to a starting child; a promoted spare then loads what is resident."""
        child.connect(self.start_timeout, lambda: self._closed)
        if child.spare:
            self._load_resident(child)
            child.spare = False
        with self._lock:
            self.resident.update(child.ready.get("models") or {})
            self.device_bytes = child.ready.get("device_bytes") or self.device_bytes
        self._started_once = True
        if child.replacing_since is not None:
            log.info("model runtime pid %d took over in %.2fs", child.pid,
                     time.monotonic() - child.replacing_since)

    def _load_resident(self, child: _Child) -> None:
        """Load into a promoted spare what its predecessor had: the models, then their LoRA
        adapters (the bytes each takes are measured again)."""
        with self._lock:
            keys = list(self.resident)
        ordered = [k for k in keys if LORA_SEPARATOR not in k] + \
                  [k for k in keys if LORA_SEPARATOR in k]
        deadline = time.monotonic() + self.start_timeout
        for key in ordered:
            model, _, lora = key.partition(LORA_SEPARATOR)
            reply = child.load({"op": "load", "model": model, "lora": lora or None},
                               deadline - time.monotonic())
            with self._lock:
                if key in self.resident:  # not unloaded meanwhile
                    self.resident[key] = int(reply["bytes"])

    def _replace(self) -> _Child:
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
            self._start_spare()
        return child

    def _start_spare(self) -> None:
        """Start a spare, unless spares are off or one exists."""
        with self._lock:
            if not self._use_spare or self._closed or self._spare is not None:
                return
            path = self._socket_path()
            self._spare = _Child([*self._argv, "--spare", "--socket", str(path)],
                                 self._env, path, spare=True)
            log.info("spare model runtime pid %d starting", self._spare.pid)

    def _socket_path(self) -> Path:
        self._spawned += 1
        path = self._dir / f"rt-{self._spawned}.sock"
        if len(str(path)) > _MAX_SOCKET_PATH:
            raise RuntimeStartError(f"socket path {path} is too long; set TMPDIR shorter")
        return path

    def _spawn(self) -> _Child:
        """A fresh child that loads the resident models before it is ready (under _lock)."""
        path = self._socket_path()
        models = [arg for key in self.resident
                  for arg in ("--lora" if LORA_SEPARATOR in key else "--model", key)]
        self._child = _Child([*self._argv, *models, "--socket", str(path)], self._env, path)
        return self._child

    def _forget(self, child: _Child) -> None:
        with self._lock:
            if self._child is child:
                self._child = None

    def _replace_dead(self, child: _Child, why: str, respawn: bool = True) -> str:
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
