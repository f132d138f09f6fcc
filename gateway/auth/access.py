"""API keys: `Authorization: Bearer <key>` (what the openai client sends with `api_key=`).

Off unless SHOAL_API_KEYS_FILE is set (`make run` stays open). When it is, every
route but /healthz, /readyz and /metrics (the operator protects /metrics by
network) needs a key from the file: 401 UNAUTHORIZED without one or with a
wrong one, 403 FORBIDDEN for a model the key may not use (`check_model_allowed`,
called where every route resolves its model), 429 RATE_LIMITED with
Retry-After over the key's requests or tokens per minute (`gateway.auth.rate_limit`);
/v1/models lists only the models the key may use. A job belongs to the key that
created it: another key gets 404 JOB_NOT_FOUND for it, as for no job (`gateway.routes.job_routes`).

Tokens per minute count the request body at `CHARS_PER_TOKEN` bytes per token,
the rule the gateway's own cost estimate uses for text (`tasks.token_estimate`), charged
when the request arrives (from Content-Length; a body without one as its bytes
arrive), before anything is queued, so a key cannot overspend by sending many
requests at once. Generated tokens are not counted; a raw image counts its bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Counter
from starlette.requests import Request

from gateway.edge.api_errors import ApiError
from tasks.errors import ErrorCode

if TYPE_CHECKING:
    from gateway.auth.key_file import ApiKey  # for annotations only: yaml, pydantic stay out

STATE_KEY = "api_key"  # in the request's scope state: the ApiKey of the caller
# missing_key, invalid_key (401), forbidden_model (403), requests_per_minute,
# tokens_per_minute (429). Every refusal is in shoal_gateway_requests_total too.
AUTH_REFUSALS = Counter("shoal_gateway_auth_refusals_total", "requests refused by the API-key "
                        "checks, by reason", ["reason"])


def caller_key(request: Request) -> ApiKey | None:
    """The caller's key (None when keys are off)."""
    return request.scope.get("state", {}).get(STATE_KEY)


def models_visible(request: Request, models: list[str]) -> list[str]:
    """`models` the caller's key may use (all of them when keys are off): what an error
    may name without telling a restricted key about the rest of the fleet."""
    key = caller_key(request)
    return models if key is None else [m for m in models if key.allows(m)]


def check_model_allowed(request: Request, model: str) -> None:
    """403 if the caller's key may not use `model`; nothing when keys are off."""
    key = caller_key(request)
    if key is not None and not key.allows(model):
        AUTH_REFUSALS.labels("forbidden_model").inc()
        shown = model if len(model) <= 200 else model[:200] + "..."
        raise ApiError(ErrorCode.FORBIDDEN, f"the API key {key.name!r} may not use the model "
                       f"{shown!r}; it may use {list(key.models)}")
