"""The model runtime process: loads models, then serves batches over a Unix socket.

    python -m runtimes.child_side.server --socket PATH --catalog-dir DIR [--model ID ...]
        [--device cpu] [--threads N] [--chunk-tokens N] [--precision fp32|fp16|bf16|int8]
        [--parent-pid PID] [--spare] [--engine NAME]

Started by `runtimes.worker_side.process.ProcessRuntime`, never forked from the worker
(CUDA cannot be initialised again in a forked child). The socket appears only
once every `--model` is loaded, so its existence means "ready". It accepts two
connections from its worker, batches first, then control, and exits when the
batch connection closes or the parent dies. Loads and unloads come on the
control connection (`runtimes.child_side.control`) and run on a thread of their own, beside
the batches of the models already loaded; so do cancels (requests whose callers left), read
at once even while a load runs: a batch's requests cancelled (or past their deadline)
before it reaches the device are dropped from it, and one with none left skips it
(`runtimes.child_side.host.ModelHost.forward`). `--engine` is one of the
registry's that compute in this process (`tasks.engines`). The frames on both connections,
and what answers each, are `runtimes.wire.frames` (length-prefixed by `runtimes.wire.protocol`);
once both connections are accepted it sends `Ready` on the batch connection.

`--spare` (no `--model`): a process kept ready to replace a runtime that dies. It
makes every import a model load needs (its engine's library and `imports`, the catalog's
adapter modules) before its socket appears, on a thread of lowered CPU priority so that it
yields to the runtime that serves meanwhile, then runs its engine's `warm`; then it waits
for its worker, touching no device (on CUDA a context is made only by the first load, once
promoted), and its ready frame has no `device_bytes`. Promoted, it is told what to load on
the control connection.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from runtimes.base import Delta, Request
from runtimes.child_side.control import serve_control
from runtimes.child_side.pipeline import (
    EXIT_FATAL,
    Pipeline,
    failed_reply,
    outcomes_reply,
    reply_bytes,
)
from runtimes.wire.frames import (
    BATCH_REQUEST_DECODER,
    CANCEL_DECODER,
    BatchRequest,
    Cancel,
    Deltas,
    Frame,
    Ping,
    Pong,
    Probe,
    Ready,
    Rejected,
    Run,
    StreamDelta,
)
from runtimes.wire.protocol import (
    PROBE_ID,
    ConnectionClosed,
    MalformedFrame,
    ProtocolError,
    encode_frame,
    recv_frame,
)
from tasks import engines, tracing
from tasks.catalog import Catalog, load_catalog

if TYPE_CHECKING:
    from runtimes.child_side.host import ModelHost

log = logging.getLogger("runtimes.child_side.server")


def engine_imports(engine: str) -> list[str]:
    """What loading a model of `engine` imports (a spare or an idle runtime makes it ahead):
    the host, and the heavy modules its registry entry names."""
    return ["runtimes.child_side.host", *engines.engine(engine).imports]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m runtimes.child_side.server")
    parser.add_argument("--socket", required=True, type=Path)
    parser.add_argument("--catalog-dir", required=True, type=Path)
    parser.add_argument("--model", action="append", dest="models", default=[],
                        help="a model to load before the socket appears (repeatable)")
    parser.add_argument("--lora", action="append", dest="loras", default=[],
                        help="MODEL:LORA, a LoRA adapter of a --model to load (repeatable)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--chunk-tokens", type=int, default=16_384)
    parser.add_argument("--precision", choices=["fp32", "fp16", "bf16", "int8"], default=None,
                        help="every model's forward in this format (default: each entry's "
                             "profile, else the device's: runtimes.model_files.precision)")
    parser.add_argument("--engine", choices=engines.names("process"), default=engines.DEFAULT,
                        help="what computes: an engine of tasks.engines that runs in this "
                             "process (PyTorch, ONNX Runtime: never imports torch)")
    parser.add_argument("--host-bytes", type=int, default=0,
                        help="host memory that keeps unloaded models for a cheaper reload "
                             "(the host-memory tier, runtimes.child_side.host_tier; 0: off)")
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="exit when this process is no longer our parent")
    parser.add_argument("--spare", action="store_true",
                        help="import ahead, touch no device, and wait to be told what to load")
    return parser.parse_args(argv)


def _exit_with_parent(parent_pid: int) -> None:
    """Exit when the parent dies, even while the main thread is busy loading or computing.

    getppid polling rather than PR_SET_PDEATHSIG: the latter fires when the
    parent *thread* that started us exits, and workers start runtimes from
    pool threads.
    """

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(0)  # nobody is left to answer; don't run exit handlers mid-batch

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _accept(path: Path, count: int) -> list[socket.socket]:
    """Listen at `path` (made visible atomically), accept `count` connections of the
    worker in order, remove the path."""
    staging = path.with_name(path.name + ".staging")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        staging.unlink(missing_ok=True)
        listener.bind(str(staging))
        listener.listen(count)
        # Renamed only once listening, so a client that sees the path can connect.
        os.replace(staging, path)
        return [listener.accept()[0] for _ in range(count)]
    finally:
        listener.close()
        path.unlink(missing_ok=True)


def probe(host: ModelHost, model: str) -> list[Request]:
    """The model's health check: its adapter knows a request it must answer when it works
    (an unknown model gets one that is answered MODEL_NOT_FOUND)."""
    adapter = host.adapter(model)
    if adapter is None:
        return [Request(PROBE_ID, "", {})]
    return [Request(PROBE_ID, adapter.operation, adapter.probe())]


class WorkerGone(Exception):
    """The worker's end of a streamed batch closed: the batch is abandoned."""


def _delta_sender(conn: socket.socket, host: ModelHost) -> Callable[[list[Delta]], None]:
    def send(deltas: list[Delta]) -> None:
        try:
            conn.sendall(encode_frame(Deltas([StreamDelta(d.id, d.index, d.text, d.tokens)
                                              for d in deltas])))
            reply: Cancel = recv_frame(conn, CANCEL_DECODER)
        except MalformedFrame:
            return  # not a cancel: nothing to stop
        except (OSError, EOFError, ProtocolError) as exc:
            raise WorkerGone(repr(exc)) from exc
        if reply.ids:
            host.cancel(reply.ids)

    return send


def requests_of(frame: Run) -> list[Request]:
    return [Request(r.id, r.op, r.kwargs, r.stream, r.deadline_ms, frame.trace)
            for r in frame.requests]


def handle(host: ModelHost, frame: BatchRequest, conn: socket.socket | None = None
           ) -> tuple[Frame, bool]:
    """The reply to one frame, and whether the process must exit after sending it."""
    if isinstance(frame, Ping):
        return Pong(os.getpid()), False
    model = frame.model
    requests = probe(host, model) if isinstance(frame, Probe) else requests_of(frame)
    on_deltas = (_delta_sender(conn, host)
                 if conn is not None and isinstance(frame, Run) and frame.deltas else None)
    try:
        outcomes = host.run_batch(model, requests, on_deltas)
    except WorkerGone:
        raise  # nobody is left to answer
    except Exception as exc:
        return failed_reply(exc, host.device, len(requests), model)
    return outcomes_reply(outcomes), False


def batch_of(frame: BatchRequest) -> tuple[str, list[Request]] | None:
    """The model and requests of a run frame the pipeline takes (no deltas to talk back);
    None for any other frame (answered by `handle`, alone)."""
    if not isinstance(frame, Run) or frame.deltas:
        return None
    return frame.model, requests_of(frame)


def read_request(conn: socket.socket) -> BatchRequest | Rejected:
    """The next frame on the batch connection, or for one it does not take (a whole frame,
    read: the connection stays in step) the answer to it."""
    try:
        return recv_frame(conn, BATCH_REQUEST_DECODER)
    except MalformedFrame as exc:
        return Rejected(str(exc))


def serve(conn: socket.socket, host: ModelHost) -> int:
    """Answer frames until the worker hangs up; the process exit code. Batches go through
    the pipeline (`runtimes.child_side.pipeline`); any other frame waits until it is empty."""
    pipeline = Pipeline(conn, host)
    while True:
        try:
            frame = read_request(conn)
        except (ConnectionClosed, OSError):
            log.info("the worker closed the connection; exiting")
            return 0
        if isinstance(frame, Rejected):  # answered in its turn; nothing runs
            pipeline.idle()
            reply: Frame = frame
            fatal = False
        else:
            batch = batch_of(frame)
            if batch is not None:
                pipeline.submit(*batch)
                continue
            pipeline.idle()
            try:
                reply, fatal = handle(host, frame, conn)
            except WorkerGone:
                log.info("the worker closed the connection mid-stream; exiting")
                return 0
        try:
            conn.sendall(reply_bytes(reply))
        except OSError:
            log.info("the worker went away before the reply; exiting")
            return 0
        if fatal:
            log.error("the device is unusable after that error; exiting so a fresh runtime starts")
            return EXIT_FATAL


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    _exit_with_parent(args.parent_pid or os.getppid())
    tracing.setup("runtime")  # if the worker's environment turns tracing on
    faulthandler.enable()  # a segfault still prints the Python stack to stderr
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr,
        format="%(asctime)s runtime[%(process)d] %(levelname)s %(name)s: %(message)s",
    )
    # The catalog is checked before torch is imported: a wrong entry fails in
    # a fraction of a second instead of after seconds of imports.
    catalog = load_catalog(args.catalog_dir)
    entries = catalog.require(args.models)
    if args.spare:
        _import_ahead(catalog, args.engine)
    from runtimes.child_side.host import ModelHost

    host = ModelHost(device=args.device, threads=args.threads, chunk_tokens=args.chunk_tokens,
                     precision=args.precision, engine=args.engine, host_bytes=args.host_bytes)
    if args.spare:
        host.engine.warm()
    host.load(entries)
    for key in args.loras:
        model, _, lora = key.rpartition(":")
        host.load_lora(model, lora)
    conn, control_conn = _accept(args.socket, 2)
    imported = threading.Event()
    threading.Thread(target=serve_control, args=(control_conn, host, catalog, imported),
                     name="runtime-control", daemon=True).start()
    # A spare leaves the device alone until it loads (on CUDA, asking for its memory
    # makes a context); its worker knows the device's memory from the child before.
    device_bytes = None if args.spare else host.device_total_bytes()
    conn.sendall(encode_frame(Ready(os.getpid(), dict(host.footprints), device_bytes)))
    log.info("serving %s", ", ".join(args.models) or
             ("no model yet (a spare: promoted)" if args.spare else "no model yet"))
    if args.models or args.spare:
        imported.set()  # loading them (or the spare's start) imported everything
    else:
        # Nothing pinned: the first load would also pay transformers' imports (~3 s of
        # the ~6 s measured by bench.coldstart, against 0.2 s for the load itself).
        # Made now, beside serving, they are done before most first requests come.
        threading.Thread(target=_import_then_set,
                         args=(engines.engine(args.engine).imports, imported),
                         name="warm-imports", daemon=True).start()
    return serve(conn, host)


SPARE_IMPORT_NICENESS = 10  # added to the importing thread's: the serving runtime goes first


def _import_ahead(catalog: Catalog, engine: str) -> None:
    """A spare's imports: what loading any model of the catalog on its engine imports (the
    engine's library, its `imports`, the adapter modules of the entries that name it), made
    on a thread of lower CPU priority (Linux sets it per thread, so the threads that later
    compute, made by the main thread, keep the normal priority)."""
    registered = engines.engine(engine)

    def run() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SPARE_IMPORT_NICENESS)
        except OSError:
            log.warning("could not lower the priority of the spare's imports")
        started = time.perf_counter()
        modules = engine_imports(engine)
        _import_each(modules)
        try:  # the engine's library, and its family map
            adapters = engines.resolve(registered.start).adapters
        except Exception:  # the load that needs it will say what is wrong
            log.exception("importing engine %s ahead failed", engine)
            adapters = {}
        families = sorted({adapters[entry.adapter].partition(":")[0] for entry in catalog
                           if entry.runtime == engine and entry.adapter in adapters})
        _import_each(families)
        log.info("spare: imported %d modules and engine %s in %.1fs",
                 len(modules) + len(families), engine, time.perf_counter() - started)

    thread = threading.Thread(target=run, name="spare-imports", daemon=True)
    thread.start()
    thread.join()


def _import_each(modules: list[str] | tuple[str, ...]) -> None:
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception:  # the load that needs it will say what is wrong
            log.exception("importing %s ahead failed", module)


def _import_then_set(modules: tuple[str, ...], done: threading.Event) -> None:
    try:
        _import_each(modules)
    finally:
        done.set()


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    # Skip interpreter teardown (torch's takes seconds): the worker waits on our exit.
    os._exit(code)
