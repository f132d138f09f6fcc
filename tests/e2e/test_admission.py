"""Admission on a cold worker: a guess never turns a servable request away, and a
refusal that measurements back says so with a status clients do not retry.

The faulty test model's `@@slow@@` batches stand in for a worker's slow first
batches (a loaded host, a spare runtime importing): a few tokens measured at
SLOW_S against the profile's ~5 ms put the fitted model's guess for a long text
at several seconds (before issue 41 such texts were refused 504 "predicted to
take ...: not started").
"""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import FAULTY, queue_name
from tests.slow_batches import SlowBatches
from tests.stack import metric_sum, queue_counts, wait_for

pytestmark = pytest.mark.e2e

SLOW_S = 2.0
LONG_TEXT = "a long text of many words " * 50  # ~256 tokens


@pytest.fixture(scope="module")
def cold_worker(stack, tmp_path_factory):
    slow = SlowBatches(tmp_path_factory.mktemp("admission-slow"), slow_s=SLOW_S)
    worker = stack.stack.worker("admission", [FAULTY], **slow.env)
    wait_for(lambda: queue_counts(queue_name(FAULTY))[1] >= 1, 120, "the faulty worker")
    yield slow
    worker.stop()


def _encode(url: str, text: str, timeout_ms: int) -> httpx.Response:
    return httpx.post(f"{url}/v1/encode/{FAULTY}", json={"items": [{"text": text}]},
                      headers={"x-timeout-ms": str(timeout_ms)}, timeout=120)


def test_a_long_text_is_served_after_slow_first_batches(stack, cold_worker):
    for i in range(3):  # one batch each: the fitted model's level is set from the third
        slow = _encode(stack.url, f"@@slow@@ {i}", 60_000)
        assert slow.status_code == 200, slow.text
    # The fit now guesses seconds for 256 tokens; the profile says ~10 ms, and nothing
    # comparable was measured, so it runs (and its time is learnt).
    served = _encode(stack.url, LONG_TEXT, 2_000)
    assert served.status_code == 200, served.text
    assert len(served.json()["embeddings"][0]) == 32


def test_a_deadline_measured_batches_of_its_shape_cannot_meet_is_refused_for_good(
        stack, cold_worker):
    text = "@@slow@@ a medium text " + "word " * 30
    for i in range(2):  # two measured batches of this shape back a refusal
        slow = _encode(stack.url, f"{text} {i}", 60_000)
        assert slow.status_code == 200, slow.text
    refused = _encode(stack.url, f"{text} again", 500)
    # 422, not 504: sent again with the same deadline it would be refused again, and the
    # SDKs retry 5xx (the openai SDK twice) but not 422.
    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    assert error["code"] == "DEADLINE_TOO_SHORT"
    assert "measured batches of a comparable shape" in error["message"]
    assert "its whole 500 ms deadline" in error["message"]
    assert refused.headers["x-should-retry"] == "false"
    # On the OpenAI route: 400, the SDK's BadRequestError, and one request only.
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused",
                           default_headers={"X-Timeout-Ms": "500"})
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=FAULTY, input=f"{text} once more")
    assert caught.value.body["code"] == "DEADLINE_TOO_SHORT"


def test_a_request_that_ran_past_its_deadline_is_not_retried_by_the_openai_sdk(
        stack, cold_worker):
    """A 504 for a request that was running when the gateway stopped waiting says
    x-should-retry: false: the openai SDK (which retries a 5xx twice by default) sends it
    once, so the model runs it once."""
    slow = cold_worker

    def timed_out() -> float:
        return metric_sum(f"{stack.url}/metrics", 'shoal_gateway_requests_total'
                          '{route="/v1/embeddings",status="504"}')

    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused",
                           default_headers={"X-Timeout-Ms": "5000"})
    assert client.max_retries == 2
    before, ran = timed_out(), slow.started()
    slow.hold()  # the batch sleeps on, past the request's deadline, until released
    try:
        with pytest.raises(openai.InternalServerError) as caught:
            client.embeddings.create(model=FAULTY, input="@@slow@@ held past its deadline")
        slow.wait_started(ran + 1)
    finally:
        slow.release()
    assert caught.value.status_code == 504
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert caught.value.body["code"] == "DEADLINE_EXCEEDED"
    assert "X-Timeout-Ms" in caught.value.body["message"]
    assert timed_out() == before + 1  # one request reached the gateway
    assert slow.started() == ran + 1  # and the model ran it once
