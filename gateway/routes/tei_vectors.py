"""TEI's other vector routes, on the same models and batches as `/v1/encode`:

- `/embed_sparse` `{"inputs", "truncate"?, "truncation_direction"?, "prompt_name"?}` →
  `[[{"index", "value"}, ...], ...]`, each input's non-zero weights over the vocabulary
  (a `sparse` model: SPLADE);
- `/embed_all` (the same body) → `[[[float, ...], ...], ...]`, each input's vectors, one
  per token (a `multivector` model: ColBERT; TEI gives a dense model's token states, which
  shoal's dense models do not return);
- `/similarity` `{"inputs": {"source_sentence", "sentences"}, "parameters"?: {"truncate",
  "truncation_direction", "prompt_name"}}` → `[float, ...]`, the cosine of each sentence's
  vector with the source sentence's (a dense text embedder, as `/embed`).

`inputs` and the fields are read as `/embed` reads them (`gateway.routes.tei_shapes`); the
model is the body's `model` or the default of its kind (`gateway.calls.model_choice`).
Errors are TEI's (`gateway.edge.compat_errors`).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.calls.model_call import Reply
from gateway.calls.model_choice import ModelKind, chosen_model
from gateway.calls.vectors import dense_array
from gateway.edge.api_errors import invalid
from gateway.edge.codecs import encode_response
from gateway.edge.compat_errors import empty_batch, tei_error
from gateway.edge.error_shapes import ROUTE_SHAPES
from gateway.routes.tei import EMBEDDERS, run_checked, tei_route
from gateway.routes.tei_shapes import embed_items, prompt_options, truncation_options
from tasks.adapters import ENCODE, MULTIVECTOR, SPARSE
from tasks.results import multivector_rows

SPARSE_EMBEDDERS = ModelKind("sparse (SPLADE-style) embedding",
                             lambda e: e.operation == ENCODE and e.contract.outputs[0] == SPARSE)
MULTIVECTOR_EMBEDDERS = ModelKind(
    "multivector (per-token, ColBERT-style) embedding",
    lambda e: e.operation == ENCODE and e.contract.outputs[0] == MULTIVECTOR)
PATHS = ("/embed_sparse", "/embed_all", "/similarity")
ROUTE_SHAPES.update(dict.fromkeys(PATHS, tei_error))


def _options(fields: dict[str, Any]) -> dict[str, Any]:
    return {**truncation_options(fields), **prompt_options(fields.get("prompt_name"))}


async def _encode(request: Request, body: dict[str, Any], kind: ModelKind) -> Reply:
    entry = chosen_model(request, body.get("model"), kind)
    kwargs: dict[str, Any] = {"model": entry.id, "items": embed_items(body.get("inputs"))}
    options = _options(body)
    if options:
        kwargs["options"] = options
    return await run_checked(request, entry, kwargs)


async def _embed_sparse(request: Request, body: dict[str, Any]) -> Response:
    reply = await _encode(request, body, SPARSE_EMBEDDERS)
    return encode_response(request, [
        [{"index": i, "value": v} for i, v in zip(row["indices"], row["values"], strict=True)]
        for row in reply.result["embeddings"]], headers=reply.headers)


async def _embed_all(request: Request, body: dict[str, Any]) -> Response:
    reply = await _encode(request, body, MULTIVECTOR_EMBEDDERS)
    return encode_response(request, multivector_rows(reply.result), headers=reply.headers)


def similarity_inputs(value: Any) -> tuple[str, list[str]]:
    """TEI's SimilarityInput: the source sentence and the sentences to compare with it."""
    if not isinstance(value, dict):
        raise invalid("'inputs' must be {\"source_sentence\": text, \"sentences\": [text, ...]}")
    source, sentences = value.get("source_sentence"), value.get("sentences")
    if not isinstance(source, str):
        raise invalid("'inputs.source_sentence' must be a string")
    if type(sentences) is not list or not all(isinstance(s, str) for s in sentences):
        raise invalid("'inputs.sentences' must be a list of strings")
    if not sentences:
        raise empty_batch("inputs.sentences")
    return source, sentences


def cosines(vectors: Any) -> list[float]:
    """The cosine of each row after the first with the first (0 for a zero vector)."""
    import numpy as np

    rows = np.asarray(vectors, dtype=np.float64)
    norms = np.linalg.norm(rows, axis=1)
    norms[norms == 0] = 1.0
    return ((rows[1:] @ rows[0]) / (norms[1:] * norms[0])).astype(np.float32).tolist()


async def _similarity(request: Request, body: dict[str, Any]) -> Response:
    entry = chosen_model(request, body.get("model"), EMBEDDERS)
    source, sentences = similarity_inputs(body.get("inputs"))
    parameters = body.get("parameters")
    if parameters is None:
        parameters = {}
    if not isinstance(parameters, dict):
        raise invalid("'parameters' must be an object: {\"truncate\", \"truncation_direction\", "
                      "\"prompt_name\"}")
    kwargs: dict[str, Any] = {
        "model": entry.id, "items": [{"text": text} for text in (source, *sentences)],
        "options": {"dtype": "float32", **_options(parameters)}}
    reply = await run_checked(request, entry, kwargs)
    return encode_response(request, cosines(dense_array(reply.result)), headers=reply.headers)


embed_sparse = tei_route(_embed_sparse)
embed_all = tei_route(_embed_all)
similarity = tei_route(_similarity)
# The handlers of a body already read, for TEI's `/` (`gateway.routes.tei_root`).
BODY_HANDLERS = {"embed_sparse": _embed_sparse, "similarity": _similarity}
