"""OpenAI's Batch API end to end, with the official openai client: a file uploaded, a batch
of /v1/embeddings lines run on the session worker, its output equal to the sync route's
answers line for line (and chat and rerank lines equal to theirs), bad lines in its error
file, a batch cancelled, a file deleted, and another API key that sees none of it.

A gateway of its own on the session stack, with API keys (two tenants).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import yaml

from gateway.auth.key_file import hash_key, new_key
from tests.conftest import LLAMA, MINILM, RERANKER
from tests.stack import free_port, http_status, wait_for

pytestmark = pytest.mark.e2e
TIMEOUT = 180


class Tenants:
    def __init__(self, url: str, alice: str, bob: str) -> None:
        self.url = url
        self.alice = openai.OpenAI(base_url=f"{url}/v1", api_key=alice, max_retries=0)
        self.bob = openai.OpenAI(base_url=f"{url}/v1", api_key=bob, max_retries=0)
        self.alice_key = alice


@pytest.fixture(scope="module")
def tenants(stack, tmp_path_factory) -> Iterator[Tenants]:
    path = Path(tmp_path_factory.mktemp("batch-keys")) / "keys.yaml"
    alice, bob = new_key(), new_key()
    path.write_text(yaml.safe_dump({"keys": [{"name": "alice", "hash": hash_key(alice)},
                                             {"name": "bob", "hash": hash_key(bob)}]}))
    port = free_port()
    gateway = stack.stack.gateway("batch-gateway", port, [MINILM],
                                  SHOAL_API_KEYS_FILE=str(path))
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: http_status(f"{url}/readyz") == 200, 60, "the batch gateway",
             give_up=lambda: None if gateway.alive() else gateway.log()[-3000:])
    yield Tenants(url, alice, bob)
    gateway.stop()


def _line(custom_id: str, body: dict, url: str = "/v1/embeddings") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _upload(client: openai.OpenAI, lines: list[str], name: str = "batch.jsonl"):
    return client.files.create(file=(name, ("\n".join(lines) + "\n").encode()),
                               purpose="batch")


def _finished(client: openai.OpenAI, batch_id: str, statuses=("completed",)):
    def done():
        batch = client.batches.retrieve(batch_id)
        assert batch.status not in ("failed", "expired"), batch
        return batch if batch.status in statuses else None
    return wait_for(done, TIMEOUT, f"batch {batch_id} to end", interval=0.3)


def _lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def _sync(url: str, key: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/embeddings", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}"})


def _assert_same_answer(got: dict, want: dict) -> None:
    """The batch line's body is the sync route's: every field equal, the vectors to float32
    rounding (the two ran in different batches of the model)."""
    assert {k: v for k, v in got.items() if k != "data"} == \
        {k: v for k, v in want.items() if k != "data"}
    assert [(d["object"], d["index"]) for d in got["data"]] == \
        [(d["object"], d["index"]) for d in want["data"]]
    for mine, theirs in zip(got["data"], want["data"], strict=True):
        if isinstance(theirs["embedding"], str):  # base64: compare the floats it holds
            mine_v = np.frombuffer(__import__("base64").b64decode(mine["embedding"]), "<f4")
            theirs_v = np.frombuffer(__import__("base64").b64decode(theirs["embedding"]), "<f4")
        else:
            mine_v, theirs_v = np.array(mine["embedding"]), np.array(theirs["embedding"])
        np.testing.assert_allclose(mine_v, theirs_v, atol=1e-5)


def test_a_batch_answers_every_line_as_the_sync_route_does(tenants):
    bodies = {f"r{i}": {"model": MINILM, "input": f"batch sentence number {i}"}
              for i in range(24)}
    bodies["pair"] = {"model": MINILM, "input": ["two texts", "in one line"]}
    bodies["b64"] = {"model": MINILM, "input": "base64 please", "encoding_format": "base64"}
    lines = [_line(cid, body) for cid, body in bodies.items()]
    lines += [_line("no-input", {"model": MINILM}),  # the route's 400
              _line("wrong-url", {"model": MINILM, "input": "x"}, url="/v1/completions"),
              "this is not json", ""]
    client = tenants.alice
    upload = _upload(client, lines)
    assert upload.object == "file" and upload.purpose == "batch" and upload.id.startswith("file-")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings",
                                  completion_window="24h", metadata={"run": "e2e"})
    assert batch.id.startswith("batch_") and batch.status in ("validating", "in_progress")
    assert batch.metadata == {"run": "e2e"}
    done = _finished(client, batch.id)
    assert done.request_counts.total == len(bodies) + 3
    assert done.request_counts.completed == len(bodies)
    assert done.request_counts.failed == 3
    output, errors = _lines(client, done.output_file_id), _lines(client, done.error_file_id)
    answered = [line["custom_id"] for line in output + errors]
    assert sorted(a for a in answered if a) == sorted([*bodies, "no-input", "wrong-url"])
    assert answered.count(None) == 1  # the line that is not JSON has no custom_id
    for line in output:
        assert line["id"].startswith("batch_req_") and line["error"] is None
        assert line["response"]["status_code"] == 200
        want = _sync(tenants.url, tenants.alice_key, bodies[line["custom_id"]])
        assert want.status_code == 200
        _assert_same_answer(line["response"]["body"], want.json())
    by_id = {line["custom_id"]: line for line in errors}
    refused = _sync(tenants.url, tenants.alice_key, {"model": MINILM})
    assert by_id["no-input"]["response"]["status_code"] == refused.status_code == 400
    assert by_id["no-input"]["response"]["body"] == refused.json()
    assert by_id["wrong-url"]["response"] is None
    assert by_id["wrong-url"]["error"]["code"] == "mismatched_url"
    assert by_id[None]["error"]["code"] == "invalid_json_line"
    assert any(b.id == batch.id for b in client.batches.list(limit=100))


def test_a_duplicate_custom_id_fails_the_batch_and_a_bad_purpose_is_400(tenants):
    client = tenants.alice
    body = {"model": MINILM, "input": "x"}
    upload = _upload(client, [_line("same", body), _line("same", body)])
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings",
                                  completion_window="24h")
    assert batch.status == "failed"
    assert batch.errors.data[0].code == "duplicate_custom_id"
    assert batch.errors.data[0].line == 2
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=upload.id, endpoint="/v1/moderations",
                              completion_window="24h")


def test_cancel_keeps_what_ran_and_answers_the_rest_cancelled(tenants):
    client = tenants.alice
    ids = [f"c{i}" for i in range(600)]
    upload = _upload(client, [_line(cid, {"model": MINILM, "input": f"cancel me {cid} " * 8})
                              for cid in ids])
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings",
                                  completion_window="24h")
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled")
    done = _finished(client, batch.id, statuses=("cancelled",))
    output, errors = _lines(client, done.output_file_id), _lines(client, done.error_file_id)
    assert sorted(line["custom_id"] for line in output + errors) == sorted(ids)
    assert errors, "600 lines on one CPU worker cannot all be done before the cancel"
    assert {line["error"]["code"] for line in errors} == {"batch_cancelled"}
    assert done.request_counts.completed == len(output)
    assert done.request_counts.failed == len(errors)
    assert client.batches.cancel(batch.id).status == "cancelled"  # a second cancel: as it is


def test_another_key_sees_nothing_and_a_deleted_file_is_gone(tenants):
    alice, bob = tenants.alice, tenants.bob
    upload = _upload(alice, [_line("k1", {"model": MINILM, "input": "mine"})])
    batch = alice.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings",
                                 completion_window="24h")
    for call in (lambda: bob.files.retrieve(upload.id),
                 lambda: bob.files.content(upload.id),
                 lambda: bob.files.delete(upload.id),
                 lambda: bob.batches.retrieve(batch.id),
                 lambda: bob.batches.cancel(batch.id),
                 lambda: bob.batches.create(input_file_id=upload.id,
                                            endpoint="/v1/embeddings", completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert upload.id not in {f.id for f in bob.files.list()}
    assert batch.id not in {b.id for b in bob.batches.list()}
    done = _finished(alice, batch.id)
    assert alice.files.retrieve(done.output_file_id).purpose == "batch_output"
    deleted = alice.files.delete(upload.id)
    assert deleted.deleted and deleted.id == upload.id
    with pytest.raises(openai.NotFoundError):
        alice.files.retrieve(upload.id)
    with pytest.raises(openai.NotFoundError):
        alice.files.content(upload.id)
    assert upload.id not in {f.id for f in alice.files.list()}


def test_chat_and_rerank_lines_answer_as_their_sync_routes(families):
    """The other endpoints a batch takes, on the session gateway (no keys): a chat batch
    (greedy, so the text is the sync route's) and a rerank batch, each line's body equal
    to what its sync route answers, but for the ids and timestamps each answer makes."""
    client = openai.OpenAI(base_url=f"{families.url}/v1", api_key="unused", max_retries=0)
    chats = {f"c{i}": {"model": LLAMA, "max_tokens": 6, "temperature": 0,
                       "messages": [{"role": "user", "content": f"Count to {i}."}]}
             for i in range(3)}
    reranks = {f"r{i}": {"model": RERANKER, "query": f"query {i}", "top_n": 2,
                         "documents": ["a cat", "a dog", f"number {i}"]} for i in range(3)}
    for endpoint, bodies in (("/v1/chat/completions", chats), ("/v1/rerank", reranks)):
        upload = _upload(client, [_line(cid, body, url=endpoint) for cid, body in
                                  bodies.items()])
        batch = client.batches.create(input_file_id=upload.id, endpoint=endpoint,
                                      completion_window="24h")
        done = _finished(client, batch.id)
        assert done.request_counts.completed == len(bodies) and done.error_file_id is None
        output = _lines(client, done.output_file_id)
        assert sorted(line["custom_id"] for line in output) == sorted(bodies)
        for line in output:
            got = line["response"]["body"]
            want = httpx.post(f"{families.url}{endpoint}", json=bodies[line["custom_id"]],
                              timeout=60)
            assert line["response"]["status_code"] == want.status_code == 200, want.text
            want_body = want.json()
            if endpoint == "/v1/rerank":
                assert [r["index"] for r in got["results"]] == \
                    [r["index"] for r in want_body["results"]]
                np.testing.assert_allclose([r["relevance_score"] for r in got["results"]],
                                           [r["relevance_score"] for r in want_body["results"]],
                                           atol=1e-5)
                assert got["meta"] == want_body["meta"] and got["model"] == want_body["model"]
            else:
                same = ("object", "model", "choices", "usage")
                assert {k: got[k] for k in same} == {k: want_body[k] for k in same}
