"""What a worker's settings and catalog make of its limits: each model's batch limits,
cost model and hold horizon (the device's tuned profile, overridden by SHOAL_BATCH_*),
which models are pinned, and the device memory budget."""

from __future__ import annotations

from fnmatch import fnmatchcase

from batching.former import BatchLimits
from batching.latency_model import CostModel
from runtimes.model_files.footprint import physical_memory_bytes
from runtimes.model_files.precision import profile_on
from tasks.catalog import BatchProfile, ModelEntry
from tasks.settings import Settings


def device_profile(entry: ModelEntry, settings: Settings) -> BatchProfile:
    """The catalog's tuned profile for this device ('cuda:1' finds a `cuda` profile, as
    the runtime's precision does), or the profile defaults."""
    return profile_on(entry, settings.device) or BatchProfile()


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
