"""A caller that hangs up before its answer: whatever waits for the answer is told.

uvicorn marks a request's cycle `disconnected` when its connection is lost, but only a
handler that reads the request's body (`receive`) learns of it. A handler that awaits a
model's result would await it until its deadline, while the request goes on being
published, held by a worker and computed for nobody. So the edge
(`gateway.edge.http_protocol.EdgeProtocol.connection_lost`) calls `caller_left` for a
request whose response was not complete, and what waits for that request's answer
(`gateway.broker.link.Broker.submit`) has put a callback in the request's ASGI scope
(`on_caller_left`) that stops the wait and releases the request everywhere it sits.

One callback per request (one wait: the model call), kept in the scope's `state` dict
(the one Starlette's `request.state` reads): nothing is allocated for a request beyond
that dict entry, and a callback left behind goes with the request's scope.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

# The scope's state key of the callback; gateway.edge.outer_middleware names its keys alike.
CALLER_LEFT = "shoal_caller_left"


def on_caller_left(scope: MutableMapping[str, Any], callback: Callable[[], None]) -> None:
    """Call `callback` (on the loop) if the request's caller hangs up before its response
    is complete; until `forget_caller`."""
    scope.setdefault("state", {})[CALLER_LEFT] = callback


def forget_caller(scope: MutableMapping[str, Any]) -> None:
    """The wait is over: a hang-up from now on concerns nobody."""
    state = scope.get("state")
    if state is not None:
        state.pop(CALLER_LEFT, None)


def caller_left(scope: MutableMapping[str, Any]) -> None:
    """The edge's: the request's connection was lost before its response was complete."""
    state = scope.get("state")
    callback = state.pop(CALLER_LEFT, None) if state is not None else None
    if callback is not None:
        callback()
