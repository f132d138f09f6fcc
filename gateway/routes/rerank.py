"""POST /v1/rerank and /v2/rerank: rerank in the shape Cohere's and Jina's APIs take.

What the rerankers of LangChain, LlamaIndex, Haystack and litellm send, and Cohere's SDK
(its v1 client posts to /v1/rerank, its v2 client, which LangChain and LlamaIndex use, to
/v2/rerank): `{"model", "query", "documents", "top_n", "return_documents", "rank_fields"}`,
each document a string or an object. Both paths take the same body and answer the same
way, one response every one of those clients reads:

    {"id": <X-Request-Id>, "results": [{"index", "relevance_score", "document"?}],
     "meta": {"tokens": {"input_tokens", "output_tokens"}, "warnings"?: [...]},
     "model": ..., "usage": {"total_tokens": ...}}

`results` is best first and cut to `top_n`; `document` (`{"text": ...}`, or the object as
sent) only with `return_documents: true` (false by default, as Cohere's). litellm validates
`document` as `{"text": str}` and refuses `null`, so the key is left out rather than null.
Jina's clients read `model` and `usage`, Cohere's `meta`.

The request is `POST /v1/score/{model}`'s, built the same way and sent to the same model
and batches: the scores are /v1/score's, bit for bit. An object document is ranked on its
`text`; with `rank_fields`, on those fields as `key: value` lines in that order (the YAML
Cohere's semi-structured rerank reads). `max_chunks_per_doc`, `max_tokens_per_doc` and
`priority` are taken and not applied (a document is truncated to the model's length; the
first two say so in `meta.warnings`); a field none of these clients sends is ignored, and
named in `meta.warnings`.

Errors are in the shape Cohere's and Jina's clients read (`gateway.edge.compat_errors`).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.calls.model_call import call_model, check_items, wire_items
from gateway.calls.model_choice import ModelKind, chosen_model
from gateway.edge.api_errors import invalid
from gateway.edge.codecs import encode_response, read_body
from gateway.edge.compat_errors import rerank_error
from gateway.edge.error_shapes import ROUTE_SHAPES
from tasks.adapters import SCORE
from tasks.catalog import ModelEntry
from tasks.render import names, shown
from tasks.results import ranked

RERANKERS = ModelKind("rerank", lambda entry: entry.operation == SCORE)
PATHS = ("/v1/rerank", "/v2/rerank")
ROUTE_SHAPES.update(dict.fromkeys(PATHS, rerank_error))  # errors as Cohere and Jina send them

_FIELDS = frozenset({"model", "query", "documents", "top_n", "return_documents",
                     "rank_fields", "max_chunks_per_doc", "max_tokens_per_doc", "priority"})
_NOT_APPLIED = {
    "max_chunks_per_doc": "max_chunks_per_doc is not applied: a document longer than the "
                          "model's limit is truncated, not split into chunks",
    "max_tokens_per_doc": "max_tokens_per_doc is not applied: a document is truncated to the "
                          "model's own limit",
}
_DOCUMENTS = "'documents' must be a non-empty list of strings or objects with a 'text'"


async def rerank(request: Request) -> Response:
    body = await read_body(request, request.app.state.settings.max_body_bytes)
    if not isinstance(body, dict):
        raise invalid("the body must be an object with 'model', 'query' and 'documents'")
    return await cohere_rerank(request, body)


async def cohere_rerank(request: Request, body: dict[str, Any]) -> Response:
    """A body in Cohere's and Jina's shape, answered in that shape (see the module doc)."""
    entry, kwargs, texts = _task(request, body)
    reply = await call_model(request, entry, kwargs)
    payload = rerank_payload(body, reply.result, getattr(request.state, "request_id", None),
                             entry.id, texts)
    return encode_response(request, payload, headers=reply.headers)


def rerank_task(request: Request, body: dict[str, Any]) -> tuple[ModelEntry, dict[str, Any]]:
    """The reranker's entry and the score task's kwargs for a body, checked as this route
    checks it (an OpenAI batch line's body too: `gateway.routes.batch_endpoints`)."""
    entry, kwargs, _ = _task(request, body)
    return entry, kwargs


def _task(request: Request, body: dict[str, Any]
          ) -> tuple[ModelEntry, dict[str, Any], list[str]]:
    entry = chosen_model(request, body.get("model"), RERANKERS)
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise invalid("'query' must be a non-empty string: the query to rank the documents by")
    top_n = top_n_of(body.get("top_n"))
    _flag(body, "return_documents")
    texts = _texts(body.get("documents"), _rank_fields(body.get("rank_fields")))
    kwargs: dict[str, Any] = {"model": entry.id, "query": query,
                              "items": [{"text": text} for text in texts]}
    if top_n is not None:
        kwargs["options"] = {"top_n": top_n}
    parsed = entry.parse(kwargs)
    check_items(request, parsed)
    kwargs["items"] = wire_items(parsed)
    return entry, kwargs, texts


def rerank_payload(body: dict[str, Any], result: dict[str, Any], request_id: str | None,
                   model: str, texts: list[str] | None = None) -> dict[str, Any]:
    """This route's response body for a body checked by `rerank_task` and its result
    (`texts`: what each document was ranked on, found again when not given)."""
    documents = body["documents"]
    if texts is None:
        texts = _texts(documents, _rank_fields(body.get("rank_fields")))
    top_n = top_n_of(body.get("top_n"))
    return_documents = _flag(body, "return_documents")
    results = []
    for row in ranked(result, top_n):
        out: dict[str, Any] = {"index": row["index"], "relevance_score": row["score"]}
        if return_documents:
            out["document"] = _returned(documents[row["index"]], texts[row["index"]])
        results.append(out)
    tokens = (result.get("usage") or {}).get("tokens", 0)
    meta: dict[str, Any] = {"tokens": {"input_tokens": tokens, "output_tokens": 0}}
    warnings = _warnings(body)
    if warnings:
        meta["warnings"] = warnings
    return {"id": request_id, "results": results, "meta": meta, "model": model,
            "usage": {"total_tokens": tokens}}


def top_n_of(value: Any) -> int | None:
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise invalid(f"'top_n' must be a whole number from 1 (or null: every document), got "
                      f"{shown(value)}")
    return value


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise invalid(f"'{name}' must be true or false, got {shown(value)}")
    return bool(value)


def _rank_fields(value: Any) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value or \
            not all(isinstance(name, str) and name for name in value):
        raise invalid(f"'rank_fields' must be a non-empty list of field names, got "
                      f"{shown(value)}")
    return value


def _texts(documents: Any, rank_fields: list[str] | None) -> list[str]:
    """The text each document is ranked on (see the module doc)."""
    if not isinstance(documents, list) or not documents:
        raise invalid(_DOCUMENTS)
    texts = []
    for i, document in enumerate(documents):
        if isinstance(document, str):
            texts.append(document)
        elif not isinstance(document, dict):
            raise invalid(f"documents[{i}] is {shown(document)}: {_DOCUMENTS}")
        elif not all(type(k) is str and type(v) is str for k, v in document.items()):
            # Cohere's documents are string fields; what is sent back must be JSON, too.
            raise invalid(f"documents[{i}] must map field names to strings, got "
                          f"{shown(document)}")
        elif rank_fields is not None:
            texts.append(_fields_text(document, rank_fields, i))
        elif "text" in document:
            texts.append(document["text"])
        else:
            raise invalid(f"documents[{i}] has no 'text': rank an object on its 'text', or "
                          "name the fields to rank it on in 'rank_fields'")
    return texts


def _fields_text(document: dict[str, Any], rank_fields: list[str], i: int) -> str:
    lines = [f"{name}: {document[name]}" for name in rank_fields if name in document]
    if not lines:
        raise invalid(f"documents[{i}] has none of the rank_fields {rank_fields}")
    return "\n".join(lines)


def _returned(document: str | dict[str, Any], text: str) -> dict[str, Any]:
    """A document as `return_documents` gives it back: `{"text"}` for a string, the object
    as sent otherwise (with the text it was ranked on as `text` where it has none: litellm
    reads every document as `{"text": str}`)."""
    if isinstance(document, str):
        return {"text": document}
    return document if "text" in document else {**document, "text": text}


def _warnings(body: dict[str, Any]) -> list[str]:
    warnings = [why for name, why in _NOT_APPLIED.items() if body.get(name) is not None]
    unknown = set(body) - _FIELDS
    if unknown:
        warnings.append(f"unknown fields ignored: {names(unknown)}; rerank takes "
                        f"{sorted(_FIELDS)}")
    return warnings
