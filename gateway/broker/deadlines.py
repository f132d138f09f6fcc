"""Every awaited request's deadline on one loop timer.

`asyncio.timeout` arms a loop timer for each request and cancels it when the request
ends: under single-text load that pair was ~9% of the gateway's CPU (py-spy, 64 clients
x 1 text). Here a request's deadline joins a queue of the requests with the same timeout
(deadlines in one queue come in the order they are added, so the earliest is at its
head), and one timer is armed for the earliest head of all: most requests arm nothing.
A request that ends marks its entry finished; finished entries leave from the queue's
head as later ones are added, so a queue holds about the requests in flight.

When the timer fires, each request whose deadline has passed is cancelled (its task
sees CancelledError, as under `asyncio.timeout`, and `expired` tells it why), and the
timer is armed again for the earliest unfinished head. `Deadline.expired` is checked
with `Task.uncancel`, as `asyncio.timeout` does, so a cancel from elsewhere (the client
left, shutdown) is never mistaken for a timeout.
"""

from __future__ import annotations

import asyncio
from collections import deque


class Deadline:
    """One request's deadline: `expired` once the timer cancelled its task for it; `left`
    once its caller hung up and `hang_up` cancelled its task for that (the wait's other
    end: `gateway.edge.caller_left`, one object per request for both)."""

    __slots__ = ("expired", "finished", "left", "task", "when")

    def __init__(self, when: float, task: asyncio.Task) -> None:
        self.when = when
        self.task = task
        self.finished = False
        self.expired = False
        self.left = False

    def hang_up(self) -> None:
        """The caller left: stop waiting (the task sees CancelledError, `left` says why)."""
        if not self.finished and not self.left:
            self.left = True
            self.task.cancel()


class Deadlines:
    """The deadlines of the requests awaited on one loop (see the module doc)."""

    def __init__(self) -> None:
        self._queues: dict[float, deque[Deadline]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._armed_at = float("inf")

    def __len__(self) -> int:
        """Entries held (finished ones not yet dropped included)."""
        return sum(len(q) for q in self._queues.values())

    def add(self, timeout_s: float) -> Deadline:
        """The current task's deadline, `timeout_s` from now; mark it `finished` when the
        request ends."""
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        deadline = Deadline(loop.time() + timeout_s, task)
        queue = self._queues.get(timeout_s)
        if queue is None:
            queue = self._queues[timeout_s] = deque()
        while queue and queue[0].finished:
            queue.popleft()
        queue.append(deadline)
        if deadline.when < self._armed_at:
            self._arm(loop, deadline.when)
        return deadline

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(when, self._fire)
        self._armed_at = when

    def _fire(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer, self._armed_at = None, float("inf")
        now = loop.time()
        earliest = float("inf")
        for timeout_s, queue in list(self._queues.items()):
            while queue and (queue[0].finished or queue[0].when <= now):
                deadline = queue.popleft()
                if not deadline.finished:
                    deadline.expired = True
                    deadline.task.cancel()
            if queue:
                earliest = min(earliest, queue[0].when)
            else:
                del self._queues[timeout_s]
        if earliest != float("inf"):
            self._arm(loop, earliest)
