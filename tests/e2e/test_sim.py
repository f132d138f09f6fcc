"""A simulated worker behind a real gateway: right shapes, marked as simulated.

It runs its own worker (SHOAL_RUNTIME=sim) and gateway under a private queue
prefix, so the session stack's queues never see a fake result.
"""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import MINILM
from tests.stack import (
    http_status,
    private_stack,
    queue_counts,
    wait_for,
)

pytestmark = pytest.mark.e2e


def test_a_sim_worker_answers_through_the_gateway(tmp_path):
    with private_stack(tmp_path, "sim", MINILM) as private:
        prefix, queue, stack, port, url = (private.prefix, private.queue, private.stack,
                                           private.port, private.url)
        stack.worker("sim", [MINILM], SHOAL_QUEUE_PREFIX=prefix, SHOAL_RUNTIME="sim",
                     SHOAL_DEVICE="t4")
        stack.gateway("sim-gateway", port, [MINILM], SHOAL_QUEUE_PREFIX=prefix)
        wait_for(lambda: http_status(f"{url}/readyz") == 200, 20, "the gateway to be ready")
        wait_for(lambda: queue_counts(queue)[1] >= 1, 20, "the sim worker to consume")

        r = httpx.post(f"{url}/v1/encode/{MINILM}",
                       json={"items": [{"text": "a cat"}, {"text": "a dog on a mat"}]},
                       timeout=10)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["dims"] == 384 and len(body["embeddings"]) == 2
        assert all(len(row) == 384 for row in body["embeddings"])
        assert r.headers["x-simulated"] == "t4"

        bad = httpx.post(f"{url}/v1/encode/{MINILM}",
                         json={"items": [{"text": "x"}], "options": {"dimensions": 385}},
                         timeout=10)
        assert bad.status_code == 422, bad.text

        log = stack.processes[0].log()
        assert "SIMULATED runtime" in log
