"""Which workers' runtimes refuse a model while they restart, and until when.

A worker whose model runtime died and whose replacement failed to start answers that
model's requests 503 MODEL_UNAVAILABLE with a Retry-After (the seconds until the next
replacement should be ready, from the measured starts) until it serves again. Publishing
each retry only for the worker to refuse it costs the gateway, the broker and the worker
CPU that the replacement's start needs: on a 2-core host clients retrying at once made
~380 refusals a second and the replacement's import took 8-11.5 s instead of ~4. So once
every worker that serves a model is known to be restarting, the gateway answers the
model's requests itself with the same 503 and Retry-After until the soonest of them
should serve (`gateway.broker.served_models` asks `refusal` before publishing).

What marks a worker restarting for a model: its pool state says so (`ready_in_s` on the
model, sent when the refusals begin and again when they end), or a refusal comes back
while it is the only worker known to serve the model (a reply does not name its worker:
with several, their pool states decide). A pool state without `ready_in_s` ends the mark
at once (the replacement is up: publish again); so does the time running out. A worker
not marked (a peer still serving the model) keeps every request flowing. Nothing here
does I/O or reads a clock: `now` (monotonic seconds) is passed in.
"""

from __future__ import annotations

from gateway.broker.pool_view import Placement, WorkerState


class RestartingModels:
    """model -> worker -> when (monotonic) it should serve the model again."""

    def __init__(self) -> None:
        self._until: dict[str, dict[str, float]] = {}

    def __bool__(self) -> bool:
        """Whether any worker is marked (the per-request check is this, while none is)."""
        return bool(self._until)

    def heard_state(self, state: WorkerState) -> None:
        """A worker's pool state: its marks follow what it says now."""
        for model, placement in state.models.items():
            if placement.ready_in_s is not None:
                self._until.setdefault(model, {})[state.worker] = \
                    state.heard_at + placement.ready_in_s
        for model in [m for m, workers in self._until.items() if state.worker in workers]:
            placement = state.models.get(model)
            if placement is None or placement.ready_in_s is None:
                self._forget(model, state.worker)

    def heard_refusal(self, model: str, placements: list[Placement], retry_after_s: int,
                      now: float) -> None:
        """A request for `model` was refused MODEL_UNAVAILABLE with a Retry-After, by the
        one worker that serves it (with several, which one refused is not known)."""
        if len(placements) == 1:
            self._until.setdefault(model, {})[placements[0].worker] = now + retry_after_s

    def refusal(self, model: str, placements: list[Placement], now: float) -> float | None:
        """Seconds until the soonest of `model`'s workers (`placements`: every fresh one
        that serves it) should serve, when each of them is marked restarting; else None
        (a worker serves it, or none is known: publish)."""
        marked = self._until.get(model)
        if not marked or not placements:
            return None
        for worker in [w for w, until in marked.items() if until <= now]:
            self._forget(model, worker)
        until = [marked.get(p.worker) for p in placements]
        if any(u is None for u in until):
            return None
        return min(u for u in until if u is not None) - now

    def _forget(self, model: str, worker: str) -> None:
        workers = self._until.get(model)
        if workers is not None:
            workers.pop(worker, None)
            if not workers:
                del self._until[model]

