"""A request's trace: where its time went between the gateway and the worker, hop by hop.

A caller who sends `X-Shoal-Trace: 1` gets an `X-Shoal-Trace` response header of
milliseconds per hop, from epoch stamps taken along the path (one clock: hops between
hosts carry their clocks' skew):

- `gateway_in`: the request reached the gateway's app -> its task was built (parsed,
  checked, estimated);
- `to_worker`: -> the worker took its message (the outbox's turn, the publish, the broker,
  the delivery);
- `held`: -> its batch started (scheduling, and any batch ahead of it);
- `batch`: the batch's run (the runtime's inference time);
- `answer`: the batch's end -> its result handed to the worker's reply publisher;
- `reply`: -> the gateway had the result (the reply's publish, the broker, the delivery,
  the gateway's loop);
- `gateway_out`: -> the response's headers were ready.

What is left of the caller's own latency is HTTP both ways and the response's encoding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TRACE_HEADER = "x-shoal-trace"
HOPS = ("gateway_in", "to_worker", "held", "batch", "answer", "reply", "gateway_out")


def hop_trace(arrived_s: float, sent_ms: float | None, timing: Mapping[str, Any] | None,
              replied_s: float, now_s: float) -> str:
    """The `X-Shoal-Trace` value: `hop=ms` pairs in path order; the worker's hops are left
    out when its result carries no stamps (an older worker's, or a request run in parts)."""
    timing = timing or {}
    received_us = timing.get("received_us")
    sent_s = sent_ms / 1000 if sent_ms else None
    if sent_s is None or not received_us:
        spans = {"gateway_in": (arrived_s, sent_s or arrived_s), "worker": (sent_s or arrived_s,
                                                                            replied_s)}
    else:
        received, started = received_us / 1e6, timing["started_us"] / 1e6
        ended = started + float(timing.get("inference_ms") or 0.0) / 1000
        answered = timing["answered_us"] / 1e6
        spans = {"gateway_in": (arrived_s, sent_s), "to_worker": (sent_s, received),
                 "held": (received, started), "batch": (started, ended),
                 "answer": (ended, answered), "reply": (answered, replied_s)}
    spans["gateway_out"] = (replied_s, now_s)
    return "; ".join(f"{hop}={(end - begin) * 1000:.3f}" for hop, (begin, end) in spans.items())


def parse_trace(value: str) -> dict[str, float]:
    """An `X-Shoal-Trace` value read back: hop -> milliseconds."""
    out = {}
    for pair in value.split(";"):
        hop, _, ms = pair.strip().partition("=")
        if hop:
            out[hop] = float(ms)
    return out
