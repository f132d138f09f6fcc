"""The model of a request whose route has no `{model}` in its path.

The rerank routes (`gateway.routes.rerank`: Cohere's and Jina's `model` field), TEI's routes
(`gateway.routes.tei` and its siblings: TEI serves one model and names none, so there
`model` is shoal's extension) and the token routes (`gateway.routes.vllm_tokens`) name their
model in the body, if at all. Without one, the route's default model of its kind:

1. the first of SHOAL_DEFAULT_MODELS that is of the route's kind (and that the caller's key
   may use): what a deployment names, it gets;
2. else the gateway's only model of that kind (SHOAL_GATEWAY_MODELS), so a gateway that
   accepts a single reranker answers TEI's `/rerank` as TEI would;
3. else the only one of them that workers serve now (the gateway's pool view, as
   `GET /v1/models` lists them).

Rule 3 reads which workers are up, so the same request may go to another model once a
second one of its kind is served; it is there because a gateway's default accepts every
catalog model (14 dense embedders) while its workers serve one (`make run`: MiniLM), and
clients written for a one-model server (TEI's, huggingface_hub's InferenceClient, litellm's
`huggingface/` provider) send no model name. A deployment that wants the choice fixed names
it in SHOAL_DEFAULT_MODELS. Otherwise the caller must name one: the error lists the models
of the kind and which of them are served now.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from gateway.auth.access import check_model_allowed, models_visible
from gateway.calls.model_call import ROUTE_OF_OPERATION, served_listing, served_now
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
    """The entry `model` names (None: the route's default of `kind`). 404 for a model
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
                       + served_listing(request, candidates(request, kind),
                                        f"{kind.name} models"))
    if not kind.fits(entry):
        raise ApiError(ErrorCode.UNSUPPORTED_OPERATION,
                       f"{model} is not a {kind.name} model: it is a '{entry.adapter}' model "
                       f"({ROUTE_OF_OPERATION[entry.operation]}); {kind.name} models served: "
                       f"{candidates(request, kind)}")
    return entry


def default_model(request: Request, kind: ModelKind) -> ModelEntry | None:
    """The route's default model of `kind` (the module's rules), or None: none fits, or
    several do and none is named or alone in being served."""
    fitting = candidates(request, kind)
    served = request.app.state.served
    for model in request.app.state.settings.default_models:
        if model in fitting:
            return served[model]
    if len(fitting) == 1:
        return served[fitting[0]]
    up = served_now(request, fitting)
    return served[up[0]] if len(up) == 1 else None


def _the_only(request: Request, kind: ModelKind) -> ModelEntry:
    entry = default_model(request, kind)
    if entry is not None:
        return entry
    fitting = candidates(request, kind)
    if not fitting:
        raise ApiError(ErrorCode.MODEL_NOT_FOUND,
                       f"this gateway serves no {kind.name} model (SHOAL_GATEWAY_MODELS)")
    up = served_now(request, fitting)
    now = (f"workers serve {up} now" if up else "no worker serves one now")
    raise ApiError(ErrorCode.INVALID_REQUEST,
                   f"'model' is missing and this gateway serves several {kind.name} models "
                   f"({now}; all it accepts: {fitting}); name one in 'model', or set "
                   "SHOAL_DEFAULT_MODELS")
