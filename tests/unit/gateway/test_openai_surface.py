"""The OpenAI surface of the real gateway app, in-process and without a broker: error
envelopes and statuses per route, x-should-retry, /v1/models and /v1/models/{id}, CORS.

The apps run without their lifespan, so nothing is published: a request that passed
every check ends at the publish step with 503 BROKER_UNAVAILABLE. Pool states are fed
to the app's own pool view as the broker would hand them over (`PoolView.update`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml
from openai._utils import path_template
from starlette.testclient import TestClient

from gateway.auth.key_file import hash_key, new_key
from gateway.edge.error_shapes import OPENAI_ROUTES, is_openai_path, openai_body, openai_param
from tasks.errors import ErrorCode, ShoalError, invalid
from tasks.pool_state import encode_state
from tasks.settings import Settings

DENSE = "test/dense-a"  # ids with "/", as the catalog's
OTHER = "test/dense-b"
GEN = "test/gen"
OPENAI_KEYS = {"message", "type", "param", "code"}
ORIGIN = "https://app.example"


def _catalog(folder: Path) -> Path:
    weights = str(folder)  # never loaded here
    entries = {
        "dense-a": {"id": DENSE, "adapter": "dense", "source": {"path": weights}, "dims": 8,
                    "loras": {"legal": {"path": weights}}},
        "dense-b": {"id": OTHER, "adapter": "dense", "source": {"path": weights}, "dims": 8},
        "gen": {"id": GEN, "adapter": "causal-lm", "source": {"path": weights}},
    }
    for name, entry in entries.items():
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(entry))
    return folder


def _app(folder: Path, **settings):
    from gateway.app import create_app

    return create_app(Settings(catalog_dir=folder, gateway_models=["test/*"],
                               queue_prefix=f"shoal-openai-{uuid.uuid4().hex[:8]}",
                               **settings))


@pytest.fixture(scope="module")
def catalog(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _catalog(tmp_path_factory.mktemp("catalog"))


@pytest.fixture(scope="module")
def client(catalog: Path) -> TestClient:
    # No `with`: the lifespan (the broker connection) never runs.
    return TestClient(_app(catalog, max_items=16), raise_server_exceptions=False)


def _openai_error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == OPENAI_KEYS, error
    assert error["code"] == code and error["message"], error
    return error


def _native_error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"code", "message"} and error["code"] == code, error
    return error


# --- the error envelope and statuses, per route -------------------------------------------

@pytest.mark.parametrize(("body", "param"), [
    ({"model": DENSE, "input": "x", "encoding_format": "hex"}, "encoding_format"),
    ({"model": DENSE, "input": "x", "dimensions": 0}, "dimensions"),
    ({"model": DENSE, "input": "x", "lora": 7}, "lora"),
])
def test_a_wrong_field_is_400_invalid_request_error_naming_it(client, body, param):
    r = client.post("/v1/embeddings", json=body)
    error = _openai_error(r, 400, "VALIDATION_ERROR")
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert r.headers["x-should-retry"] == "false"


def test_the_native_routes_keep_their_shape_and_statuses(client):
    r = client.post(f"/v1/encode/{DENSE}", json={"items": [{"text": "x"}],
                                                 "options": {"dimensions": 0}})
    _native_error(r, 422, "VALIDATION_ERROR")
    assert r.headers["x-should-retry"] == "false"
    _native_error(client.post("/v1/encode/no/such", json={"items": [{"text": "x"}]}),
                  404, "MODEL_NOT_FOUND")
    _native_error(client.post(f"/v1/encode/{DENSE}", json={"items": [{"text": "x"}] * 17}),
                  413, "PAYLOAD_TOO_LARGE")
    _native_error(client.get(f"/v1/encode/{DENSE}"), 405, "METHOD_NOT_ALLOWED")
    _native_error(client.get("/v1/nothing-here"), 404, "NOT_FOUND")


def test_an_unknown_model_is_404_naming_the_model(client):
    for path, body in (("/v1/embeddings", {"model": "no/such", "input": "x"}),
                       ("/v1/completions", {"model": "no/such", "prompt": "x"}),
                       ("/v1/chat/completions", {"model": "no/such",
                                                 "messages": [{"role": "user",
                                                               "content": "x"}]})):
        error = _openai_error(client.post(path, json=body), 404, "MODEL_NOT_FOUND")
        assert (error["type"], error["param"]) == ("invalid_request_error", "model")


def test_the_wrong_operation_is_400_naming_the_model(client):
    error = _openai_error(client.post("/v1/embeddings", json={"model": GEN, "input": "x"}),
                          400, "UNSUPPORTED_OPERATION")
    assert error["param"] == "model"


def test_too_many_inputs_are_400_on_openai_routes_and_413_on_native_ones(client):
    error = _openai_error(client.post("/v1/embeddings",
                                      json={"model": DENSE, "input": ["x"] * 17}),
                          400, "PAYLOAD_TOO_LARGE")
    assert error["param"] == "input" and "17 items" in error["message"]
    error = _openai_error(client.post("/v1/completions",
                                      json={"model": GEN, "prompt": ["x"] * 17}),
                          400, "PAYLOAD_TOO_LARGE")
    assert error["param"] == "prompt"
    # At the limit the request gets as far as publishing.
    _openai_error(client.post("/v1/embeddings", json={"model": DENSE, "input": ["x"] * 16}),
                  503, "BROKER_UNAVAILABLE")


def test_a_text_or_token_ids_over_the_length_limit_are_400_naming_input(catalog):
    short = TestClient(_app(catalog, max_text_chars=40), raise_server_exceptions=False)
    # 41 characters; 11 token ids, over 40 / 4
    for inputs in (["ok", "x" * 41], [[101, 102], list(range(101, 112))]):
        error = _openai_error(short.post("/v1/embeddings",
                                         json={"model": DENSE, "input": inputs}),
                              400, "PAYLOAD_TOO_LARGE")
        assert error["param"] == "input" and "item 1" in error["message"], error
    _native_error(short.post(f"/v1/encode/{DENSE}", json={"items": [{"text": "x" * 41}]}),
                  413, "PAYLOAD_TOO_LARGE")


def test_a_body_over_the_byte_limit_stays_413(catalog):
    small = TestClient(_app(catalog, max_body_bytes=1024), raise_server_exceptions=False)
    error = _openai_error(small.post("/v1/embeddings",
                                     json={"model": DENSE, "input": "x" * 2000}),
                          413, "PAYLOAD_TOO_LARGE")
    assert error["param"] is None


def test_starlette_s_own_refusals_on_openai_paths_use_the_envelope(client):
    error = _openai_error(client.get("/v1/embeddings"), 405, "METHOD_NOT_ALLOWED")
    assert error["type"] == "invalid_request_error"
    _openai_error(client.post("/v1/models"), 405, "METHOD_NOT_ALLOWED")
    _openai_error(client.post("/v1/embeddings", content=b"{not json",
                              headers={"content-type": "application/json"}),
                  400, "INVALID_REQUEST")


def test_a_5xx_says_server_error_and_whether_to_retry(client):
    r = client.post("/v1/embeddings", json={"model": DENSE, "input": "x"})
    error = _openai_error(r, 503, "BROKER_UNAVAILABLE")
    assert (error["type"], error["param"]) == ("server_error", None)
    assert r.headers["x-should-retry"] == "true" and r.headers["retry-after"] == "1"
    native = client.post(f"/v1/encode/{DENSE}", json={"items": [{"text": "x"}]})
    _native_error(native, 503, "BROKER_UNAVAILABLE")
    assert native.headers["x-should-retry"] == "true"


def test_msgpack_callers_get_the_same_envelope(client):
    import msgpack

    r = client.post("/v1/embeddings", content=msgpack.packb({"model": "no/such", "input": "x"}),
                    headers={"content-type": "application/msgpack"})
    assert r.status_code == 404
    assert set(msgpack.unpackb(r.content)["error"]) == OPENAI_KEYS


@pytest.mark.parametrize(("path", "error", "param"), [
    ("/v1/embeddings", invalid("'input' must be a string"), "input"),
    ("/v1/embeddings", invalid("items[3].text must be a string"), "input"),
    ("/v1/embeddings", invalid("input[1] is an empty string"), "input"),
    ("/v1/chat/completions", invalid("items[0].messages[1] must have a role"), "messages"),
    ("/v1/completions", ShoalError(ErrorCode.INPUT_TOO_LONG, "items[0] has 900 prompt tokens"),
     "prompt"),
    ("/v1/embeddings", invalid("options.dimensions must be an integer from 1 to 8"),
     "dimensions"),
    ("/v1/embeddings", invalid("X-Timeout-Ms must be a whole number"), None),
    ("/v1/embeddings", invalid("give 'max_tokens' or 'max_completion_tokens', not both"), None),
    ("/v1/embeddings", ShoalError(ErrorCode.FORBIDDEN, "the API key 'k' may not use it"),
     "model"),
    ("/v1/embeddings", ShoalError(ErrorCode.INTERNAL, "'x' broke"), None),
    ("/v1/models", invalid("bad", param="all"), "all"),
])
def test_param_is_the_field_at_fault_in_openai_s_terms(path, error, param):
    assert openai_param(path, error) == param


@pytest.mark.parametrize(("path", "message", "shown"), [
    ("/v1/embeddings", "items[2] has token id 99999", "input[2] has token id 99999"),
    ("/v1/completions", "items[0] has 900 prompt tokens", "prompt[0] has 900 prompt tokens"),
    ("/v1/embeddings", "'input' must be a string", "'input' must be a string"),
    ("/v1/models", "items[0] x", "items[0] x"),  # no items on this route: as it was
])
def test_the_message_names_items_as_the_route_calls_them(path, message, shown):
    assert openai_body(path, invalid(message))["error"]["message"] == shown


def test_the_openai_routes_are_one_named_set():
    assert set(OPENAI_ROUTES) >= {"/v1/embeddings", "/v1/completions", "/v1/chat/completions",
                                  "/v1/models"}
    assert is_openai_path(f"/v1/models/{DENSE}")
    assert not any(is_openai_path(p) for p in (f"/v1/encode/{DENSE}", "/v1/jobs", "/healthz"))


# --- API keys: refused before routing, in the route's shape ---------------------------------

@pytest.fixture(scope="module")
def keyed(catalog: Path, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("keys")
    open_key, limited, other = new_key(), new_key(), new_key()
    path = folder / "keys.yaml"
    path.write_text(yaml.safe_dump({"keys": [
        {"name": "open", "hash": hash_key(open_key)},
        {"name": "limited", "hash": hash_key(limited), "requests_per_minute": 1},
        {"name": "other", "hash": hash_key(other), "models": [OTHER]},
    ]}))
    app = _app(catalog, api_keys_file=path, cors_origins=[ORIGIN])
    client = OneLoop(app)
    yield client, open_key, limited, other
    client.close()


class OneLoop:
    """httpx's ASGI client on one event loop of its own, called synchronously: the rate
    limiter's Redis connection lives on the loop it was made on (TestClient would run each
    request on a new one)."""

    def __init__(self, app) -> None:
        self.loop = asyncio.new_event_loop()
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                      base_url="http://testserver")

    def request(self, method: str, path: str, **kwargs) -> httpx.Response:
        return self.loop.run_until_complete(self.http.request(method, path, **kwargs))

    def get(self, path: str, **kwargs) -> httpx.Response:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, **kwargs) -> httpx.Response:
        return self.request("POST", path, **kwargs)

    def options(self, path: str, **kwargs) -> httpx.Response:
        return self.request("OPTIONS", path, **kwargs)

    def close(self) -> None:
        self.loop.run_until_complete(self.http.aclose())
        self.loop.close()


def test_key_refusals_use_the_envelope_on_openai_routes(keyed):
    client, _, limited, other = keyed
    r = client.post("/v1/embeddings", json={"model": DENSE, "input": "x"})
    error = _openai_error(r, 401, "UNAUTHORIZED")
    assert error["type"] == "invalid_request_error" and r.headers["x-should-retry"] == "false"
    _native_error(client.post(f"/v1/encode/{DENSE}", json={"items": [{"text": "x"}]}),
                  401, "UNAUTHORIZED")
    _openai_error(client.get("/v1/models", headers={"Authorization": "Bearer wrong"}),
                  401, "UNAUTHORIZED")
    error = _openai_error(client.post("/v1/embeddings", json={"model": DENSE, "input": "x"},
                                      headers={"Authorization": f"Bearer {other}"}),
                          403, "FORBIDDEN")
    assert error["param"] == "model"
    auth = {"Authorization": f"Bearer {limited}"}
    assert client.get("/v1/models", headers=auth).status_code == 200
    r = client.get("/v1/models", headers=auth)
    error = _openai_error(r, 429, "RATE_LIMITED")
    assert error["type"] == "requests" and r.headers["x-should-retry"] == "true"
    assert int(r.headers["retry-after"]) >= 1


def test_a_model_the_key_may_not_use_is_403_when_retrieved(keyed):
    client, open_key, _, other = keyed
    _openai_error(client.get(f"/v1/models/{DENSE}", headers={"Authorization": f"Bearer {other}"}),
                  403, "FORBIDDEN")
    r = client.get(f"/v1/models/{OTHER}", headers={"Authorization": f"Bearer {other}"})
    assert r.status_code == 200 and r.json()["id"] == OTHER
    r = client.get("/v1/models?all=true", headers={"Authorization": f"Bearer {other}"})
    assert [m["id"] for m in r.json()["data"]] == [OTHER]
    r = client.get(f"/v1/models/{DENSE}", headers={"Authorization": f"Bearer {open_key}"})
    assert r.status_code == 200


# --- /v1/models and /v1/models/{id} ---------------------------------------------------------

def test_models_lists_what_workers_serve_now_and_everything_on_request(catalog):
    app = _app(catalog)
    client = TestClient(app, raise_server_exceptions=False)
    assert client.get("/v1/models").json() == {"object": "list", "data": []}
    everything = client.get("/v1/models?all=true").json()["data"]
    assert [m["id"] for m in everything] == [DENSE, f"{DENSE}:legal", OTHER, GEN]
    assert all(isinstance(m["created"], int) and m["created"] > 0 for m in everything)
    assert everything[0]["created"] == int((catalog / "dense-a.yaml").stat().st_mtime)
    # A worker announces DENSE (cold: it consumes the queue and loads on demand).
    app.state.broker.pool.update(encode_state({
        "worker": "w1@host", "at": time.time(), "interval_s": 60, "budget_bytes": 10**9,
        "used_bytes": 0, "models": [{"id": DENSE, "state": "cold", "pinned": False,
                                     "bytes": None}]}), time.monotonic())
    served = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in served] == [DENSE, f"{DENSE}:legal"]
    assert served[0]["workers"][0]["worker"] == "w1@host"
    assert served[0]["object"] == "model" and served[0]["owned_by"] == "shoal"
    _openai_error(client.get("/v1/models?all=maybe"), 400, "VALIDATION_ERROR")
    assert client.get("/v1/models?all=false").json()["data"] == served


def test_a_model_is_retrieved_by_its_id_slashes_encoded_or_not(client):
    listed = {m["id"]: m for m in client.get("/v1/models?all=true").json()["data"]}
    # What the openai SDK sends: the id as one path segment, its "/" as %2F.
    sent = path_template("/models/{model}", model=DENSE)
    assert sent == "/models/test%2Fdense-a"
    for path in (f"/v1{sent}", f"/v1/models/{DENSE}"):
        r = client.get(path)
        assert r.status_code == 200, r.text
        assert r.json() == listed[DENSE]
    lora = client.get(f"/v1/models/{DENSE}:legal")
    assert lora.json() == listed[f"{DENSE}:legal"] and lora.json()["parent"] == DENSE
    for unknown in ("no/such", f"{DENSE}:nope", "test"):
        error = _openai_error(client.get(f"/v1/models/{unknown}"), 404, "MODEL_NOT_FOUND")
        assert error["param"] == "model" and error["type"] == "invalid_request_error"


# --- CORS ------------------------------------------------------------------------------------

PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type, x-timeout-ms, "
                                               "x-request-id"}


def test_cors_is_off_by_default(client):
    r = client.options("/v1/embeddings", headers=PREFLIGHT)
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    r = client.post("/v1/embeddings", json={"model": DENSE, "input": "x"},
                    headers={"Origin": ORIGIN})
    assert "access-control-allow-origin" not in r.headers


def test_a_preflight_from_an_allowed_origin_is_answered_before_the_keys(keyed):
    client = keyed[0]
    for path in ("/v1/embeddings", f"/v1/encode/{DENSE}", "/v1/models"):
        r = client.options(path, headers=PREFLIGHT)
        assert r.status_code == 200, (path, r.text)
        assert r.headers["access-control-allow-origin"] == ORIGIN
        allowed = {h.strip() for h in r.headers["access-control-allow-headers"].split(",")}
        assert {"authorization", "content-type", "x-timeout-ms", "x-request-id"} <= allowed
        assert "POST" in r.headers["access-control-allow-methods"]


def test_a_preflight_from_another_origin_gets_no_allow_header(keyed):
    r = keyed[0].options("/v1/embeddings", headers={**PREFLIGHT, "Origin": "https://evil.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


def test_errors_and_the_hot_routes_carry_the_cors_headers(keyed):
    client, open_key = keyed[0], keyed[1]
    refused = client.post("/v1/embeddings", json={"model": DENSE, "input": "x"},
                          headers={"Origin": ORIGIN})
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == ORIGIN
    # Past the keys: the hot path's handler answers (503, no broker here).
    for path, body in (("/v1/embeddings", {"model": DENSE, "input": "x"}),
                       (f"/v1/encode/{DENSE}", {"items": [{"text": "x"}]})):
        r = client.post(path, json=body, headers={"Origin": ORIGIN,
                                                  "Authorization": f"Bearer {open_key}"})
        assert r.status_code == 503, r.text
        assert r.headers["access-control-allow-origin"] == ORIGIN
        exposed = r.headers["access-control-expose-headers"].lower()
        assert "x-request-id" in exposed and "x-should-retry" in exposed


def test_cors_origins_are_read_comma_separated(monkeypatch):
    monkeypatch.setenv("SHOAL_CORS_ORIGINS", "https://a.example, http://localhost:3000")
    assert Settings().cors_origins == ["https://a.example", "http://localhost:3000"]
    monkeypatch.setenv("SHOAL_CORS_ORIGINS", "*")
    assert Settings().cors_origins == ["*"]
    monkeypatch.delenv("SHOAL_CORS_ORIGINS")
    assert Settings().cors_origins == []


def test_a_route_of_another_api_registers_its_own_shape(client, monkeypatch):
    from gateway.edge import error_shapes

    def tei_like(error: ShoalError) -> tuple[int, dict]:
        return 424, {"error": error.message, "error_type": "Backend"}

    monkeypatch.setitem(error_shapes.ROUTE_SHAPES, "/v1/embeddings", tei_like)
    r = client.post("/v1/embeddings", json={"model": GEN, "input": "x"})
    assert r.status_code == 424 and r.json()["error_type"] == "Backend"
    assert r.headers["x-should-retry"] == "false"  # the headers stay every shape's


# --- issue 52's error fixes -------------------------------------------------------------------

def test_an_unknown_model_lists_what_workers_serve_not_the_whole_catalog(catalog):
    app = _app(catalog)
    client = TestClient(app, raise_server_exceptions=False)
    app.state.broker.pool.update(encode_state({
        "worker": "w1@host", "at": time.time(), "interval_s": 60, "budget_bytes": 10**9,
        "used_bytes": 0, "models": [{"id": DENSE, "state": "resident", "pinned": False,
                                     "bytes": None}]}), time.monotonic())
    for path, body in (("/v1/encode/no/such", {"items": [{"text": "x"}]}),
                       ("/v1/embeddings", {"model": "no/such", "input": "x"})):
        message = client.post(path, json=body).json()["error"]["message"]
        assert f"models served now: ['{DENSE}']" in message, message
        assert OTHER not in message and GEN not in message, message
        assert "/v1/models?all=true lists all 3" in message, message


def test_too_many_documents_to_rerank_is_the_400_cohere_types(catalog, tmp_path):
    folder = _catalog(tmp_path)
    (folder / "ranker.yaml").write_text(yaml.safe_dump(
        {"id": "test/ranker", "adapter": "cross-encoder", "source": {"path": str(folder)}}))
    client = TestClient(_app(folder, max_items=4), raise_server_exceptions=False)
    for path in ("/v1/rerank", "/v2/rerank"):
        r = client.post(path, json={"model": "test/ranker", "query": "q",
                                    "documents": ["d"] * 5})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "PAYLOAD_TOO_LARGE"
        assert "limit of 4" in r.json()["message"]


@pytest.mark.parametrize("path", ["/v1/embeddings", f"/v1/encode/{DENSE}", "/v1/rerank"])
def test_a_body_that_is_not_utf8_says_so_and_where(client, path):
    body = b'{"model": "' + DENSE.encode() + b'", "input": "caf\xe9"}'
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    text = r.text
    assert "not UTF-8" in text and f"offset {body.index(0xe9)} (0xe9)" in text, text
    assert "surrogates" not in text
