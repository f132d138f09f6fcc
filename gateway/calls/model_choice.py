"""The model of a request whose route has no `{model}` in its path.

The rerank routes (`gateway.routes.rerank`: Cohere's and Jina's `model` field) and TEI's
routes (`gateway.routes.tei`: TEI serves one model and names none, so there `model` is
shoal's extension) name their model in the body, if at all. Without one, the gateway's
only model of the route's kind is the one, so a gateway that serves a single reranker
answers TEI's `/rerank` as TEI would; with several, the caller must name one. The choice
is made from the gateway's own models (SHOAL_GATEWAY_MODELS), never from which workers are
up at the moment: the same request always goes to the same model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from gateway.auth.access import check_model_allowed, models_visible
from gateway.calls.model_call import ROUTE_OF_OPERATION
from gateway.edge.api_errors import ApiError, invalid
from tasks.catalog import ModelEntry
from tasks.errors import ErrorCode
from tasks.render import shown


@dataclass(frozen=True, slots=True)
class ModelKind:
    """What a route needs of its model: `fits` says whether an entry is one, `name` says
    what one is in error messages ("rerank", "dense text embedding")."""

    name: str
    fits: Callable[[ModelEntry], bool]


def candidates(request: Request, kind: ModelKind) -> list[str]:
    """The gateway's models of `kind` that the caller's key may use, sorted."""
    served = request.app.state.served
    return models_visible(request, sorted(m for m, e in served.items() if kind.fits(e)))


def chosen_model(request: Request, model: Any, kind: ModelKind) -> ModelEntry:
    """The entry `model` names (None: the gateway's only model of `kind`). 404 for a model
    not served here, UNSUPPORTED_OPERATION for one of another kind, 400 INVALID_REQUEST
    when `model` is left out and several fit; each message lists the ones that fit."""
    if model is None:
        return _the_only(request, kind)
    if not isinstance(model, str) or not model:
        raise invalid(f"'model' must be a non-empty string, one of the {kind.name} models "
                      f"served here: {candidates(request, kind)}")
    check_model_allowed(request, model)  # 403 before anything says whether it exists
    entry = request.app.state.served.get(model)
    if entry is None:
        raise ApiError(ErrorCode.MODEL_NOT_FOUND, f"model {shown(model)} is not served here; "
                       f"{kind.name} models served: {candidates(request, kind)}")
    if not kind.fits(entry):
        raise ApiError(ErrorCode.UNSUPPORTED_OPERATION,
                       f"{model} is not a {kind.name} model: it is a '{entry.adapter}' model "
                       f"({ROUTE_OF_OPERATION[entry.operation]}); {kind.name} models served: "
                       f"{candidates(request, kind)}")
    return entry


def _the_only(request: Request, kind: ModelKind) -> ModelEntry:
    fitting = candidates(request, kind)
    if len(fitting) == 1:
        return request.app.state.served[fitting[0]]
    if not fitting:
        raise ApiError(ErrorCode.MODEL_NOT_FOUND,
                       f"this gateway serves no {kind.name} model (SHOAL_GATEWAY_MODELS)")
    raise ApiError(ErrorCode.INVALID_REQUEST,
                   f"'model' is missing and this gateway serves several {kind.name} models: "
                   f"{fitting}; name one in 'model'")
