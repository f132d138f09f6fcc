"""API keys end to end: a gateway of its own with SHOAL_API_KEYS_FILE, the session's worker.

401 without a key or with a wrong one, 403 for a model the key may not use on every
route that names a model, 429 with Retry-After over a key's requests or tokens per
minute, the official openai client with a key, /v1/models filtered, keys rotated by
editing the file, and the open routes that need none.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import msgpack
import openai
import pytest
import yaml

from gateway.auth.key_file import hash_key, new_key
from tests.conftest import MINILM, TINY_CLS
from tests.stack import free_port, http_status, metric_sum, wait_for

pytestmark = pytest.mark.e2e

ENCODE = {"items": [{"text": "keys"}]}


class Keys:
    """The test gateway's URL and one key per kind."""

    def __init__(self, url: str, path: Path) -> None:
        self.url = url
        self.path = path
        self.all, self.tiny, self.limited, self.tokens, self.tests = (new_key()
                                                                      for _ in range(5))
        self.tiny_two, self.ops = new_key(), new_key()

    def entries(self) -> list[dict]:
        return [{"name": "all", "hash": hash_key(self.all)},
                {"name": "tiny-only", "hash": hash_key(self.tiny), "models": [TINY_CLS]},
                {"name": "limited", "hash": hash_key(self.limited), "requests_per_minute": 3},
                {"name": "tokens", "hash": hash_key(self.tokens), "tokens_per_minute": 50},
                {"name": "tests", "hash": hash_key(self.tests), "models": ["test/*"]},
                {"name": "tiny-two", "hash": hash_key(self.tiny_two), "models": [TINY_CLS],
                 "inputs": ["shared/*"]},
                {"name": "ops", "hash": hash_key(self.ops), "models": [TINY_CLS],
                 "admin": True}]

    def write(self, extra: list[dict] = ()) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump({"keys": [*self.entries(), *extra]}))
        tmp.replace(self.path)  # whole, as `shoal keys add --file` writes it


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _refusals(keys: Keys, reason: str) -> float:
    return metric_sum(f"{keys.url}/metrics",
                      f'shoal_gateway_auth_refusals_total{{reason="{reason}"}}')


def _error(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    assert r.headers.get("x-request-id")
    return r.json()["error"]["message"]


@pytest.fixture(scope="module")
def keys(stack, tmp_path_factory) -> Keys:
    folder = tmp_path_factory.mktemp("keys")
    port = free_port()
    keys = Keys(f"http://127.0.0.1:{port}", folder / "keys.yaml")
    keys.write()
    gateway = stack.stack.gateway("keys-gateway", port, [MINILM, TINY_CLS],
                                  SHOAL_API_KEYS_FILE=str(keys.path),
                                  SHOAL_API_KEYS_RELOAD_S="0.2")
    # /readyz needs no key: a load balancer's probe has none.
    wait_for(lambda: http_status(f"{keys.url}/readyz") == 200, 60, "the keyed gateway",
             give_up=lambda: None if gateway.alive() else gateway.log()[-3000:])
    # /v1/models lists what workers serve now: once the session worker's pool state is in.
    wait_for(lambda: {m["id"] for m in httpx.get(f"{keys.url}/v1/models", headers=_auth(
        keys.all), timeout=10).json()["data"]} == {MINILM, TINY_CLS}, 30,
        "the keyed gateway to hear the worker's pool state")
    yield keys
    gateway.stop()


def test_health_readiness_and_metrics_need_no_key(keys):
    for path in ("/healthz", "/readyz", "/metrics"):
        assert httpx.get(f"{keys.url}{path}", timeout=10).status_code == 200, path


@pytest.mark.parametrize(("method", "path", "body"), [
    ("GET", "/v1/models", None),
    ("POST", f"/v1/encode/{MINILM}", ENCODE),
    ("POST", "/v1/embeddings", {"model": MINILM, "input": "x"}),
    ("POST", "/v1/jobs", {"operation": "encode", "model": MINILM, **ENCODE}),
    ("GET", "/v1/jobs/0123456789abcdef", None),
])
def test_no_key_or_a_wrong_one_is_401_with_a_bearer_challenge(keys, method, path, body):
    for headers, challenge in (({}, 'Bearer realm="shoal"'),
                               (_auth(new_key()), 'error="invalid_token"'),
                               (_auth(hash_key(keys.all)), 'error="invalid_token"'),
                               ({"Authorization": f"Basic {keys.all}"}, 'Bearer realm="shoal"')):
        r = httpx.request(method, f"{keys.url}{path}", json=body, headers=headers, timeout=10)
        message = _error(r, 401, "UNAUTHORIZED")
        assert challenge in r.headers["www-authenticate"]
        assert "Authorization: Bearer" in message or "not valid" in message


def test_refusals_are_counted_with_their_status(keys):
    def refused() -> float:
        return metric_sum(f"{keys.url}/metrics",
                          'shoal_gateway_requests_total{route="/v1/models",status="401"}')

    before = refused()
    for _ in range(3):
        httpx.get(f"{keys.url}/v1/models", timeout=10)
    assert refused() == before + 3


def test_a_key_serves_the_models_it_may_use(keys):
    r = httpx.post(f"{keys.url}/v1/encode/{TINY_CLS}", json=ENCODE, headers=_auth(keys.tiny),
                   timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["dims"] == 32


def test_an_unknown_model_names_only_the_models_the_key_may_use(keys):
    """A key allowed a glob asks for a model under it that is not served: the 404 lists the
    served models the key may use, never the rest of the fleet's."""
    r = httpx.post(f"{keys.url}/v1/encode/test/not-served", json=ENCODE,
                   headers=_auth(keys.tests), timeout=30)
    message = _error(r, 404, "MODEL_NOT_FOUND")
    assert TINY_CLS in message
    assert MINILM not in message


@pytest.mark.parametrize(("path", "body", "params", "headers"), [
    (f"/v1/encode/{MINILM}", ENCODE, None, {}),
    (f"/v1/encode/{MINILM}", ENCODE, None, {"Prefer": "respond-async"}),  # a job
    (f"/v1/score/{MINILM}", {"query": "q", **ENCODE}, None, {}),
    ("/v1/embeddings", {"model": MINILM, "input": ["x"]}, None, {}),
    ("/v1/embeddings", {"model": f"{MINILM}:some-lora", "input": "x"}, None, {}),
    ("/v1/completions", {"model": MINILM, "prompt": "x"}, None, {}),
    ("/v1/chat/completions", {"model": MINILM, "messages": [{"role": "user",
                                                             "content": "x"}]}, None, {}),
    ("/v1/jobs", {"operation": "encode", "model": MINILM, **ENCODE}, None, {}),
    ("/v1/jobs", {"operation": "encode", "model": MINILM, "input": "some/file.jsonl"}, None, {}),
    ("/v1/jobs", None, {"operation": "encode", "model": MINILM},
     {"Content-Type": "application/x-ndjson"}),
    ("/v1/encode/not/served", ENCODE, None, {}),  # not even whether it exists is told
])
def test_a_model_the_key_may_not_use_is_403_on_every_route(keys, path, body, params, headers):
    kwargs = ({"content": b'{"text": "x"}\n'} if body is None else {"json": body})
    before = _refusals(keys, "forbidden_model")
    r = httpx.post(f"{keys.url}{path}", params=params, headers={**_auth(keys.tiny), **headers},
                   timeout=10, **kwargs)
    message = _error(r, 403, "FORBIDDEN")
    assert "'tiny-only'" in message and TINY_CLS in message
    assert keys.tiny not in message
    assert _refusals(keys, "forbidden_model") == before + 1


def test_an_allowed_job_is_accepted(keys):
    r = httpx.post(f"{keys.url}/v1/jobs", json={"operation": "encode", "model": TINY_CLS,
                                                 **ENCODE}, headers=_auth(keys.tiny), timeout=30)
    assert r.status_code == 202, r.text
    job = httpx.get(f"{keys.url}{r.headers['location']}", headers=_auth(keys.tiny), timeout=10)
    assert job.status_code == 200 and job.json()["model"] == TINY_CLS


def test_v1_models_lists_only_what_the_key_may_use_in_json_and_msgpack(keys):
    def ids(key: str, packed: bool = False) -> set[str]:
        headers = {**_auth(key), **({"Accept": "application/msgpack"} if packed else {})}
        r = httpx.get(f"{keys.url}/v1/models", headers=headers, timeout=10)
        assert r.status_code == 200, r.text
        body = msgpack.unpackb(r.content) if packed else r.json()
        assert int(r.headers["content-length"]) == len(r.content)
        return {m["id"] for m in body["data"]}

    assert ids(keys.all) == {MINILM, TINY_CLS}
    assert ids(keys.tiny) == {TINY_CLS}
    assert ids(keys.tiny, packed=True) == {TINY_CLS}


def test_over_its_requests_per_minute_a_key_gets_429_with_retry_after(keys):
    before = _refusals(keys, "requests_per_minute")
    statuses = []
    for _ in range(5):
        r = httpx.get(f"{keys.url}/v1/models", headers=_auth(keys.limited), timeout=10)
        statuses.append(r.status_code)
        if r.status_code == 429:
            message = _error(r, 429, "RATE_LIMITED")
            assert "3 requests per minute" in message and "'limited'" in message
            assert 1 <= int(r.headers["retry-after"]) <= 20  # one request back in 60/3 s
    assert statuses[:3] == [200, 200, 200] and statuses[3:] == [429, 429]
    assert _refusals(keys, "requests_per_minute") == before + 2
    # Other keys are not held up by this one's limit.
    assert httpx.get(f"{keys.url}/v1/models", headers=_auth(keys.all),
                     timeout=10).status_code == 200


def test_over_its_tokens_per_minute_a_key_gets_429(keys):
    # ~2,000 bytes: ~500 tokens at 4 bytes a token, over the key's 50 a minute. The first
    # is served (a request is never refused for being larger than a minute's budget) and
    # puts the key in debt; the next waits until the debt is paid back.
    body = {"items": [{"text": "token " * 330}]}
    first = httpx.post(f"{keys.url}/v1/encode/{MINILM}", json=body, headers=_auth(keys.tokens),
                       timeout=30)
    assert first.status_code == 200, first.text
    second = httpx.post(f"{keys.url}/v1/encode/{MINILM}", json=body,
                        headers=_auth(keys.tokens), timeout=30)
    message = _error(second, 429, "RATE_LIMITED")
    assert "50 tokens per minute" in message
    assert int(second.headers["retry-after"]) >= 500  # ~450 tokens of debt at 50/min
    # A request without a body carries no tokens: the key can still read.
    assert httpx.get(f"{keys.url}/v1/models", headers=_auth(keys.tokens),
                     timeout=10).status_code == 200


def test_the_openai_client_works_with_a_key_and_raises_without(keys):
    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{keys.url}/v1", api_key=key, max_retries=0)

    out = client(keys.all).embeddings.create(model=MINILM, input=["one", "two"])
    assert len(out.data) == 2 and len(out.data[0].embedding) == 384
    with pytest.raises(openai.AuthenticationError) as caught:
        client(new_key()).embeddings.create(model=MINILM, input="x")
    assert caught.value.status_code == 401
    # OpenAI's envelope, shoal's code (the refusal is written before any route runs)
    assert caught.value.body["type"] == "invalid_request_error"
    assert caught.value.body["code"] == "UNAUTHORIZED"
    with pytest.raises(openai.PermissionDeniedError):
        client(keys.tiny).embeddings.create(model=MINILM, input="x")
    assert [m.id for m in client(keys.tiny).models.list()] == [TINY_CLS]
    assert client(keys.tiny).models.retrieve(TINY_CLS).id == TINY_CLS
    with pytest.raises(openai.PermissionDeniedError):
        client(keys.tiny).models.retrieve(MINILM)


def test_keys_are_added_and_revoked_by_editing_the_file(keys):
    fresh = new_key()

    def status(key: str) -> int:
        return httpx.get(f"{keys.url}/v1/models", headers=_auth(key), timeout=10).status_code

    assert status(fresh) == 401
    keys.write([{"name": "fresh", "hash": hash_key(fresh)}])
    wait_for(lambda: status(fresh) == 200, 10, "the gateway to read the new key")
    keys.write()
    wait_for(lambda: status(fresh) == 401, 10, "the gateway to drop the revoked key")
    assert status(keys.all) == 200


# --- jobs belong to their key ------------------------------------------------------------

JOB_ROUTES = [("GET", "/v1/jobs/{id}"), ("GET", "/v1/jobs/{id}/result"),
              ("DELETE", "/v1/jobs/{id}")]


def _finished_job(keys: Keys, key: str, model: str) -> str:
    r = httpx.post(f"{keys.url}/v1/jobs", json={"operation": "encode", "model": model,
                                                 **ENCODE}, headers=_auth(key), timeout=30)
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    wait_for(lambda: httpx.get(f"{keys.url}/v1/jobs/{job_id}", headers=_auth(key),
                               timeout=10).json()["state"] == "succeeded", 120,
             f"job {job_id} to succeed")
    return job_id


def test_no_job_is_readable_or_cancellable_across_keys(keys):
    # Three keys: two limited to the tiny model, one allowed all; a job of each kind.
    jobs = {"tiny's own": (_finished_job(keys, keys.tiny, TINY_CLS), keys.tiny),
            "all's, same model": (_finished_job(keys, keys.all, TINY_CLS), keys.all),
            "all's, a model tiny may not use": (_finished_job(keys, keys.all, MINILM),
                                                keys.all)}
    callers = {"tiny-only": keys.tiny, "tiny-two": keys.tiny_two, "all": keys.all}
    crossed = []
    for what, (job_id, owner) in jobs.items():
        for caller_name, caller in callers.items():
            for method, route in JOB_ROUTES:
                r = httpx.request(method, f"{keys.url}{route.format(id=job_id)}",
                                  headers=_auth(caller), timeout=30)
                if caller == owner:
                    assert r.status_code == 200, (what, caller_name, method, route, r.text)
                    continue
                if r.status_code != 404 or r.json()["error"]["code"] != "JOB_NOT_FOUND":
                    crossed.append((what, caller_name, method, route, r.status_code))
                # Said exactly as for a job that does not exist.
                assert job_id in r.json()["error"]["message"]
    assert crossed == []
    unknown = httpx.get(f"{keys.url}/v1/jobs/{'0' * 32}", headers=_auth(keys.tiny), timeout=10)
    assert _error(unknown, 404, "JOB_NOT_FOUND")
    # The jobs are still there for their owners: nobody else's DELETE touched them.
    for job_id, owner in jobs.values():
        r = httpx.get(f"{keys.url}/v1/jobs/{job_id}", headers=_auth(owner), timeout=10)
        assert r.json()["state"] == "succeeded"


def test_an_admin_key_sees_and_cancels_every_job(keys):
    job_id = _finished_job(keys, keys.all, MINILM)  # a model outside the admin's list
    for method, route in JOB_ROUTES:
        r = httpx.request(method, f"{keys.url}{route.format(id=job_id)}",
                          headers=_auth(keys.ops), timeout=30)
        assert r.status_code == 200, (method, route, r.text)


def test_a_job_input_is_only_a_file_the_key_may_read(keys):
    from tasks.blobs import blob_store

    blobs = blob_store(os.environ["SHOAL_BLOB_URL"])
    lines = b"".join(b'{"text": "shared line"}\n' for _ in range(4))
    blobs.put("shared/in.jsonl", lines)
    blobs.put("private/in.jsonl", lines)
    body = {"operation": "encode", "model": TINY_CLS}

    def create(key: str, blob_key: str) -> httpx.Response:
        return httpx.post(f"{keys.url}/v1/jobs", json={**body, "input": blob_key},
                          headers=_auth(key), timeout=30)

    # Granted by the keys file (`inputs: ["shared/*"]`): accepted.
    assert create(keys.tiny_two, "shared/in.jsonl").status_code == 202
    # Not granted: answered as a file that does not exist, whether it does or not.
    for blob_key in ("private/in.jsonl", "private/none.jsonl", "shared/in.jsonl"):
        message = _error(create(keys.tiny, blob_key), 404, "NOT_FOUND")
        assert "no file" in message
