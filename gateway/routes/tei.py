"""Text Embeddings Inference's routes, for clients written for TEI: POST /embed, /rerank,
/predict, in TEI's shapes (router/src/http/types.rs; `gateway.routes.tei_shapes`).

- `/embed` `{"inputs", "normalize"?: true, "truncate"?, "truncation_direction"?,
  "prompt_name"?, "dimensions"?}` → `[[float, ...], ...]`, one vector per input;
- `/rerank` `{"query", "texts", "raw_scores"?: false, "return_text"?: false, "truncate"?,
  "truncation_direction"?, "top_n"?}` → `[{"index", "score", "text"?}]`, best first (`top_n`,
  shoal's extension, keeps the best n); a body in Cohere's shape (`documents`, no `texts`),
  as litellm's infinity/ and hosted_vllm/ providers send to /rerank, is answered as
  `/v1/rerank` answers it;
- `/predict` `{"inputs", "raw_scores"?: false, "truncate"?, "truncation_direction"?}` →
  `[{"score", "label"}]` best first for one input, a list of those for a batch.

They run on the same models and batches as `/v1/encode` (`/v1/embeddings`), `/v1/score` and
`/v1/classify`, with the same task kwargs: the vectors and scores are those routes'. TEI
serves one model; shoal serves many, so a body may name its `model` (shoal's extension,
`gateway.calls.model_choice`): without one, the gateway's only model of the kind the route
needs (a dense text embedder, a reranker, a classifier with its own labels).

Where shoal differs: `truncate` left out is the model's default, true (TEI's
--auto-truncate); `truncation_direction` is Right only; `prompt_name` is `query` or
`document`, the entry's prompts, and left out it is `document`, as on /v1/embeddings;
/predict takes no text pairs and no `raw_scores`; /rerank's `raw_scores` is the model's
logit. Errors are TEI's `{"error", "error_type"}` (`gateway.edge.compat_errors`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.calls.model_call import Reply, call_model, check_items, wire_items
from gateway.calls.model_choice import ModelKind, chosen_model
from gateway.calls.vectors import dense_array
from gateway.edge.api_errors import invalid
from gateway.edge.codecs import encode_response, read_body
from gateway.edge.compat_errors import empty_batch, tei_error
from gateway.edge.error_shapes import ROUTE_SHAPES
from gateway.routes.rerank import RERANKERS, cohere_rerank, top_n_of
from gateway.routes.tei_shapes import (
    embed_items,
    flag,
    predict_texts,
    prompt_options,
    truncation_options,
)
from tasks.adapters import CLASSIFY, DENSE, ENCODE, TEXT
from tasks.catalog import ModelEntry
from tasks.results import ranked

EMBEDDERS = ModelKind("dense text embedding", lambda e: e.operation == ENCODE
                      and e.contract.outputs[0] == DENSE and TEXT in e.contract.inputs)
# Zero-shot models classify too, but need labels that TEI's /predict has no field for.
CLASSIFIERS = ModelKind("sequence classification",
                        lambda e: e.operation == CLASSIFY and e.adapter != "zero-shot")
PATHS = ("/embed", "/rerank", "/predict")
ROUTE_SHAPES.update(dict.fromkeys(PATHS, tei_error))  # errors as TEI sends them

Handler = Callable[[Request, dict[str, Any]], Awaitable[Response]]


def tei_route(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        body = await read_body(request, request.app.state.settings.max_body_bytes)
        if not isinstance(body, dict):
            raise invalid("the body must be a JSON object")
        return await handler(request, body)

    endpoint.__name__ = handler.__name__.lstrip("_")
    return endpoint


async def run_checked(request: Request, entry: ModelEntry, kwargs: dict[str, Any]) -> Reply:
    """Check `kwargs` as /v1/{op}/{model} checks its body, and call the model."""
    parsed = entry.parse(kwargs)
    check_items(request, parsed)
    kwargs["items"] = wire_items(parsed)
    return await call_model(request, entry, kwargs)


async def _embed(request: Request, body: dict[str, Any]) -> Response:
    entry = chosen_model(request, body.get("model"), EMBEDDERS)
    items = embed_items(body.get("inputs"))
    options = {"dtype": "float32", "normalize": flag(body, "normalize", default=True),
               **truncation_options(body)}
    if body.get("dimensions") is not None:
        options["dimensions"] = body["dimensions"]
    options.update(prompt_options(body.get("prompt_name")))
    reply = await run_checked(request, entry,
                              {"model": entry.id, "items": items, "options": options})
    return encode_response(request, dense_array(reply.result), headers=reply.headers)


async def _rerank(request: Request, body: dict[str, Any]) -> Response:
    if "texts" not in body and "documents" in body:
        # Cohere's body on TEI's path: what litellm's infinity/ and hosted_vllm/ providers
        # send to {api_base}/rerank. It gets Cohere's answer, as those servers give.
        return await cohere_rerank(request, body)
    entry = chosen_model(request, body.get("model"), RERANKERS)
    query, texts = body.get("query"), body.get("texts")
    if not isinstance(query, str) or not query:
        raise invalid("'query' must be a non-empty string")
    if type(texts) is not list or not all(isinstance(text, str) for text in texts):
        raise invalid("'texts' must be a list of strings")
    if not texts:
        raise empty_batch("texts")
    options = truncation_options(body)
    if flag(body, "raw_scores"):
        options["activation"] = "none"  # the model's logit, as TEI's raw_scores
    return_text = flag(body, "return_text")
    # Not TEI's (it answers every text) but litellm's huggingface/ provider sends it.
    top_n = top_n_of(body.get("top_n"))
    if top_n is not None:
        options["top_n"] = top_n
    kwargs: dict[str, Any] = {"model": entry.id, "query": query,
                              "items": [{"text": text} for text in texts]}
    if options:
        kwargs["options"] = options
    reply = await run_checked(request, entry, kwargs)
    ranks = []
    for row in ranked(reply.result, top_n):
        rank: dict[str, Any] = {"index": row["index"]}
        if return_text:
            rank["text"] = texts[row["index"]]
        rank["score"] = row["score"]
        ranks.append(rank)
    return encode_response(request, ranks, headers=reply.headers)


async def _predict(request: Request, body: dict[str, Any]) -> Response:
    entry = chosen_model(request, body.get("model"), CLASSIFIERS)
    texts, batch = predict_texts(body.get("inputs"))
    if flag(body, "raw_scores"):
        raise invalid("raw_scores is not supported by /predict here: shoal's classifiers "
                      "answer the model's probabilities (softmax, or sigmoid for multi-label "
                      "models); leave raw_scores out or false")
    kwargs: dict[str, Any] = {"model": entry.id, "items": [{"text": text} for text in texts]}
    options = truncation_options(body)
    if options:
        kwargs["options"] = options
    reply = await run_checked(request, entry, kwargs)
    labels = [[{"score": p["score"], "label": p["label"]} for p in row]
              for row in reply.result["labels"]]
    return encode_response(request, labels if batch else labels[0], headers=reply.headers)


embed = tei_route(_embed)
rerank = tei_route(_rerank)
predict = tei_route(_predict)
# The handlers of a body already read, for TEI's `/` (`gateway.routes.tei_root`).
BODY_HANDLERS: dict[str, Handler] = {"embed": _embed, "rerank": _rerank, "predict": _predict}
