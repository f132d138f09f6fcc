"""What a worker tells gateways about its model pool, on the fanout exchange `POOL_EXCHANGE`.

Each worker publishes its state when it changes (a load, an eviction) and every
SHOAL_POOL_STATE_INTERVAL_S; a gateway keeps the latest message of each worker
and forgets a worker it has not heard from for `STALE_AFTER_INTERVALS` intervals.
The body is msgpack:

    {"worker": "celery@host", "at": epoch_s, "interval_s": 5.0,
     "budget_bytes": int, "used_bytes": int,
     "device_busy": float,  # optional: the busy fraction of its device since its last state
     "models": [{"id": str, "state": "resident" | "loading" | "cold",
                 "pinned": bool, "bytes": int | None, "loras": [str, ...],
                 # optional, what the fleet's placement reads (app.worker.lifecycle.fleet):
                 "estimate": int,  # bytes a copy takes (measured, else estimated)
                 "rate": float,  # requests per second this worker received (decaying)
                 "busy": float,  # device seconds per second its batches took
                 "load_s": float,  # what its last load here took (else the profile's)
                 "warm": bool,  # evicted here moments ago (its reload likely cheap)
                 # optional: its runtime refuses the model's requests while a failed
                 # restart's replacement starts; the seconds until it should serve
                 "ready_in_s": float}]}

"cold" means the worker may serve the model (it consumes its queue) but has not
loaded it: its first request there waits for a load.
"""

from __future__ import annotations

from typing import Any

import msgpack

STALE_AFTER_INTERVALS = 3
RESIDENT, LOADING, COLD = "resident", "loading", "cold"


def pool_exchange(queue_prefix: str) -> str:
    return f"{queue_prefix}.pool"


def encode_state(state: dict[str, Any]) -> bytes:
    return msgpack.packb(state, use_bin_type=True)


def decode_state(body: bytes) -> dict[str, Any]:
    """A worker's state message; ValueError if it is not one."""
    try:
        state = msgpack.unpackb(body, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ValueError(f"pool state is not msgpack: {exc}") from exc
    if not isinstance(state, dict) or not isinstance(state.get("worker"), str) \
            or not isinstance(state.get("models"), list):
        raise ValueError("pool state must be a map with 'worker' and 'models'")
    return state
