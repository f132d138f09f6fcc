"""POST /v2/embed and /v1/embed: embeddings in Cohere's shape, for Cohere's SDK
(`ClientV2.embed` posts to /v2/embed, `Client.embed` to /v1/embed), LangChain's
`CohereEmbeddings` (the v1 client) and litellm's `cohere/` provider (`api_base` is the whole
URL: ".../v2/embed").

The body: `{"model", "texts" | "images" | "inputs", "input_type", "embedding_types",
"output_dimension", "truncate", "max_tokens", "priority"}`, one of

- `texts`: strings, each embedded as text (a data:image/ URI among them is refused: images
  go in `images`);
- `images`: data:image/<type>;base64, URIs (or http(s) URLs on SHOAL_IMAGE_URL_HOSTS), for a
  model that takes images (`gateway.calls.image_inputs`);
- `inputs` (v2): `[{"content": [{"type": "text", "text"}, {"type": "image_url",
  "image_url": {"url"}}]}]`, each input one vector: its texts joined by newlines, or its one
  image (shoal's image models embed a text or an image, not both together: a mix is a 400).

`input_type` `search_query` embeds with the catalog entry's query prompt, the others
(`search_document`, `classification`, `clustering`, `image`) and none with its document
prompt, as /v1/embeddings does. `output_dimension` is `options.dimensions` (Matryoshka: the
first N, normalised again); `truncate` END (the default) truncates a long text at the
model's length, NONE refuses it; START is refused (shoal truncates at the end only).
`max_tokens` is not applied (a text is truncated at the model's own length; `meta.warnings`
says so), `priority` is taken and ignored, an unknown field is named in `meta.warnings`.

The model runs once in float32; every type of `embedding_types` (float, int8, uint8,
binary, ubinary, base64; default float) is made from those vectors
(`gateway.calls.embedding_types`), so `float` is /v1/embeddings' vector. The answer:

    {"id", "embeddings": {"float": [[...]], ...}, "texts": [...],
     "meta": {"api_version": {"version"}, "billed_units": {"input_tokens"}, "warnings"?},
     "response_type": "embeddings_by_type"}

except on /v1/embed without `embedding_types`, which answers Cohere's v1 shape,
`"embeddings": [[float, ...]]` with `"response_type": "embeddings_floats"`. `texts` are
the texts embedded (none for images); `images` (their sizes) is left out: the gateway does
not decode images. Errors are the rerank routes' Cohere shape (`gateway.edge.compat_errors`):
400 for a bad field, 404 for a model not served, which the SDK raises as
`cohere.errors.BadRequestError`, `NotFoundError`, and so on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.calls.embedding_types import EMBEDDING_TYPES, typed_embeddings
from gateway.calls.image_inputs import (
    DATA_IMAGE,
    ImageRules,
    fetch_images,
    image_rules,
    image_source,
    one_input,
    part_item,
    url_items,
    with_stand_ins,
)
from gateway.calls.model_call import call_model, check_items
from gateway.calls.model_choice import ModelKind, chosen_model
from gateway.calls.native_api import body_limit
from gateway.calls.vectors import dense_array
from gateway.edge.api_errors import invalid
from gateway.edge.codecs import check_body_size, encode_response, read_body
from gateway.edge.compat_errors import rerank_error
from gateway.edge.error_shapes import ROUTE_SHAPES
from tasks.adapters import DENSE, ENCODE
from tasks.catalog import ModelEntry
from tasks.render import names, shown

EMBEDDERS = ModelKind("dense embedding", lambda e: e.operation == ENCODE
                      and e.contract.outputs[0] == DENSE)
PATHS = ("/v2/embed", "/v1/embed")
ROUTE_SHAPES.update(dict.fromkeys(PATHS, rerank_error))  # Cohere's shape, as /v2/rerank's
INPUT_TYPES = {"search_query": True, "search_document": False, "classification": False,
               "clustering": False, "image": False}  # -> options.is_query
_SOURCES = ("texts", "images", "inputs")
_FIELDS = frozenset({"model", *_SOURCES, "input_type", "embedding_types", "output_dimension",
                     "truncate", "max_tokens", "priority"})


@dataclass(frozen=True, slots=True)
class CohereTask:
    """A checked body: the model, the task's kwargs, and what the answer needs."""

    entry: ModelEntry
    kwargs: dict[str, Any]
    texts: list[str]
    types: list[str] | None  # None: v1's floats shape
    warnings: list[str]
    urls: list[dict[str, Any]]  # items whose image URL is still to fetch


async def embed_v2(request: Request) -> Response:
    return await _embed(request, "2")


async def embed_v1(request: Request) -> Response:
    return await _embed(request, "1")


async def _embed(request: Request, version: str) -> Response:
    settings = request.app.state.settings
    body = await read_body(request, max(settings.max_body_bytes, settings.max_claim_body_bytes))
    if not isinstance(body, dict):
        raise invalid("the body must be an object with 'model' and 'texts', 'images' or "
                      "'inputs'")
    task = cohere_task(request, body, version)
    if task.urls:
        await fetch_images(task.urls, image_rules(request, task.entry))
    reply = await call_model(request, task.entry, task.kwargs)
    result = reply.result
    rows = dense_array(result)
    meta: dict[str, Any] = {"api_version": {"version": version},
                            "billed_units": {"input_tokens": result["usage"]["tokens"]}}
    if task.warnings:
        meta["warnings"] = task.warnings
    if task.types is None:
        embeddings: Any = rows
        response_type = "embeddings_floats"
    else:
        embeddings = typed_embeddings(rows, task.types)
        response_type = "embeddings_by_type"
    payload = {"id": getattr(request.state, "request_id", None), "embeddings": embeddings,
               "texts": task.texts, "meta": meta, "response_type": response_type}
    return encode_response(request, payload, headers=reply.headers)


def cohere_task(request: Request, body: dict[str, Any], version: str) -> CohereTask:
    """A Cohere body checked and turned into the encode task's kwargs (the module doc)."""
    entry = chosen_model(request, body.get("model"), EMBEDDERS)
    check_body_size(request, body_limit(request, entry))  # the wide limit: images only
    sources = [name for name in _SOURCES if body.get(name) is not None]
    if len(sources) != 1:
        raise invalid("send one of 'texts', 'images' or 'inputs'"
                      + (f", not {' and '.join(sources)}" if sources else ""))
    (source,) = sources
    if source == "inputs" and version == "1":
        raise invalid("'inputs' is Cohere's v2 field: post it to /v2/embed")
    rules = image_rules(request, entry)
    items = _ITEMS[source](body[source], rules)
    options: dict[str, Any] = {"dtype": "float32", "is_query": _is_query(body)}
    if body.get("output_dimension") is not None:
        dimension = body["output_dimension"]
        if type(dimension) is not int or dimension < 1:
            raise invalid(f"'output_dimension' must be a whole number from 1, got "
                          f"{shown(dimension)}")
        options["dimensions"] = dimension
    options.update(_truncation(body.get("truncate")))
    kwargs = {"model": entry.id, "items": items, "options": options}
    urls = url_items(items)
    check_items(request, entry.parse(with_stand_ins(kwargs) if urls else kwargs))
    types = _types(body.get("embedding_types"), version)
    texts = [item["text"] for item in items if "text" in item]
    return CohereTask(entry, kwargs, texts, types, _warnings(body), urls)


def _texts(value: Any, rules: ImageRules) -> list[dict[str, Any]]:
    if type(value) is not list or not value:
        raise invalid("'texts' must be a non-empty list of strings")
    for i, text in enumerate(value):
        if type(text) is not str or not text:
            raise invalid(f"texts[{i}] must be a non-empty string, got {shown(text)}")
        if text.startswith(DATA_IMAGE):
            raise invalid(f"texts[{i}] is a data:image/ URI: send images in 'images' (or "
                          "'inputs'), not 'texts'")
    return [{"text": text} for text in value]


def _images(value: Any, rules: ImageRules) -> list[dict[str, Any]]:
    if type(value) is not list or not value:
        raise invalid("'images' must be a non-empty list of data:image/<type>;base64, URIs")
    items = []
    for i, uri in enumerate(value):
        if type(uri) is not str or not uri:
            raise invalid(f"images[{i}] must be a data:image/<type>;base64, URI, got "
                          f"{shown(uri)}")
        items.append({"image": image_source(uri, f"images[{i}]", rules)})
    return items


def _inputs(value: Any, rules: ImageRules) -> list[dict[str, Any]]:
    if type(value) is not list or not value:
        raise invalid("'inputs' must be a non-empty list of {'content': [...]}")
    items = []
    for i, one in enumerate(value):
        content = one.get("content") if type(one) is dict else None
        if type(content) is not list or not content or \
                not all(type(part) is dict for part in content):
            raise invalid(f"inputs[{i}] must be {{'content': [...]}}, a non-empty list of "
                          "{'type': 'text', 'text': ...} and {'type': 'image_url', "
                          "'image_url': {'url': ...}} parts")
        parts = [part_item(part, f"inputs[{i}].content[{k}]", rules)
                 for k, part in enumerate(content)]
        items.append(one_input(parts, f"inputs[{i}]", rules))
    return items


_ITEMS = {"texts": _texts, "images": _images, "inputs": _inputs}


def _is_query(body: dict[str, Any]) -> bool:
    input_type = body.get("input_type")
    if input_type is None:
        return False
    if type(input_type) is not str or input_type not in INPUT_TYPES:
        raise invalid(f"'input_type' must be one of {list(INPUT_TYPES)}, got "
                      f"{shown(input_type)}")
    return INPUT_TYPES[input_type]


def _truncation(value: Any) -> dict[str, Any]:
    if value is None or value == "END":
        return {}
    if value == "NONE":
        return {"truncate": False}  # a text over the model's length is refused
    if value == "START":
        raise invalid("'truncate' START is not supported: shoal truncates a long text at its "
                      "end; send END (the default) or NONE (refuse a text that is too long)")
    raise invalid(f"'truncate' must be one of ['NONE', 'START', 'END'], got {shown(value)}")


def _types(value: Any, version: str) -> list[str] | None:
    """The embedding types to answer, in order, once each; None: v1's floats shape."""
    if value is None:
        return None if version == "1" else ["float"]
    if type(value) is not list or not value or \
            not all(type(kind) is str and kind in EMBEDDING_TYPES for kind in value):
        raise invalid(f"'embedding_types' must be a non-empty list of {list(EMBEDDING_TYPES)}, "
                      f"got {shown(value)}")
    return list(dict.fromkeys(value))


def _warnings(body: dict[str, Any]) -> list[str]:
    warnings = []
    if body.get("max_tokens") is not None:
        warnings.append("max_tokens is not applied: a text is truncated at the model's own "
                        "length")
    unknown = set(body) - _FIELDS
    if unknown:
        warnings.append(f"unknown fields ignored: {names(unknown)}; embed takes "
                        f"{sorted(_FIELDS)}")
    return warnings
