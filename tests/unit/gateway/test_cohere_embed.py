"""Cohere's embed body as the encode task's kwargs (`gateway.routes.cohere_embed`), on the real
gateway app without a broker, and Cohere's embedding types made from float vectors
(`gateway.calls.embedding_types`): the shapes and ranges Cohere's SDK documents, the bytes
the workers' own quantiser gives."""

from __future__ import annotations

import asyncio
import base64
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from starlette.requests import Request

from gateway.calls.embedding_types import EMBEDDING_TYPES, typed_embeddings
from gateway.routes.cohere_embed import cohere_task
from tasks.errors import ShoalError
from tasks.quantize import quantize
from tasks.settings import Settings

TEXT = "test/text"
CLIP = "test/clip"
URI = "data:image/png;base64," + base64.b64encode(b"\x89PNG fake").decode()


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory):
    from gateway.app import create_app

    folder = tmp_path_factory.mktemp("catalog")
    entries = {"text": {"id": TEXT, "adapter": "dense", "source": {"path": str(folder)},
                        "dims": 16, "prompts": {"query": "query: ", "document": "doc: "}},
               "clip": {"id": CLIP, "adapter": "clip", "source": {"path": str(folder)},
                        "dims": 16, "image_tokens": 5}}
    for name, entry in entries.items():
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(entry))
    return create_app(Settings(catalog_dir=Path(folder), gateway_models=["test/*"],
                               queue_prefix=f"shoal-cohere-{uuid.uuid4().hex[:8]}"))


def _task(app, body: dict, version: str = "2"):
    request = Request({"type": "http", "app": app, "method": "POST", "path": "/v2/embed",
                       "headers": []})
    return cohere_task(request, body, version)


def test_fields_become_the_tasks_options(app):
    task = _task(app, {"model": TEXT, "texts": ["a", "b"], "input_type": "search_query",
                       "output_dimension": 8, "truncate": "NONE",
                       "embedding_types": ["int8", "float", "int8"], "max_tokens": 5,
                       "colour": "red"})
    assert task.kwargs == {"model": TEXT, "items": [{"text": "a"}, {"text": "b"}],
                           "options": {"dtype": "float32", "is_query": True, "dimensions": 8,
                                       "truncate": False}}
    # The entry's query prompt is what the worker puts before each text.
    parsed = task.entry.parse(task.kwargs)
    assert parsed.options.is_query and task.entry.prompts.query == "query: "
    assert task.types == ["int8", "float"] and task.texts == ["a", "b"]
    assert any("max_tokens" in w for w in task.warnings)
    assert any("colour" in w for w in task.warnings)
    for input_type in ("search_document", "classification", "clustering", "image", None):
        body = {"model": TEXT, "texts": ["a"], "input_type": input_type}
        assert _task(app, body).kwargs["options"]["is_query"] is False
    assert _task(app, {"model": TEXT, "texts": ["a"]}, "1").types is None  # v1 floats
    assert _task(app, {"model": TEXT, "texts": ["a"]}, "2").types == ["float"]


def test_images_and_inputs_for_an_image_model(app):
    task = _task(app, {"model": CLIP, "images": [URI], "input_type": "image"})
    assert task.kwargs["items"] == [{"image": b"\x89PNG fake"}] and task.texts == []
    task = _task(app, {"model": CLIP, "inputs": [
        {"content": [{"type": "text", "text": "a cat"}]},
        {"content": [{"type": "image_url", "image_url": {"url": URI}}]}]})
    assert task.kwargs["items"] == [{"text": "a cat"}, {"image": b"\x89PNG fake"}]
    assert task.texts == ["a cat"]


@pytest.mark.parametrize(("body", "words"), [
    ({"model": TEXT}, ("one of 'texts', 'images' or 'inputs'",)),
    ({"model": TEXT, "texts": ["a"], "images": [URI]}, ("not texts and images",)),
    ({"model": TEXT, "images": [URI]}, ("images[0]", TEXT, "takes text only", CLIP)),
    ({"model": TEXT, "texts": [URI]}, ("texts[0]", "'images'")),
    ({"model": TEXT, "texts": ["a", ""]}, ("texts[1]",)),
    ({"model": TEXT, "texts": ["a"], "input_type": "search"}, ("input_type", "search_query")),
    ({"model": TEXT, "texts": ["a"], "truncate": "START"}, ("START", "END")),
    ({"model": TEXT, "texts": ["a"], "truncate": "end"}, ("'truncate'",)),
    ({"model": TEXT, "texts": ["a"], "embedding_types": ["float16"]}, ("embedding_types",)),
    ({"model": TEXT, "texts": ["a"], "embedding_types": []}, ("embedding_types",)),
    ({"model": TEXT, "texts": ["a"], "output_dimension": 0}, ("output_dimension",)),
    ({"model": CLIP, "images": ["https://x.example/a.png"]}, ("SHOAL_IMAGE_URL_HOSTS",)),
    ({"model": CLIP, "inputs": [{"content": [{"type": "text", "text": "a"},
                                             {"type": "image_url", "image_url": {"url": URI}}]}]},
     ("inputs[0]", "not both together")),
    ({"model": CLIP, "inputs": [{"content": []}]}, ("inputs[0]",)),
])
def test_bad_bodies_are_refused_saying_what_to_fix(app, body: dict, words: tuple[str, ...]):
    with pytest.raises(ShoalError) as caught:
        _task(app, body)
    assert all(w in caught.value.message for w in words), caught.value.message


@pytest.mark.parametrize("path", ["/v2/embed", "/v1/embed"])
def test_errors_have_cohere_s_shape_and_status(app, path: str):
    async def post(body: dict) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://cohere") as client:
            return await client.post(path, json=body)

    bad = asyncio.run(post({"model": TEXT, "texts": ["a"], "truncate": "START"}))
    assert bad.status_code == 400  # cohere.errors.BadRequestError
    assert set(bad.json()) == {"message", "detail", "error"} and "END" in bad.json()["message"]
    missing = asyncio.run(post({"model": "nope", "texts": ["a"]}))
    assert missing.status_code == 404 and "nope" in missing.json()["message"]  # NotFoundError
    valid = asyncio.run(post({"model": TEXT, "texts": ["a"]}))
    assert valid.status_code == 503  # every check passed; no broker here


def test_embedding_types_are_the_float_vectors_quantised():
    rows = np.random.default_rng(3).normal(size=(3, 20)).astype(np.float32)
    got = typed_embeddings(rows, list(EMBEDDING_TYPES))
    assert got["float"] is rows
    int8 = got["int8"]
    assert int8.dtype == np.int8 and int8.shape == (3, 20) and np.abs(int8).max() == 127
    assert int8.tobytes() == quantize(rows, "int8")
    assert got["uint8"].dtype == np.uint8
    assert (got["uint8"].astype(int) == int8.astype(int) + 128).all()
    ubinary = got["ubinary"]
    assert ubinary.dtype == np.uint8 and ubinary.shape == (3, 3)  # ceil(20 / 8)
    assert ubinary.tobytes() == quantize(rows, "binary")
    assert (np.unpackbits(ubinary, axis=1)[:, :20] == (rows > 0)).all()
    assert got["binary"].dtype == np.int8
    assert (got["binary"].astype(int) == ubinary.astype(int) - 128).all()
    decoded = np.asarray([np.frombuffer(base64.b64decode(b), "<f4") for b in got["base64"]])
    assert np.array_equal(decoded, rows)
    assert list(typed_embeddings(rows, ["ubinary", "float"])) == ["ubinary", "float"]


def test_only_a_model_that_takes_images_gets_the_wider_body_limit(app):
    """SHOAL_MAX_CLAIM_BODY_BYTES for an image model's body, SHOAL_MAX_BODY_BYTES for the
    others', on /v1/embeddings and /v2/embed alike."""
    size = app.state.settings.max_body_bytes + 1000
    image = "data:image/png;base64," + "A" * size

    async def post(path: str, body: dict) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://limits") as client:
            return await client.post(path, json=body)

    for path, field in (("/v1/embeddings", "input"), ("/v2/embed", "images")):
        too_large = asyncio.run(post(path, {"model": TEXT, field: [image]}))
        assert too_large.status_code == 413, too_large.text
        taken = asyncio.run(post(path, {"model": CLIP, field: [image]}))
        assert taken.status_code == 503, taken.text  # past every check; no broker here
