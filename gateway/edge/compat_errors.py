"""The error bodies of the routes that speak other servers' APIs: rerank in Cohere's and
Jina's shape (`gateway.routes.rerank`) and Text Embeddings Inference's routes
(`gateway.routes.tei`). Their clients read errors their own way. Each route module registers
its paths' shape in `gateway.edge.error_shapes.ROUTE_SHAPES`, so that every error on them,
wherever it is raised (the route, the API-key middleware, the router's 405, the outer
middleware's 500), comes in that shape, with x-should-retry and Retry-After:

- rerank (`rerank_error`): `{"message", "detail", "error": {"code", "message"}}`, one
  message three times. Cohere's API and SDK carry `message`; Jina's clients (LangChain's
  and LlamaIndex's JinaRerank, Haystack's JinaRanker) raise `resp["detail"]` when a body
  has no `results`; `error` is shoal's own body, its `code` to branch on, and where
  OpenAI-style readers find `error.message`. A field's wrong value (shoal's 422) and too
  many documents (shoal's 413) are 400, the status Cohere's API gives a bad request (its
  SDK's BadRequestError; a 413 it raises as an untyped ApiError); every other status is
  shoal's (`bad_request_status`).
- TEI (`tei_error`): TEI's `{"error": "...", "error_type": "..."}`, the type one of
  Validation, Empty, Backend, Overloaded, Unhealthy (TEI's names, serialised as TEI does),
  with TEI's status where TEI has the case: the wrong kind of model is 424 Backend (TEI's
  "model is not a re-ranker model"), an input over the model's length 422 Validation, an
  empty batch 400 Empty (`EMPTY`); 429 is Overloaded, 503 Unhealthy, any other 5xx
  Backend, any other 4xx Validation with shoal's status (413 too many inputs, 404 a
  `model` not served).
"""

from __future__ import annotations

from typing import Any

from tasks.errors import ErrorCode, ShoalError

# TEI's error types (its ErrorType, serialised by variant name).
VALIDATION = "Validation"
EMPTY = "Empty"
BACKEND = "Backend"
OVERLOADED = "Overloaded"
UNHEALTHY = "Unhealthy"


def empty_batch(field: str) -> ShoalError:
    """TEI's refusal of an empty list: 400 Empty on the TEI routes (400 INVALID_REQUEST
    in shoal's terms)."""
    error = ShoalError(ErrorCode.INVALID_REQUEST, f"`{field}` cannot be empty")
    error.tei_type = EMPTY  # type: ignore[attr-defined]
    return error


def bad_request_status(error: ShoalError) -> int:
    """The status the OpenAI, Cohere and Jina APIs answer: 400 for a field's wrong value
    (shoal's 422) and for too many or too long inputs (shoal's 413 naming the field; those
    clients type 400 as their BadRequestError and leave 413 untyped); a body over the byte
    limit stays 413, and every other status is shoal's."""
    status = error.status
    if status == 422 or (status == 413 and (error.code == ErrorCode.INPUT_TOO_LONG
                                            or error.param is not None)):
        return 400
    return status


def rerank_error(error: ShoalError) -> tuple[int, dict[str, Any]]:
    status = bad_request_status(error)
    return status, {"message": error.message, "detail": error.message,
                    "error": {"code": str(error.code), "message": error.message}}


def tei_error(error: ShoalError) -> tuple[int, dict[str, Any]]:
    status, error_type = _tei_status_and_type(error)
    return status, {"error": error.message, "error_type": error_type}


def _tei_status_and_type(error: ShoalError) -> tuple[int, str]:
    tei_type = getattr(error, "tei_type", None)
    if tei_type is not None:
        return error.status, tei_type
    if error.code == ErrorCode.UNSUPPORTED_OPERATION:
        return 424, BACKEND
    if error.code == ErrorCode.INPUT_TOO_LONG:
        return 422, VALIDATION
    if error.status == 429:
        return 429, OVERLOADED
    if error.status == 503:
        return 503, UNHEALTHY
    return error.status, BACKEND if error.status >= 500 else VALIDATION
