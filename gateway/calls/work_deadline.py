"""The deadline of a large request that sends no X-Timeout-Ms: as long as its predicted
work needs, not the flat SHOAL_DEFAULT_TIMEOUT_MS.

An indexing call sends a whole document set at once (LangChain's `OpenAIEmbeddings`: 1,000
chunks of ~1,000 characters in one request), and the SDKs under it wait 10 minutes; a
flat 30 s default ran such a request for 30 s and answered 504 with nothing. Its default
is instead `WORK_MARGIN` times the work its model's tuned cost constants predict (the
catalog profile of SHOAL_DEVICE, else the model's slowest profile, else the defaults):
its items at their longest's length (a padded upper bound), in batches of the profile's
item and token caps. The margin leaves room for the other callers' batches its parts
interleave with (`app.worker.lifecycle.splits`). The result is rounded up to
`STEP_MS` (each distinct timeout is a queue of `gateway.broker.deadlines`) and held to
SHOAL_MAX_TIMEOUT_MS; a caller's X-Timeout-Ms is always taken as sent, and a worker
refuses a request its whole deadline cannot fit before any of it runs.
"""

from __future__ import annotations

import math

from tasks.catalog import BatchProfile, ModelEntry
from tasks.envelope import Annotations
from tasks.settings import Settings

WORK_MARGIN = 3.0
STEP_MS = 10_000
# Padded tokens below which no request's work comes near a default deadline: the hot path
# (a few short texts) pays one multiplication and one comparison.
SMALL_TOKENS = 16_384
_DEFAULT_PROFILE = BatchProfile()


def profile_for(entry: ModelEntry, device: str) -> BatchProfile:
    """The profile a prediction at the gateway rests on: the device's, else the slowest."""
    profile = entry.profile(device)
    if profile is not None:
        return profile
    return max(entry.profiles.values(), key=lambda p: p.cost_b_us, default=_DEFAULT_PROFILE)


def predicted_work_s(profile: BatchProfile, items: int, longest: int) -> float:
    """Seconds a request's items take alone on the device, by the profile's cost fit."""
    tokens = items * longest
    batches = max(math.ceil(items / profile.max_items), math.ceil(tokens / profile.max_tokens),
                  1)
    per_token_us = profile.cost_b_us + profile.cost_c_ns * longest / 1000
    return batches * profile.cost_a_ms / 1000 + tokens * per_token_us / 1e6


def default_budget_ms(entry: ModelEntry, annotations: Annotations, settings: Settings) -> int:
    """The deadline (ms from now) of a request that sent no X-Timeout-Ms."""
    default = settings.default_timeout_ms
    if annotations.items * annotations.longest < SMALL_TOKENS:
        return default
    work_s = predicted_work_s(profile_for(entry, settings.device), annotations.items,
                              annotations.longest)
    scaled = math.ceil(work_s * WORK_MARGIN * 1000 / STEP_MS) * STEP_MS
    return max(default, min(scaled, settings.max_timeout_ms))
