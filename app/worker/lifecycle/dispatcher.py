"""The worker's dispatcher: the kombu glue around the scheduler.

Everything here runs on the Celery consumer's event loop thread (kombu channels are not
thread-safe) except the batch itself, which runs on the runtime's own thread
(`app.worker.lifecycle.batches`). A delivered request is held (`app.worker.lifecycle.intake`,
`app.worker.lifecycle.held`), scheduled, run and answered (`app.worker.lifecycle.answers`), or
given back to
its queue for other workers (`app.worker.lifecycle.returns`). Every one of those decisions is
`batching.scheduler.Scheduler`'s (or, for a continuously batching runtime,
`batching.feeder`'s, applied by `app.worker.lifecycle.feed`); this class only feeds it events and
applies its `Actions`: acks, rejects, consumer cancel/qos/consume
(`app.worker.lifecycle.consumers`), peer counts, Flower events and metrics. Models and LoRA
adapters load beside the batches (`app.worker.lifecycle.placement`); requests too big for a batch
run in parts (`app.worker.lifecycle.splits`); a shutdown drains (`app.worker.lifecycle.drain`).

The steps of a request's life are mixins of this class (`Intake`, `Feed`, `Batches`,
`Drain`): they call each other back and forth (a batch's end appends the next part,
ticks and answers; a tick refuses, starts and gives back; a drain hands back and waits
for what runs) and share one state (generation, timers, futures, drain flags), which
lives here; passing each of them the dispatcher would be the same coupling, spelled
longer. What owns state of its own is an object it holds: the held requests
(`Holdings`), the consumers (`Consumers`), the answers (`Answers`), the streams
(`Streams`), the placement, the replier.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from app.worker import metrics
from app.worker.lifecycle.answers import Answers, refusal_message
from app.worker.lifecycle.batches import Batches
from app.worker.lifecycle.claims import ClaimFetcher
from app.worker.lifecycle.consumers import Consumers
from app.worker.lifecycle.drain import Drain
from app.worker.lifecycle.feed import Feed
from app.worker.lifecycle.held import Held, Holdings
from app.worker.lifecycle.intake import Intake
from app.worker.lifecycle.placement import Placement
from app.worker.lifecycle.replies import Delivery, Replier
from app.worker.lifecycle.returns import give_back
from app.worker.lifecycle.streams import Streams
from batching.feeder import Feeder
from batching.hold import HoldLimits
from batching.scheduler import Actions, Batch, Lane, Scheduler
from runtimes.base import Runtime
from runtimes.worker_side.pool import Pool
from tasks.envelope import EstimatingEntry, now_ms
from tasks.errors import ErrorCode
from tasks.pool_state import RESIDENT

log = logging.getLogger(__name__)

# A wake-up this close to the one already set needs no new timer.
TIMER_SLACK_S = 0.001


class Dispatcher(Intake, Feed, Batches, Drain):
    def __init__(self, consumer: Any, runtime: Runtime, lanes: dict[str, Lane],
                 hold: HoldLimits, entries: dict[str, EstimatingEntry],
                 part_target_s: float | None = None, pool: Pool | None = None,
                 pinned: set[str] | None = None, prefetch: int = 64,
                 load_s: dict[str, float] | None = None,
                 lora_mixed_batches: bool = True, feed_return_after_s: float = 0.2,
                 blob_url: str = "", claim_upload_timeout_s: float = 10.0) -> None:
        self.c = consumer
        self.runtime = runtime
        self.lora_mixed_batches = lora_mixed_batches
        self.entries = entries  # to annotate a Celery client's message that came without
        self.part_target_s = part_target_s  # the longest a part of a split request should run
        # A pipelined runtime takes the next batch while it computes one (its
        # `pipeline_depth`); each batch in flight waits for its answer on a thread here.
        depth = max(1, runtime.pipeline_depth)
        # Runtime replicas run that many of them side by side (`runtimes.worker_side.replicas`).
        parallel = max(1, runtime.parallel)
        self.scheduler = Scheduler(lanes, hold, self._peers, depth=depth, parallel=parallel)
        self.continuous = {model for model in lanes if runtime.continuous(model)}
        self.feeder = Feeder(feed_return_after_s, hold.delivery_limit)
        # Every request held here, in whichever state (scheduled, parked for a LoRA,
        # fetching its claims, waiting for or handed to a continuous runtime).
        self.holdings = Holdings(self.scheduler, self.feeder)
        self.replier = Replier(consumer)
        self.executor = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="shoal-runtime")
        self.claims = ClaimFetcher(blob_url, claim_upload_timeout_s,
                                   lambda fn: self.c.hub.call_soon(fn))
        self.futures: dict[Future, Batch] = {}  # of the batches in flight
        self.device_busy_s = 0.0  # the device's busy time in this worker's batches so far
        self.streams = Streams(runtime, self.replier, consumer, lambda: self.generation)
        self._timer: Any = None
        self._timer_at = 0.0
        self._tick_queued = False
        self.generation = 0  # bumped on connection loss: old messages cannot be acked
        self.on_placement: Callable[[], None] = lambda: None  # told when a model's state changes
        # Draining for a shutdown: nothing new is held, what runs finishes.
        self.draining = False
        self._drain_begun = False  # its hand-back is done: `on_drained` may be called
        self._drain_reported = False  # `on_drained` was called (or the drain was abandoned)
        self._answering = False  # answering (a batch's results, refusals): not drained yet
        self.on_drained: Callable[[], None] = lambda: None
        self.answers = Answers(self.replier, consumer, lambda: self.draining)
        self.drain_handed_back = 0  # requests handed back when the drain began, or after
        self.delivery_limit = hold.delivery_limit
        self.replier.on_confirmed = self.check_drained
        self.placement = Placement(
            runtime, pool or Pool(2**62), list(lanes), pinned or set(),
            lambda fn, *args: self.c.hub.call_soon(fn, *args), self._in_use,
            self._on_state, self._on_load_failed, load_s or {}, self._on_lora)
        self.consumers = Consumers(self.scheduler, self.placement, prefetch)
        for model, lane in lanes.items():
            lane.ready = self.placement.state(model) == RESIDENT

    @property
    def drain_answered(self) -> int:
        """Requests answered while draining."""
        return self.answers.drain_answered

    def consume(self, model: str, consumer: Any, queue: str, count_peers: Callable[[], int],
                warm_peers: Callable[[], int]) -> None:
        """Start consuming a model's queue with the prefetch and priority of its state."""
        self.consumers.consume(model, consumer, queue, count_peers, warm_peers)

    def _queue_tick(self) -> None:
        # Let the loop finish reading the frames at hand first, so messages delivered
        # together land in one batch. A timer due now, not `call_soon`: kombu's loop runs
        # what `call_soon` adds from its own thread only after its next poll returns, so
        # from a callback that itself came by `call_soon` (a load's end) the tick waited
        # for the next frame or timer (0.03-1.2 s measured after loads, bench.coldstart);
        # due timers fire before that poll.
        if not self._tick_queued:
            self._tick_queued = True
            self.c.hub.call_later(0, self.tick)

    # --- applying the scheduler's decisions (loop thread) -------------------------------

    def tick(self) -> None:
        self._tick_queued = False
        actions = self.scheduler.tick(time.monotonic())
        for wake in (self._expire_parked() if self.holdings.parked else None,
                     self._feed() if self.continuous else None):
            if wake is not None:
                actions.wake_in = wake if actions.wake_in is None else min(actions.wake_in, wake)
        if not self.draining:
            self._apply(actions)
            return
        # Its refusals (deadlines passed) are answers too: the drain ends after them all.
        answering, self._answering = self._answering, True
        try:
            self._apply(actions)
        finally:
            self._answering = answering
        if not answering:
            self.check_drained()

    def _expire_parked(self) -> float | None:
        """Answer the parked requests whose deadline passed (they wait for a LoRA outside
        the scheduler); seconds until the next such deadline, or None."""
        now = now_ms()
        expired, soonest = self.holdings.expire_parked(now)
        for model, held in expired:
            self.answers.refuse(model, held, "the request's deadline passed while its LoRA "
                                      "adapter was loading")
        return None if soonest is None else max((soonest - now) / 1000, TIMER_SLACK_S)

    def _apply(self, actions: Actions) -> None:
        for model, pending in actions.expired:
            self.answers.refuse(model, pending.handle,
                         "the request's deadline passed before a worker could run it")
        for model, late in actions.late:
            self.answers.refuse(model, late.pending.handle, refusal_message(late),
                                ErrorCode.DEADLINE_TOO_SHORT if late.too_short
                                else ErrorCode.DEADLINE_EXCEEDED)
        if actions.start is not None:
            self._start(actions.start)
        for model, prefetch in actions.prefetch.items():
            self.consumers.set_prefetch(model, prefetch)
        for model, returned in actions.returned:
            self._give_back(model, [pending.handle for pending in returned])
            metrics.RETURNS.labels(model).inc(len(returned))
            log.info("returned %d requests of %s to the queue", len(returned), model)
        for lane in self.scheduler.lanes.values():
            metrics.HELD.labels(lane.model).set(len(lane.backlog))
        self._wake_in(actions.wake_in)

    def _give_back(self, model: str, returned: list[Held],
                   renew: Callable[[Delivery], bool] | None = None) -> None:
        """Return requests to their queue (see `app.worker.lifecycle.returns`)."""
        give_back(model, returned, self.consumers.queue(model), self.replier,
                  self.c.hostname, renew)

    def _wake_in(self, seconds: float | None) -> None:
        if seconds is None:
            return
        at = time.monotonic() + seconds
        if self._timer is not None:
            if abs(at - self._timer_at) <= TIMER_SLACK_S:
                return
            self._timer.cancel()
        self._timer_at = at
        self._timer = self.c.hub.call_later(seconds, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.tick()

    def _peers(self, model: str, now: float) -> int:
        return self.consumers.peers(model, now)

    # --- placement (loop thread) -----------------------------------------------------------

    def _on_state(self, model: str, state: str) -> None:
        """A model became resident, loading or cold here: its lane and its consumer follow."""
        lane = self.scheduler.lanes[model]
        lane.ready = state == RESIDENT
        if lane.ready:
            now = time.monotonic()
            for pending in lane.backlog:
                metrics.LOAD_WAIT.labels(model).observe(now - pending.received)
        self.consumers.follow_state(model, state)
        self.on_placement()
        self._queue_tick()
        if lane.ready:
            for lora in self.holdings.parked_loras(model):
                if why := self.placement.ensure(model, lora):
                    self._on_lora(model, lora, why)

    def _on_load_failed(self, model: str, why: str) -> None:
        for pending in self.scheduler.drop(model):
            self.answers.refuse(model, pending.handle, why, ErrorCode.MODEL_UNAVAILABLE)
        for waiting in self.feeder.drop(model):
            self.answers.refuse(model, waiting.handle, why, ErrorCode.MODEL_UNAVAILABLE)
        metrics.HELD.labels(model).set(0)
        for lora in self.holdings.parked_loras(model):
            self._on_lora(model, lora, why)

    def _on_lora(self, model: str, lora: str, why: str | None) -> None:
        """A LoRA adapter's load ended (why None: loaded): its parked requests go on."""
        for held, deliveries in self.holdings.unpark(model, lora):
            if why is None:
                self._append(model, held, deliveries)
            else:
                self.answers.refuse(model, held, why, ErrorCode.MODEL_UNAVAILABLE)
        self.on_placement()
        self._queue_tick()

    def _in_use(self) -> Counter[str]:
        """What held requests need loaded (`Holdings.in_use`): none of it may be evicted."""
        return self.holdings.in_use()

    # --- lifecycle -----------------------------------------------------------------------

    def drop_held(self) -> None:
        """Forget held messages after a connection loss (the broker redelivers them)."""
        self.generation += 1
        self.holdings.clear()
        for model in self.scheduler.lanes:
            metrics.HELD.labels(model).set(0)
        self.consumers.clear()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None

    def close(self) -> None:
        self.claims.close()
        self.placement.close()
        # The runtime first: a batch still running (a forced or cold shutdown; a drained
        # worker runs none) fails at once instead of holding the exit up.
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.runtime.close()
        self.executor.shutdown(wait=True)
