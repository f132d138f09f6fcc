"""The requests the SGLang runtime is serving, by id, and cancelling them: a cancel marks its
request (its items then finish CANCELLED) and names the SGLang requests to abort; a cancel
that comes before its request is remembered for it. Used only on the runtime's loop."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from runtimes.base import Request


@dataclass
class Live:
    """A request being served: what `cancel` needs."""

    request: Request
    model: str
    rids: list[str] = field(default_factory=list)
    cancelled: bool = False
    streamed: bool = False  # deltas went to its caller


class LiveRequests:
    def __init__(self) -> None:
        self._live: dict[str, Live] = {}
        self._cancelled_early: deque[str] = deque(maxlen=1024)  # cancels that came first

    def open(self, request: Request, model_id: str) -> Live:
        """`request` is being served now (already cancelled if its cancel came first)."""
        live = Live(request, model_id)
        if request.id in self._cancelled_early:
            live.cancelled = True
        self._live[request.id] = live
        return live

    def close(self, request_id: str) -> None:
        self._live.pop(request_id, None)

    def cancel(self, request_ids: list[str]) -> list[Live]:
        """Mark these requests cancelled: those being served, whose SGLang requests
        (`rids`) are to be aborted; the others are remembered for when they come."""
        cancelled = []
        for request_id in request_ids:
            live = self._live.get(request_id)
            if live is None:
                self._cancelled_early.append(request_id)
                continue
            live.cancelled = True
            cancelled.append(live)
        return cancelled
