"""LoRA naming on the OpenAI routes, and bad `model` values: answered before anything is
published (the app is never started here, so it has no broker: a request that got as far
as publishing would be a 503 BROKER_UNAVAILABLE)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from starlette.testclient import TestClient

from gateway.routes.lora_names import split_model_name
from tasks.settings import Settings

SERVED = {"BAAI/bge-small-en-v1.5", "org/model:v2", "org/model", "plain"}


@pytest.mark.parametrize("name,expected", [
    ("BAAI/bge-small-en-v1.5", ("BAAI/bge-small-en-v1.5", None)),
    ("BAAI/bge-small-en-v1.5:legal", ("BAAI/bge-small-en-v1.5", "legal")),
    # A served id is itself, even with a ':' in it.
    ("org/model:v2", ("org/model:v2", None)),
    ("org/model:v3", ("org/model", "v3")),
    # The last ':' only: the LoRA is what follows it, the base all before.
    ("org/model:v2:fr", ("org/model:v2", "fr")),
    ("plain:a:b", ("plain:a:b", None)),  # 'plain:a' is no served model
    ("plain:", ("plain:", None)),  # no LoRA name: the whole name, a 404 later
    (":x", (":x", None)),
    (":", (":", None)),
    ("unknown:lora", ("unknown:lora", None)),
    ("", ("", None)),
])
def test_split_model_name(name, expected):
    assert split_model_name(name, SERVED) == expected


BASE = "test/lora-base"
GEN = "test/lora-gen"


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> TestClient:
    from gateway.app import create_app

    folder: Path = tmp_path_factory.mktemp("catalog")
    adapter_dir = str(folder)  # never loaded here
    entries = {
        "base": {"id": BASE, "adapter": "dense", "source": {"path": adapter_dir}, "dims": 8},
        "gen": {"id": GEN, "adapter": "causal-lm", "source": {"path": adapter_dir}},
        "other": {"id": "test/not-allowed", "adapter": "dense", "source": {"path": adapter_dir},
                  "dims": 8},
    }
    entries["base"]["loras"] = {"legal": {"path": adapter_dir}, "medical": {"path": adapter_dir}}
    entries["gen"]["loras"] = {"poet": {"path": adapter_dir}}
    for name, entry in entries.items():
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(entry))
    settings = Settings(catalog_dir=folder, gateway_models=["test/lora-*"])
    # No `with`: the lifespan (the broker connection) never runs.
    return TestClient(create_app(settings), raise_server_exceptions=False)


def _error(response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code
    return response.json()["error"]["message"]


def test_the_gateway_serves_the_catalog_models_its_globs_allow(client):
    ids = [m["id"] for m in client.get("/v1/models?all=true").json()["data"]]
    assert BASE in ids and GEN in ids
    assert "test/not-allowed" not in ids
    message = _error(client.post("/v1/embeddings", json={"model": "test/not-allowed",
                                                          "input": "x"}),
                     404, "MODEL_NOT_FOUND")
    assert "SHOAL_GATEWAY_MODELS" in message
    _error(client.post("/v1/encode/test/not-allowed", json={"items": [{"text": "x"}]}),
           404, "MODEL_NOT_FOUND")


@pytest.mark.parametrize("model", [
    None, 5, 1.5, True, [], ["x"], {"a": 1}, "", ":", "::", "x" * 10_000, "\u0000",
    "\ud800".encode("utf-8", "surrogatepass").decode("latin-1"), "../../etc/passwd",
    f"{BASE}:", f":{BASE}", "nobody/nothing:lora",
])
@pytest.mark.parametrize("route", ["/v1/embeddings", "/v1/completions", "/v1/chat/completions"])
def test_a_bad_model_value_is_a_4xx_never_a_500(client, route, model):
    body = {"model": model, "input": "x", "prompt": "x",
            "messages": [{"role": "user", "content": "x"}]}
    if route == "/v1/embeddings":
        del body["prompt"], body["messages"]
    elif route == "/v1/completions":
        del body["input"], body["messages"]
    else:
        del body["input"], body["prompt"]
    response = client.post(route, json=body)
    assert response.status_code in (400, 404), response.text  # OpenAI's statuses
    assert len(response.text) < 20_000  # a long name is not echoed whole


@pytest.mark.parametrize("path", ["/v1/encode/%00", "/v1/encode/a:b", "/v1/encode/" + "x" * 5000,
                                  f"/v1/encode/{BASE}:legal"])
def test_a_bad_native_model_is_a_404(client, path):
    _error(client.post(path, json={"items": [{"text": "x"}]}), 404, "MODEL_NOT_FOUND")


@pytest.mark.parametrize("lora", [5, "", ["legal"]])
def test_a_wrong_lora_field_is_a_400(client, lora):
    _error(client.post("/v1/embeddings", json={"model": BASE, "input": "x", "lora": lora}),
           400, "VALIDATION_ERROR")


def test_model_and_lora_field_must_agree(client):
    message = _error(client.post("/v1/embeddings", json={"model": f"{BASE}:legal",
                                                         "input": "x", "lora": "medical"}),
                     400, "VALIDATION_ERROR")
    assert "legal" in message and "medical" in message


@pytest.mark.parametrize("route,body", [
    ("/v1/embeddings", {"model": f"{BASE}:nope", "input": "x"}),
    ("/v1/embeddings", {"model": BASE, "lora": "nope", "input": "x"}),
    ("/v1/completions", {"model": f"{GEN}:nope", "prompt": "x"}),
    ("/v1/chat/completions", {"model": GEN, "lora": "nope",
                              "messages": [{"role": "user", "content": "x"}]}),
    (f"/v1/encode/{BASE}", {"items": [{"text": "x"}], "options": {"lora": "nope"}}),
])
def test_an_unknown_lora_is_a_404_naming_the_known_ones_without_a_worker(client, route, body):
    message = _error(client.post(route, json=body), 404, "LORA_NOT_FOUND")
    assert "nope" in message
    assert ("legal" in message and "medical" in message) if BASE in message else \
        "poet" in message


@pytest.mark.parametrize("route,body", [
    ("/v1/embeddings", {"model": f"{BASE}:legal", "input": "x"}),
    ("/v1/embeddings", {"model": BASE, "lora": "medical", "input": "x"}),
    ("/v1/completions", {"model": f"{GEN}:poet", "prompt": "x"}),
    ("/v1/chat/completions", {"model": f"{GEN}:poet", "lora": "poet",
                              "messages": [{"role": "user", "content": "x"}]}),
])
def test_a_known_lora_gets_as_far_as_publishing(client, route, body):
    # The app has no broker here: a request that passed every check is refused there.
    _error(client.post(route, json=body), 503, "BROKER_UNAVAILABLE")


def test_v1_models_lists_each_lora_as_a_model(client):
    models = {m["id"]: m for m in client.get("/v1/models?all=true").json()["data"]}
    assert models[BASE]["loras"] == ["legal", "medical"]
    assert models[BASE]["workers"] == []  # no worker has announced it
    assert models[f"{BASE}:legal"]["parent"] == BASE
    assert models[f"{BASE}:legal"]["lora"] == "legal"
    assert models[f"{BASE}:legal"]["object"] == "model"
    assert models[f"{GEN}:poet"]["parent"] == GEN
