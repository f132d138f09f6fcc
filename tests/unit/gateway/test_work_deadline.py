"""A large request that sends no X-Timeout-Ms gets a deadline as long as its predicted
work (gateway.calls.work_deadline); a small one keeps SHOAL_DEFAULT_TIMEOUT_MS."""

from __future__ import annotations

from gateway.calls.work_deadline import (
    STEP_MS,
    WORK_MARGIN,
    default_budget_ms,
    predicted_work_s,
    profile_for,
)
from tasks.catalog import load_catalog
from tasks.envelope import annotate
from tasks.settings import DEFAULT_MODEL, PACKAGED_CATALOG_DIR, Settings

MINILM = load_catalog(PACKAGED_CATALOG_DIR).get(DEFAULT_MODEL)
SETTINGS = Settings(default_timeout_ms=30_000, max_timeout_ms=300_000, device="cpu")


def _budget(texts: list[str], settings: Settings = SETTINGS) -> int:
    assert MINILM is not None
    kwargs = {"model": MINILM.id, "items": [{"text": t} for t in texts]}
    return default_budget_ms(MINILM, annotate("shoal.encode", kwargs, MINILM), settings)


def test_a_few_short_texts_keep_the_default():
    assert _budget(["The cat sits on the mat."] * 64) == 30_000


def test_an_indexing_call_gets_its_predicted_work_with_room():
    """LangChain's default: 1,000 chunks of ~1,000 characters in one call. MiniLM's CPU
    profile (103 us a padded token, ~250 tokens each) predicts ~26 s alone."""
    assert MINILM is not None
    chunks = ["a paragraph of a long document. " * 31] * 1000
    budget = _budget(chunks)
    _, _, longest = MINILM.estimate({"items": [{"text": t} for t in chunks]})
    work_s = predicted_work_s(profile_for(MINILM, "cpu"), 1000, longest)
    assert 20 < work_s < 40
    assert budget % STEP_MS == 0
    assert work_s * WORK_MARGIN * 1000 <= budget < work_s * WORK_MARGIN * 1000 + STEP_MS


def test_the_scaled_deadline_stops_at_the_largest_accepted():
    chunk = "a paragraph of a long document. " * 31
    capped = Settings(default_timeout_ms=30_000, max_timeout_ms=45_000, device="cpu")
    assert _budget([chunk] * 1000, capped) == 45_000


def test_a_device_without_a_profile_predicts_from_the_slowest_it_has():
    assert MINILM is not None
    assert profile_for(MINILM, "h100") is MINILM.profiles["cpu"]
