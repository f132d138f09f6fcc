"""How long the device spends in a model's forward passes: the time it is busy.

`watch_forward` puts a `DeviceClock` on a loaded model: hooks around the model's
forward and its direct children's (CLIP's `get_text_features` calls its text tower,
not the model's own forward) mark where the device work of a pass begins and ends.
A forward nested in another (the encoder inside the model) is not counted twice.

On CUDA the marks are CUDA events on the current stream, so the figure is the
device's own time from the pass's first kernel to its last, not the host's: a host
that launches kernels asynchronously is not billed for the device, and a device that
waits for the next batch is not billed as busy (gaps between one pass's kernels, while
the host launches them, are: eager PyTorch's small batches are launch-bound).
On CPU the forward's wall time is the device's time.

A batch's passes run on one thread (the runtime's device stage), one batch after
another, so what `take_span()` returns after a batch's forward is that batch's: a
`Span`, read later (`seconds()` waits for the span's last pass on CUDA) by whichever
thread turns the batch's outputs into results, so the device stage never waits for the
GPU. `take()` is the same read at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


class DeviceClock:
    """Busy time of one model's forward passes, taken (and reset) batch by batch."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self._local = threading.local()  # per thread: nesting depth, the open pass
        self._lock = threading.Lock()
        self._events: list[tuple[Any, Any]] = []  # CUDA (start, end) pairs not yet taken
        self._seconds = 0.0  # CPU passes not yet taken

    def enter(self) -> None:
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        if depth:
            return
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._local.start = start
        else:
            self._local.start = time.perf_counter()

    def exit(self) -> None:
        depth = self._local.depth = getattr(self._local, "depth", 1) - 1
        if depth:
            return
        start = self._local.start
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            with self._lock:
                self._events.append((start, end))
        else:
            elapsed = time.perf_counter() - start
            with self._lock:
                self._seconds += elapsed

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Passes on this thread inside are nobody's busy time (a CUDA graph capture after
        a reload from host memory): the hooks see them as nested in an open pass."""
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1

    def bill(self, seconds: float) -> None:
        """Add busy time the hooks did not see (or take some back: negative)."""
        with self._lock:
            self._seconds += seconds

    def take(self) -> float:
        """Seconds the device was busy in forward passes since the last take (on CUDA,
        once the last of them has run)."""
        return self.take_span().seconds()

    def take_span(self) -> Span:
        """The forward passes since the last take (read their time with `seconds()`)."""
        with self._lock:
            events, self._events = self._events, []
            seconds, self._seconds = self._seconds, 0.0
        return Span(seconds, events)


class Span:
    """The busy time of some forward passes: CPU seconds, and CUDA events to read."""

    __slots__ = ("_events", "_seconds")

    def __init__(self, seconds: float, events: list[tuple[Any, Any]]) -> None:
        self._seconds = seconds
        self._events = events

    def seconds(self) -> float:
        if self._events:
            self._events[-1][1].synchronize()  # a stream runs in order: the rest are done
            self._seconds += sum(s.elapsed_time(e) for s, e in self._events) / 1000
            self._events = []
        return self._seconds


_clocks: dict[str, DeviceClock] = {}
_clocks_lock = threading.Lock()


def device_clock(device: str | torch.device) -> DeviceClock:
    """The one clock of a device, shared by every model on it: the runtime runs one batch
    at a time, so what it took since the last batch is that batch's."""
    where = torch.device(device)
    if where.type == "cuda" and where.index is None:
        where = torch.device("cuda", torch.cuda.current_device())
    name = str(where)
    with _clocks_lock:
        clock = _clocks.get(name)
        if clock is None:
            clock = _clocks[name] = DeviceClock(name)
        return clock


def watch_forward(model: torch.nn.Module) -> DeviceClock:
    """Count `model`'s forward passes on its device's clock (see the module doc)."""
    first = next(model.parameters(), None)
    clock = device_clock(first.device if first is not None else "cpu")
    for module in (model, *model.children()):
        module.register_forward_pre_hook(lambda *_: clock.enter())
        module.register_forward_hook(lambda *_: clock.exit(), always_call=True)
    return clock
