"""Images on OpenAI's /v1/embeddings and Cohere's /v2/embed and /v1/embed through the whole
stack, against /v1/encode's vectors for the same bytes and texts: the same model, the same
task, the same numbers. An image for a text-only model, a URL to an unlisted host, bytes
that are no image: each a 400 saying what to fix, and the worker carries on."""

from __future__ import annotations

import base64
import io
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest
from PIL import Image

from tasks.quantize import quantize
from tests.conftest import CLIP, MINILM

pytestmark = pytest.mark.e2e

TEXTS = ["a red square", "the cat sleeps on the mat"]


def post(live: Any, path: str, body: Any) -> httpx.Response:
    return httpx.post(f"{live.url}{path}", json=body, timeout=60)


def ok(r: httpx.Response) -> Any:
    assert r.status_code == 200, r.text
    return r.json()


def refused(r: httpx.Response, *words: str) -> str:
    assert r.status_code == 400, r.text
    body = r.json()
    message = body["error"]["message"] if "detail" not in body else body["message"]
    assert all(w in message for w in words), message
    return message


def png(colour: tuple[int, int, int], size: int = 40, noise: bool = False) -> bytes:
    image = (Image.fromarray(np.random.default_rng(7).integers(0, 255, (size, size, 3),
                                                                 dtype=np.uint8))
             if noise else Image.new("RGB", (size, size), colour))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def encoded(live: Any, model: str, items: list[dict[str, Any]], **options: Any) -> np.ndarray:
    """/v1/encode's vectors (msgpack: images as raw bytes)."""
    body: dict[str, Any] = {"items": items}
    if options:
        body["options"] = options
    r = httpx.post(f"{live.url}/v1/encode/{model}", content=msgpack.packb(body), timeout=60,
                   headers={"content-type": "application/msgpack"})
    assert r.status_code == 200, r.text
    return np.asarray(msgpack.unpackb(r.content)["embeddings"])


def openai_vectors(live: Any, body: dict[str, Any]) -> np.ndarray:
    return np.asarray([d["embedding"] for d in ok(post(live, "/v1/embeddings", body))["data"]])


def assert_same(got: Any, want: Any) -> None:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape
    cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosine.min() >= 0.99999, cosine


# --- /v1/embeddings --------------------------------------------------------------------------


def test_a_data_uri_on_v1_embeddings_is_v1_encodes_image_vector(families):
    red, blue = png((220, 20, 20)), png((20, 20, 220))
    want = encoded(families, CLIP, [{"image": red}, {"text": TEXTS[0]}, {"image": blue}])
    part = {"type": "image_url", "image_url": {"url": uri(blue)}}
    assert_same(openai_vectors(families, {"model": CLIP, "input": [uri(red), TEXTS[0], part]}),
                want)
    assert_same(openai_vectors(families, {"model": CLIP, "input": uri(red)}), want[:1])
    # vLLM's messages: one input, one vector
    messages = [{"role": "user", "content": [part]}]
    assert_same(openai_vectors(families, {"model": CLIP, "messages": messages}), want[2:])
    text = [{"role": "user", "content": [{"type": "text", "text": TEXTS[0]}]}]
    assert_same(openai_vectors(families, {"model": CLIP, "messages": text}), want[1:2])


def test_an_image_over_the_claim_check_size_goes_through_the_blob_store(families):
    big = png((0, 0, 0), size=400, noise=True)  # ~480 KB: over SHOAL_CLAIM_CHECK_BYTES
    assert len(big) > 256 * 1024
    want = encoded(families, CLIP, [{"image": big}])
    assert_same(openai_vectors(families, {"model": CLIP, "input": [uri(big)]}), want)


def test_images_are_refused_clearly(families):
    red = uri(png((220, 20, 20)))
    refused(post(families, "/v1/embeddings", {"model": MINILM, "input": [red]}),
            MINILM, "takes text only", CLIP)
    refused(post(families, "/v1/embeddings", {"model": CLIP, "input": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}),
        "SHOAL_IMAGE_URL_HOSTS")
    for bad, words in (("data:image/png;base64,%", ("base64",)),
                       ("data:image/bmp;base64,AA==", ("image/bmp",))):
        refused(post(families, "/v1/embeddings", {"model": CLIP, "input": bad}), *words)
    refused(post(families, "/v1/embeddings", {"model": CLIP, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": red}},
                                     {"type": "text", "text": "a red square"}]}]}),
        "a text or an image, not both")
    # Bytes that are no image: the worker's 400 for that input, and it carries on.
    junk = "data:image/png;base64," + base64.b64encode(b"not an image at all").decode()
    refused(post(families, "/v1/embeddings", {"model": CLIP, "input": [junk]}),
            "could not be decoded as an image")
    assert openai_vectors(families, {"model": CLIP, "input": [red]}).shape == (1, 16)


# --- /v2/embed and /v1/embed -----------------------------------------------------------------


def test_v2_embed_floats_are_v1_embeddings_vectors(families):
    want = openai_vectors(families, {"model": MINILM, "input": TEXTS})
    body = ok(post(families, "/v2/embed", {"model": MINILM, "texts": TEXTS,
                                           "input_type": "search_document"}))
    assert body["response_type"] == "embeddings_by_type" and body["texts"] == TEXTS
    assert set(body["embeddings"]) == {"float"}
    assert_same(body["embeddings"]["float"], want)
    assert body["meta"]["api_version"] == {"version": "2"}
    assert body["meta"]["billed_units"]["input_tokens"] > 0
    # An image through Cohere's images and inputs is /v1/embeddings' image vector.
    red = uri(png((220, 20, 20)))
    image = openai_vectors(families, {"model": CLIP, "input": [red]})
    for field, value in (("images", [red]), ("inputs", [{"content": [
            {"type": "image_url", "image_url": {"url": red}}]}])):
        got = ok(post(families, "/v2/embed", {"model": CLIP, field: value,
                                              "input_type": "image"}))
        assert_same(got["embeddings"]["float"], image)


def test_every_embedding_type_is_the_float_vector_quantised(families):
    types = ["float", "int8", "uint8", "binary", "ubinary", "base64"]
    body = ok(post(families, "/v2/embed", {"model": MINILM, "texts": TEXTS,
                                           "embedding_types": types}))
    got = body["embeddings"]
    assert list(got) == types
    rows = np.asarray(got["float"], dtype=np.float32)
    dims = rows.shape[1]
    int8 = np.asarray(got["int8"])
    assert int8.shape == rows.shape and int8.min() >= -128 and int8.max() <= 127
    assert (int8 == np.frombuffer(quantize(rows, "int8"), np.int8).reshape(rows.shape)).all()
    assert (np.asarray(got["uint8"]) == int8 + 128).all()
    ubinary = np.asarray(got["ubinary"])
    assert ubinary.shape == (len(TEXTS), dims // 8) and ubinary.min() >= 0
    assert (ubinary == np.packbits(rows > 0, axis=1)).all()
    assert (np.asarray(got["binary"]) == ubinary - 128).all()
    unpacked = [np.frombuffer(base64.b64decode(b), "<f4") for b in got["base64"]]
    assert np.array_equal(np.asarray(unpacked), rows)
    # The worker's own int8 and binary (options.dtype on /v1/encode) are the same numbers.
    items = [{"text": t} for t in TEXTS]
    assert (encoded(families, MINILM, items, dtype="int8") == int8).all()
    assert (encoded(families, MINILM, items, dtype="binary") == ubinary).all()


def test_input_type_and_v1_shapes(families):
    query = ok(post(families, "/v2/embed", {"model": MINILM, "texts": TEXTS[:1],
                                            "input_type": "search_query"}))
    want = encoded(families, MINILM, [{"text": TEXTS[0]}], is_query=True)
    assert_same(query["embeddings"]["float"], want)
    # v1 without embedding_types: Cohere's v1 floats shape; with them, by type.
    floats = ok(post(families, "/v1/embed", {"model": MINILM, "texts": TEXTS}))
    assert floats["response_type"] == "embeddings_floats"
    assert floats["meta"]["api_version"] == {"version": "1"}
    by_type = ok(post(families, "/v1/embed", {"model": MINILM, "texts": TEXTS,
                                              "embedding_types": ["float"]}))
    assert by_type["response_type"] == "embeddings_by_type"
    assert_same(floats["embeddings"], by_type["embeddings"]["float"])
    short = ok(post(families, "/v2/embed", {"model": MINILM, "texts": TEXTS,
                                            "output_dimension": 64}))
    assert np.asarray(short["embeddings"]["float"]).shape == (2, 64)


def test_cohere_errors_come_in_cohere_shape(families):
    r = post(families, "/v2/embed", {"model": "nope", "texts": ["a"]})
    assert r.status_code == 404 and "nope" in r.json()["message"], r.text
    refused(post(families, "/v2/embed", {"model": MINILM, "texts": ["a"], "truncate": "START"}),
            "END")
    refused(post(families, "/v2/embed", {"model": MINILM, "images": [uri(png((1, 2, 3)))]}),
            "takes text only")
    refused(post(families, "/v2/embed", {"model": MINILM, "texts": ["a"],
                                         "embedding_types": ["float16"]}), "embedding_types")
