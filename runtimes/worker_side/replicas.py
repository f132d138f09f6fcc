"""Several runtime processes on one device: the host's cores prepare its batches.

One runtime process prepares its batches on one thread: decoding, the Rust tokenizer,
padding, pooling and the results all take its GIL, so one process tops out at some
thousands of texts per second (6,000-6,500 on the H200 host, BENCHMARKS.md "On a GPU")
while the device could take a hundred times more and the host's other cores idle. A
`ReplicaSet` runs `count` `runtimes.worker_side.process.ProcessRuntime`s (the worker's
SHOAL_RUNTIME_REPLICAS) on the same device, each with every model loaded, and hands
each batch to the one with the fewest batches in flight; their device work interleaves
on the device as the streams of separate processes do (CUDA time-slices contexts; each
replica's environment names the device they share, `runtimes.base.DEVICE_GROUP_ENV`).
Threads inside one process would share its GIL, which is most of the preparation's CPU
(BENCHMARKS.md, "Preparation on several cores").

Everything a single runtime promises holds per replica, because each is one: a crash,
hang or fatal device error ends one child, its supervisor restarts it with its models
(the others keep serving), and its batch is bisected there (`runtimes.worker_side.bisection`), so a
poison request is still blamed alone. Cancels go to every replica (a request runs on
one; the others ignore ids they do not run). Loads and unloads go to all of them, in
parallel; a load that fails on one is undone on the rest, so every replica serves the
same models, and what a model takes is the sum over replicas: the worker's pool counts
each copy against the device's memory.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from runtimes.base import (
    DEVICE_GROUP_ENV,
    BatchesOnly,
    Capabilities,
    LoadFailed,
    OnDeltas,
    Outcome,
    Request,
    SentAhead,
)
from runtimes.worker_side.process import ProcessRuntime

log = logging.getLogger(__name__)


def default_replicas(device: str, cores: int | None = None) -> int:
    """How many runtime processes a device gets when the worker's setting says `auto`.

    On a CPU the model's forward itself runs on every core (torch's intra-op threads), so
    a second replica only splits them: 1. On a GPU a quarter of the host's cores: at
    16-text requests the runtime is ~40% of the whole stack's CPU per text, and the
    gateway, RabbitMQ and the worker need the rest (BENCHMARKS.md, "Feeding the device");
    capped at 8 (each holds a CUDA context and a copy of every model)."""
    if not device.startswith("cuda"):
        return 1
    return max(1, min(8, (cores or os.cpu_count() or 1) // 4))


_sets = itertools.count()  # the replica sets of this process, each a device's group


class _ReplicaAhead:
    """A frame sent ahead to one replica, which keeps that replica's slot until its batch
    ran there or it is discarded."""

    __slots__ = ("ahead", "index", "release")

    def __init__(self, index: int, ahead: SentAhead, release: Callable[[int, bool], None]) -> None:
        self.index = index
        self.ahead = ahead
        self.release = release

    def discard(self) -> None:
        self.ahead.discard()
        self.release(self.index, False)


class ReplicaSet(BatchesOnly):
    """`runtimes.base.Runtime` over `count` ProcessRuntimes on one device (module doc).

    `start(index, env)` starts replica `index` with `env` added to its child's
    environment (the name of the device they share)."""

    def __init__(self, start: Callable[[int, dict[str, str]], ProcessRuntime],
                 count: int) -> None:
        if count < 1:
            raise ValueError(f"a replica set needs at least one replica, not {count}")
        env = {DEVICE_GROUP_ENV: f"{os.getpid()}-{next(_sets)}"}
        self.replicas: list[ProcessRuntime] = []
        self._lock = threading.Lock()
        self._in_flight = [0] * count
        self.batches = [0] * count  # batches handed to each replica so far
        # Started side by side: each imports torch and loads the pinned models.
        with ThreadPoolExecutor(count, thread_name_prefix="shoal-replica-start") as pool:
            futures = [pool.submit(start, i, env) for i in range(count)]
            errors = []
            for future in futures:
                try:
                    self.replicas.append(future.result())
                except BaseException as exc:
                    errors.append(exc)
        if errors:
            self.close()
            raise errors[0]
        # Batches side by side: one per replica (the worker's scheduler starts that many).
        self.capabilities = Capabilities(
            pipeline_depth=sum(r.capabilities.pipeline_depth for r in self.replicas),
            parallel=count,
            send_ahead=all(r.capabilities.send_ahead for r in self.replicas))
        log.info("%d runtime replicas on one device: pids %s", count,
                 [r.pid for r in self.replicas])

    # --- what the worker reads ----------------------------------------------------------

    @property
    def restarts(self) -> int:
        return sum(r.restarts for r in self.replicas)

    @property
    def poison_isolated(self) -> int:
        return sum(r.poison_isolated for r in self.replicas)

    @property
    def spare_promotions(self) -> int:
        return sum(r.spare_promotions for r in self.replicas)

    @property
    def start_failures(self) -> int:
        return sum(r.start_failures for r in self.replicas)

    @property
    def pid(self) -> int | None:
        return self.replicas[0].pid if self.replicas else None

    @property
    def pids(self) -> list[int | None]:
        return [r.pid for r in self.replicas]

    @property
    def device_bytes(self) -> int | None:
        return self.replicas[0].device_bytes if self.replicas else None

    @property
    def resident(self) -> dict[str, int]:
        """Every model (and LoRA adapter) loaded, with the bytes of all its copies."""
        merged: dict[str, int] = {}
        for replica in self.replicas:
            for key, size in dict(replica.resident).items():
                merged[key] = merged.get(key, 0) + size
        return merged

    # --- batches --------------------------------------------------------------------------

    def ready_in(self, model_id: str) -> float | None:
        """While every replica refuses batches (each one's failed restart's replacement
        imports): the seconds until the first should serve; else None."""
        waits = [r.ready_in(model_id) for r in self.replicas]
        if any(w is None for w in waits):
            return None
        return min(w for w in waits if w is not None)

    def watch_availability(self, callback: Callable[[], None]) -> None:
        """`callback` whenever a replica's child changes or its refusals start or stop."""
        for replica in self.replicas:
            replica.watch_availability(callback)

    def _take_least_busy(self) -> int:
        """The replica the next batch goes to, its slot taken (`_release` gives it back)."""
        # A replica that refuses batches while its replacement imports answers at once,
        # so it would look the least busy and take every batch: the others go first.
        refusing = [r.ready_in("") is not None for r in self.replicas]
        with self._lock:
            index = min(range(len(self.replicas)),
                        key=lambda i: (refusing[i], self._in_flight[i]))
            self._in_flight[index] += 1
            self.batches[index] += 1
        return index

    def _release(self, index: int, ran: bool = True) -> None:
        with self._lock:
            self._in_flight[index] -= 1
            if not ran:
                self.batches[index] -= 1

    @contextmanager
    def _least_busy(self) -> Iterator[ProcessRuntime]:
        index = self._take_least_busy()
        try:
            yield self.replicas[index]
        finally:
            self._release(index)

    def send_ahead(self, model_id: str, requests: list[Request]) -> SentAhead | None:
        """The frame sent to the replica the batch will run on (the least busy, whose slot
        it keeps until the batch ran or the handle is discarded); None where that replica
        would wait, or where not every replica can send ahead."""
        if not self.capabilities.send_ahead:
            return None
        index = self._take_least_busy()
        try:
            ahead = self.replicas[index].send_ahead(model_id, requests)
        except BaseException:
            self._release(index, ran=False)
            raise
        if ahead is None:  # the batch's own thread picks its replica again
            self._release(index, ran=False)
            return None
        return _ReplicaAhead(index, ahead, self._release)

    def run_batch(self, model_id: str, requests: list[Request],
                  on_deltas: OnDeltas | None = None, ahead: SentAhead | None = None
                  ) -> list[Outcome]:
        if isinstance(ahead, _ReplicaAhead):  # its replica, whose slot it holds
            try:
                return self.replicas[ahead.index].run_batch(model_id, requests, on_deltas,
                                                            ahead.ahead)
            finally:
                self._release(ahead.index)
        with self._least_busy() as replica:
            return replica.run_batch(model_id, requests, on_deltas)

    def cancel(self, request_ids: list[str]) -> None:
        for replica in self.replicas:
            replica.cancel(request_ids)

    # --- models ---------------------------------------------------------------------------

    def estimate_bytes(self, model: str, lora: str | None = None) -> int:
        return len(self.replicas) * self.replicas[0].estimate_bytes(model, lora)

    def load(self, model: str, lora: str | None = None) -> int:
        """Load on every replica at once: the bytes of all the copies. LoadFailed (and the
        copies that loaded unloaded again) if any replica cannot."""
        results = self._on_each(lambda r: r.load(model, lora))
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            self._on_each(lambda r: r.unload(model, lora))
            reason = failed[0]
            raise reason if isinstance(reason, LoadFailed) else LoadFailed(repr(reason))
        return sum(int(r) for r in results)

    def unload(self, model: str, lora: str | None = None) -> None:
        for result in self._on_each(lambda r: r.unload(model, lora)):
            if isinstance(result, BaseException):
                log.warning("unloading %s on a replica failed: %r", model, result)

    def _on_each(self, call: Callable[[ProcessRuntime], Any]) -> list[Any]:
        """`call` on every replica in parallel: each one's result or exception."""
        with ThreadPoolExecutor(len(self.replicas),
                                thread_name_prefix="shoal-replica-control") as pool:
            futures = [pool.submit(call, r) for r in self.replicas]
            return [f.exception() or f.result() for f in futures]

    def close(self) -> None:
        for replica in self.replicas:
            replica.close()
