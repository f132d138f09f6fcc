"""CORS for browsers that call the gateway from a page of another origin (SHOAL_CORS_ORIGINS).

Off by default: no CORS headers, and a preflight (OPTIONS) is answered as any OPTIONS is
(405, or 401 with API keys on). With origins set, Starlette's CORSMiddleware is the
outermost layer of the app, so that:

- a preflight is answered before the API-key checks (a browser sends it without the
  `Authorization` header the real request will carry), and before the routes;
- every response to an allowed origin carries its headers, errors included (a refusal
  of the keys middleware, a 500 the outer middleware answers): otherwise a browser hides
  the error body and the page sees only "network error";
- the routes that bypass Starlette's router (`gateway.routes.hot_path`) are covered too.

A preflight may ask for any request header (the allowed list mirrors what it asks for:
`authorization`, `content-type`, `x-timeout-ms`, `x-request-id`, and the `x-stainless-*`
headers the openai JavaScript SDK sends); the headers a page may read back are listed in
`EXPOSED`. No credentials (cookies): keys travel in `Authorization`.
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware

from tasks.settings import Settings

METHODS = ["GET", "POST", "DELETE", "OPTIONS"]
# Response headers a page's script may read (beyond the CORS-safelisted ones).
EXPOSED = ["X-Request-Id", "Retry-After", "x-should-retry", "Location", "X-Total-Time-Ms",
           "X-Queue-Time-Ms", "X-Inference-Time-Ms", "X-Batch-Requests", "X-Shoal-Trace"]
MAX_AGE_S = 600  # how long a browser may reuse a preflight's answer


def install_cors(app: Starlette, settings: Settings) -> None:
    """Add CORS as the app's outermost middleware if SHOAL_CORS_ORIGINS names origins;
    call it after every other `add_middleware`."""
    origins = settings.cors_origins
    if not origins:
        return
    app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=METHODS,
                       allow_headers=["*"], expose_headers=EXPOSED, max_age=MAX_AGE_S)
