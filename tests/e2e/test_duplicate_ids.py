"""Two messages with one task id, held by one worker, each get their own answer.

It happens by design: a gateway republishes what it awaited after a broker reconnect, and a
bulk job's part is published again, under its id, by the gateway that takes the job over.
The runtime answers a batch by request id, so if both copies ran in one batch each was
answered with the same one of the two results (the takeover test of tests/e2e/test_jobs.py
failed now and then: a part's rows belonged to other items). Two copies of one id now never
share a batch.
"""

from __future__ import annotations

from contextlib import closing

import numpy as np
import pytest

from tests.e2e.test_worker_shutdown import SLOW, Replies, _worker
from tests.stack import private_stack, wait_for

pytestmark = pytest.mark.e2e


def vector(reply: dict) -> np.ndarray:
    assert reply["status"] == "SUCCESS", reply
    return np.frombuffer(reply["result"]["embeddings"], dtype="<f4")


def test_two_messages_with_one_id_in_one_worker_get_their_own_answers(tmp_path, slow_batches):
    from tests.conftest import FAULTY

    with private_stack(tmp_path, "dup-ids", FAULTY) as private, \
            closing(Replies()) as replies:
        queue = private.queue
        worker = _worker(private, "dup-ids", **slow_batches.env)
        # One slow batch runs (held in the model); both copies arrive meanwhile and wait
        # together, held by the worker, then share the next batch.
        slow_batches.hold()
        slow = replies.publish(queue, f"{SLOW} keeps the runtime busy")
        wait_for(lambda: worker.metric("shoal_batch_requests_count") >= 1, 60,
                 "the slow batch to start")
        texts = ["the first copy says one thing", "the second copy says something else"]
        task_id = "job-part-7"
        for text in texts:
            replies.publish(queue, text, task_id=task_id)
        wait_for(lambda: worker.metric("shoal_held_messages") == 2, 60,
                 "the worker to hold both copies")
        slow_batches.release()
        wait_for(lambda: replies.by_task()[task_id] == 2 and replies.of(slow), 60,
                 "both copies answered")
        answers = [vector(r) for r in replies.received if r["task_id"] == task_id]
        # What each text gives on its own, under an id of its own.
        alone = [replies.publish(queue, text) for text in texts]
        wait_for(lambda: all(replies.of(t) for t in alone), 60, "the texts alone")
        expected = [vector(replies.of(t)) for t in alone]
        assert not np.allclose(expected[0], expected[1])
        for want, got in zip(expected, answers, strict=True):
            np.testing.assert_allclose(got, want, atol=1e-5)
