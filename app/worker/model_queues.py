"""Worker wiring: a consumer bootstep that feeds the model queues to the dispatcher.

Each model the worker may serve (SHOAL_MODELS: ids or catalog globs) gets its
queue consumed on its own channel with its own prefetch (per-consumer QoS;
quorum queues refuse global QoS) and a consumer priority that says whether the
model is loaded here (`app.worker.dispatcher`); so does its dead-letter queue, whose
messages are answered with an error. The model runtime is its own process,
started when the step is built with the pinned models (SHOAL_PIN) loaded:
before the consumer opens its broker connection, whose heartbeats would
otherwise go unanswered while the weights load. Other models load on their
first request (`app.worker.placement`). It survives broker reconnects.

Operators see and steer the pool with Celery's remote control:
`celery -A app inspect shoal_models`, `celery -A app control shoal_load MODEL`,
`celery -A app control shoal_unload MODEL`. Gateways learn it from the state
message each worker publishes (`tasks.pool_state`).

SIGTERM (or SIGINT) drains the worker before Celery's warm shutdown
(`app.worker.shutdown`): it stops consuming, hands back what has not started, and
finishes, publishes and acks what runs, within SHOAL_SHUTDOWN_GRACE_S.
"""

from __future__ import annotations

import logging
import sys
import time
from fnmatch import fnmatchcase
from typing import Any

from celery import bootsteps
from celery.worker import control
from kombu import Consumer

from app.worker.deadletters import DeadLetterAnswerer
from app.worker.dispatcher import Dispatcher
from app.worker.health import WorkerHealth, serve
from app.worker.metrics import (
    DRAINING,
    POISON_ISOLATED,
    RUNTIME_RESTARTS,
    SHUTDOWNS_FORCED,
    SPARE_PROMOTIONS,
    START_FAILURES,
)
from app.worker.pool_states import PoolStates
from app.worker.shutdown import GracefulShutdown
from batching.former import BatchLimits
from batching.hold import HoldLimits
from batching.latency_model import CostModel
from batching.scheduler import Lane
from runtimes.footprint import physical_memory_bytes
from runtimes.pool import Pool
from runtimes.precision import device_kind
from runtimes.process import ProcessRuntime
from tasks.catalog import BatchProfile, ModelEntry, load_catalog
from tasks.queues import kombu_queues
from tasks.settings import Settings, get_settings
from tasks.topology import queue_for

log = logging.getLogger(__name__)

DEAD_LETTER_PREFETCH = 16
GIL_SWITCH_INTERVAL_S = 0.0005


def device_profile(entry: ModelEntry, settings: Settings) -> BatchProfile:
    """The catalog's tuned profile for this device ('cuda:1' finds a `cuda` profile, as
    the runtime's precision does), or the profile defaults."""
    return (entry.profile(settings.device) or entry.profile(device_kind(settings.device))
            or BatchProfile())


def batch_limits(entry: ModelEntry, settings: Settings) -> BatchLimits:
    """The device's profile, overridden by SHOAL_BATCH_* where those are set."""
    profile = device_profile(entry, settings)
    explicit = settings.model_fields_set
    max_tokens, max_items = profile.max_tokens, profile.max_items
    max_delay_ms = profile.max_delay_ms
    if "batch_max_tokens" in explicit:
        max_tokens = settings.batch_max_tokens
    if "batch_max_items" in explicit:
        max_items = settings.batch_max_items
    if "batch_max_delay_ms" in explicit:
        max_delay_ms = settings.batch_max_delay_ms
    return BatchLimits(
        max_tokens=max_tokens,
        max_items=max_items,
        max_delay_s=max_delay_ms / 1000,
        max_wait_s=profile.max_wait_ms / 1000,
        latency_target_s=(
            profile.latency_target_ms / 1000 if profile.latency_target_ms else None
        ),
        bulk_pass_s=settings.bulk_pass_ms / 1000,
        bulk_slice_s=settings.bulk_slice_ms / 1000,
    )


def hold_horizon(entries: list[ModelEntry], settings: Settings) -> float:
    """SHOAL_HOLD_HORIZON_BATCHES if set, else the smallest the served models' profiles
    ask for (one horizon serves every lane), else the setting's default."""
    if "hold_horizon_batches" in settings.model_fields_set:
        return settings.hold_horizon_batches
    tuned = [p.hold_horizon_batches for e in entries
             if (p := device_profile(e, settings)).hold_horizon_batches is not None]
    return min(tuned, default=settings.hold_horizon_batches)


def hold_horizon_s(entries: list[ModelEntry], settings: Settings) -> float:
    """The most seconds ahead a worker holds work: SHOAL_HOLD_HORIZON_MS if set, else the
    smallest the served models' profiles ask for (hold_horizon_ms, or else their latency
    target when that is smaller than the setting's default: a request should not sit on
    one worker longer than a batch is meant to take)."""
    if "hold_horizon_ms" in settings.model_fields_set:
        return settings.hold_horizon_ms / 1000
    bounds = []
    for entry in entries:
        profile = device_profile(entry, settings)
        if profile.hold_horizon_ms is not None:
            bounds.append(profile.hold_horizon_ms)
        else:
            bounds.append(min(settings.hold_horizon_ms,
                              profile.latency_target_ms or settings.hold_horizon_ms))
    return min(bounds, default=settings.hold_horizon_ms) / 1000


def cost_model(entry: ModelEntry, settings: Settings) -> CostModel:
    """A cost model seeded from the device's tuned profile (refined online)."""
    profile = device_profile(entry, settings)
    return CostModel(profile.cost_a_ms / 1000, profile.cost_b_us / 1e6, profile.cost_c_ns / 1e9)


class ModelQueueConsumer(bootsteps.ConsumerStep):
    """Consumes every served model's queue (and dead-letter queue) into the dispatcher."""

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self.settings = settings = get_settings()
        # Results are confirmed asynchronously (app.worker.replies); events need no
        # confirms. Celery's blocking per-publish confirms stay on for clients.
        options = dict(c.app.conf.broker_transport_options or {})
        options.pop("confirm_publish", None)
        c.app.conf.broker_transport_options = options
        self.entries = load_catalog(settings.catalog_dir).select(settings.models)
        self.pinned = pinned_models(settings, [e.id for e in self.entries])
        self.lanes = {
            e.id: Lane(e.id, batch_limits(e, settings), cost_model(e, settings))
            for e in self.entries
        }
        self.hold = HoldLimits(
            horizon_batches=hold_horizon(self.entries, settings),
            max_horizon_s=hold_horizon_s(self.entries, settings),
            delivery_limit=settings.queue_delivery_limit,
            max_prefetch=max(settings.prefetch, 1),
        )
        # /healthz, /readyz and /metrics, served from now on: while the models load too.
        self.health = WorkerHealth(settings.worker_stall_s)
        serve(settings.worker_metrics_host, settings.worker_metrics_port, self.health.app)
        # The event loop and the runtime thread hand every batch to each other; a thread
        # woken while the other holds the GIL waits up to the switch interval (5 ms by
        # default) for it. 0.5 ms took ~1 ms off a lone request, throughput unchanged
        # (BENCHMARKS.md, "A lone request").
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        if settings.runtime == "sim":
            # Imported here: a real worker never loads it, a simulated one never loads torch.
            from runtimes.sim import SimRuntime

            log.warning("SIMULATED runtime: no model runs; %s batches sleep as a %s would "
                        "(speed x%g) and results are fake", [e.id for e in self.entries],
                        settings.device, settings.sim_speed)
            self.runtime = SimRuntime(self.entries, settings.device, settings.sim_speed,
                                      settings.sim_constants, loaded=sorted(self.pinned))
        else:
            self.runtime = self._real_runtime(settings)
        RUNTIME_RESTARTS.set_function(lambda: self.runtime.restarts)
        POISON_ISOLATED.set_function(lambda: self.runtime.poison_isolated)
        # Only the PyTorch runtime has a spare; SGLang's and the simulated one count none.
        SPARE_PROMOTIONS.set_function(lambda: getattr(self.runtime, "spare_promotions", 0))
        START_FAILURES.set_function(lambda: getattr(self.runtime, "start_failures", 0))
        self.pool = Pool(device_budget(settings, self.runtime.device_bytes))
        self.dispatcher: Dispatcher | None = None
        self.pool_states = PoolStates(settings.queue_prefix, settings.pool_state_interval_s)
        self.state_timer: Any = None
        self.consumers: list[Any] = []
        self.c: Any = None
        self.graceful = GracefulShutdown(settings.shutdown_grace_s, self._begin_drain,
                                         self._force_exit)
        self.drain_started = 0.0  # monotonic

    def _real_runtime(self, settings: Settings) -> Any:
        """The PyTorch runtime, SGLang servers, or both behind a router (by model)."""
        on = runtime_of_models(self.entries, settings.runtime)
        runtimes: dict[str, Any] = {}
        if "pytorch" in on.values():
            runtimes["pytorch"] = ProcessRuntime(
                catalog_dir=settings.catalog_dir,
                models=[e.id for e in self.entries if e.id in self.pinned
                        and on[e.id] == "pytorch"],
                device=settings.device,
                threads=settings.torch_threads,
                chunk_tokens=max(lane.limits.max_tokens for lane in self.lanes.values()),
                start_timeout=settings.runtime_start_timeout_s,
                batch_timeout=settings.runtime_batch_timeout_s,
                spare=settings.runtime_spare,
                precision=settings.precision,
                pipeline_depth=settings.runtime_pipeline_depth,
            )
        if "sglang" in on.values():
            from runtimes.sglang import SGLangRuntime

            runtimes["sglang"] = SGLangRuntime(
                catalog_dir=settings.catalog_dir,
                models=[e.id for e in self.entries if e.id in self.pinned
                        and on[e.id] == "sglang"],
                device=settings.device, threads=settings.torch_threads,
                start_timeout=settings.runtime_start_timeout_s)
        if len(runtimes) == 1:
            return next(iter(runtimes.values()))
        from runtimes.router import RuntimeRouter

        return RuntimeRouter(runtimes, on)

    def _warm_peers(self, model: str) -> Any:
        return lambda: self.pool_states.warm_peers(model)

    def _profile_load_s(self) -> dict[str, float]:
        speed = self.settings.sim_speed if self.settings.runtime == "sim" else 1.0
        return {e.id: device_profile(e, self.settings).load_ms / 1000 / speed
                for e in self.entries}

    def start(self, c: Any) -> None:
        if c.hub is None:
            raise RuntimeError("shoal's worker needs Celery's event loop (an AMQP broker)")
        if self.dispatcher is None:
            self.dispatcher = Dispatcher(c, self.runtime, self.lanes, self.hold,
                                         {e.id: e for e in self.entries},
                                         self.settings.part_target_ms / 1000, self.pool,
                                         self.pinned, self.settings.prefetch,
                                         self._profile_load_s(),
                                         self.settings.lora_mixed_batches,
                                         self.settings.feed_return_after_ms / 1000,
                                         self.settings.blob_url,
                                         self.settings.claim_upload_timeout_s)
        self.c = c
        if self.graceful.requested_at is not None:
            # Reconnected while draining: what was held is redelivered to others anyway.
            self.graceful.finish()
            return
        self.dispatcher.replier.open(c.connection)
        self.consumers = []
        for entry in self.entries:
            queue, dead = kombu_queues(queue_for(entry.id, self.settings))
            channel = c.connection.channel()
            consumer = Consumer(channel, queues=[queue], on_message=self.dispatcher.on_message,
                                accept=["msgpack", "json"])
            self.dispatcher.consume(entry.id, consumer, queue.name,
                                    _consumer_counter(channel, queue.name),
                                    self._warm_peers(entry.id))
            dead_channel = c.connection.channel()
            answerer = DeadLetterAnswerer(self.dispatcher.replier, entry.id)
            dead_consumer = Consumer(dead_channel, queues=[dead], on_message=answerer.on_message,
                                     prefetch_count=DEAD_LETTER_PREFETCH)
            dead_consumer.consume()
            self.consumers += [consumer, dead_consumer]
            log.debug("consuming %s and %s", queue.name, dead.name)
        log.info("consuming the queues of %d models; pinned: %s", len(self.entries),
                 sorted(self.pinned) or "none")
        self.pool_states.busy_seconds = lambda: self.dispatcher.device_busy_s
        self.pool_states.open(c, self.dispatcher.placement.snapshot)
        self.dispatcher.on_placement = self.pool_states.soon
        self.state_timer = c.hub.call_repeatedly(self.settings.pool_state_interval_s,
                                                 self.pool_states.publish)
        self.graceful.attach(c.hub)
        self.health.consuming(c.hub)

    # --- draining for a shutdown (on the loop; see app.worker.shutdown) --------------------------

    def _begin_drain(self) -> None:
        self.health.draining()
        c, dispatcher = self.c, self.dispatcher
        if dispatcher is None or c is None:
            self.graceful.finish()
            return
        self.drain_started = time.monotonic()
        DRAINING.set(1)
        if self.state_timer is not None:
            self.state_timer.cancel()
            self.state_timer = None
        # Gateways stop counting this worker as serving its models now.
        self.pool_states.farewell()
        dispatcher.on_drained = self._drained
        handed = dispatcher.begin_drain()
        # Nothing more from the dead-letter queues, nor Celery's own task queue (its remote
        # control and events go on until Celery's shutdown).
        for consumer in [*self.consumers, c.task_consumer]:
            if consumer is not None:
                try:
                    consumer.cancel()
                except Exception:
                    log.warning("could not cancel a consumer while draining", exc_info=True)
        in_flight = dispatcher.scheduler.in_flight
        log.warning("draining for shutdown: stopped consuming; handed back %d requests that "
                    "had not started (%s); finishing %d running (batches of %s), %d results "
                    "to confirm; grace %gs", sum(handed.values()),
                    ", ".join(f"{m}: {n}" for m, n in handed.items()) or "none",
                    dispatcher.unfinished,
                    ", ".join(str(len(b.members)) for b in in_flight) or "none",
                    dispatcher.replier.unconfirmed, self.settings.shutdown_grace_s)
        dispatcher.check_drained()

    def _drained(self) -> None:
        dispatcher = self.dispatcher
        assert dispatcher is not None
        DRAINING.set(0)
        log.warning("drained in %.2fs: %d requests answered after the signal (results "
                    "confirmed, messages acked), %d handed back; exiting",
                    time.monotonic() - self.drain_started, dispatcher.drain_answered,
                    dispatcher.drain_handed_back)
        # Flower's last task events of the drain: Celery flushes its buffer on the loop's
        # next turn, which the shutdown does not take.
        events = getattr(self.c, "event_dispatcher", None)
        if events is not None:
            try:
                events.flush()
            except Exception:
                log.warning("could not flush the last task events", exc_info=True)
        self.graceful.finish()

    def _force_exit(self, why: str) -> None:
        SHUTDOWNS_FORCED.inc()
        DRAINING.set(0)
        dispatcher = self.dispatcher
        unfinished = dispatcher.abandon() if dispatcher is not None else 0
        log.error("shutdown forced (%s) %.2fs after the signal: %d requests left unfinished "
                  "and unacked (the broker redelivers them), %d answered, %d handed back",
                  why, self.graceful.elapsed(), unfinished,
                  dispatcher.drain_answered if dispatcher else 0,
                  dispatcher.drain_handed_back if dispatcher else 0)
        if self.c is not None:
            self.c.controller.exitcode = 1  # as a crash would say

    def stop(self, c: Any) -> None:
        self.health.stopped()
        self.graceful.detach()
        if self.graceful.draining:
            # The connection was lost while draining: every held message is redelivered.
            self.graceful.finish()
        if self.state_timer is not None:
            self.state_timer.cancel()
            self.state_timer = None
        if self.dispatcher is not None:
            self.dispatcher.drop_held()
            self.dispatcher.on_placement = lambda: None
        super().stop(c)

    def shutdown(self, c: Any) -> None:
        # Gateways stop counting this worker as serving its models now, not when its
        # state goes stale.
        self.pool_states.farewell()
        if self.dispatcher is not None:
            self.dispatcher.drop_held()
        super().shutdown(c)
        if self.dispatcher is not None:
            self.dispatcher.close()
            self.dispatcher = None
        else:
            self.runtime.close()


def runtime_of_models(entries: list[ModelEntry], worker_runtime: str) -> dict[str, str]:
    """Which runtime serves each model: the entry's `runtime: sglang`; with
    SHOAL_RUNTIME=sglang also every causal LM and last-token-pooled (decoder) embedder, the
    models SGLang is built for (an encoder such as MiniLM stays on PyTorch unless its entry
    says otherwise); else PyTorch."""
    def on_sglang(e: ModelEntry) -> bool:
        return e.adapter == "causal-lm" or (e.adapter == "dense" and e.pooling == "lasttoken")

    return {e.id: "sglang" if e.runtime == "sglang" or (
        worker_runtime == "sglang" and on_sglang(e)) else "pytorch" for e in entries}


def pinned_models(settings: Settings, models: list[str]) -> set[str]:
    """SHOAL_PIN (globs allowed) among the models served; unset: the models SHOAL_MODELS
    names without a glob (so `SHOAL_MODELS=a,b` loads both at start, as it always did)."""
    patterns = settings.pin if settings.pin is not None else [
        m for m in settings.models if not any(ch in m for ch in "*?[")]
    return {m for m in models if any(fnmatchcase(m, p) for p in patterns)}


def device_budget(settings: Settings, device_bytes: int | None) -> int:
    """SHOAL_DEVICE_MEMORY_BYTES, else SHOAL_DEVICE_MEMORY_FRACTION of the device's memory
    (as the runtime reports it; this machine's RAM when it does not)."""
    if settings.device_memory_bytes is not None:
        return settings.device_memory_bytes
    return int(settings.device_memory_fraction * (device_bytes or physical_memory_bytes()))


def _consumer_counter(channel: Any, queue: str) -> Any:
    def count() -> int:
        return int(channel.queue_declare(queue=queue, passive=True).consumer_count)

    return count


@control.inspect_command()
def active_queues(state: Any) -> list[dict]:
    """Celery's `active_queues` plus the model queues, so Flower's broker tab lists them."""
    consumer = state.consumer
    queues = list(consumer.task_consumer.queues) if consumer.task_consumer else []
    step = _step(state)
    for kombu_consumer in (step.consumers if step else None) or []:
        queues.extend(kombu_consumer.queues)
    return [dict(q.as_dict(recurse=True)) for q in queues]


def _step(state: Any) -> ModelQueueConsumer | None:
    return next((s for s in state.consumer.steps if isinstance(s, ModelQueueConsumer)), None)


@control.inspect_command()
def shoal_models(state: Any) -> dict[str, Any]:
    """Each model this worker may serve: resident, loading or cold, pinned, its bytes."""
    step = _step(state)
    if step is None or step.dispatcher is None:
        return {"error": "not consuming yet"}
    return step.dispatcher.placement.snapshot()


def _placement_serving(state: Any, model: str) -> tuple[Any, dict[str, str] | None]:
    """This worker's placement and None, or None and the reply that says why not."""
    step = _step(state)
    if step is None or step.dispatcher is None:
        return None, {"error": "not consuming yet"}
    if model not in step.dispatcher.scheduler.lanes:
        return None, {"error": f"this worker does not serve {model!r} (SHOAL_MODELS)"}
    return step.dispatcher.placement, None


@control.control_command(args=[("model", str)], signature="<model id>")
def shoal_load(state: Any, model: str) -> dict[str, Any]:
    """Start loading a model here (warm it before traffic comes)."""
    placement, refused = _placement_serving(state, model)
    if refused is not None:
        return refused
    why = placement.ensure(model, asked=True)
    return {"error": why} if why is not None else {"ok": f"{model} is {placement.state(model)}"}


@control.control_command(args=[("model", str)], signature="<model id>")
def shoal_unload(state: Any, model: str) -> dict[str, Any]:
    """Drop a model here (not a pinned one, nor one with requests held or running)."""
    placement, refused = _placement_serving(state, model)
    if refused is not None:
        return refused
    why = placement.unload(model)
    return {"error": why} if why is not None else {"ok": f"{model} unloaded"}


@control.control_command(args=[("task_ids", list)], signature="<task id> [...]")
def shoal_cancel(state: Any, task_ids: list[str]) -> dict[str, Any]:
    """Revoke requests (a gateway sends it when a stream's client leaves): not started, they
    are answered CANCELLED; running, their generation stops at its next token."""
    step = _step(state)
    if step is None or step.dispatcher is None:
        return {"error": "not consuming yet"}
    return {"ok": step.dispatcher.cancel([str(t) for t in task_ids])}


def install(app: Any) -> None:
    app.steps["consumer"].add(ModelQueueConsumer)
