"""Which requests the HTTP edge answers itself (gateway.edge.hot_requests,
gateway.routes.hot_path.EdgeRoutes) and which go on to the ASGI stack. The answers
themselves are compared with the ASGI path's in tests/e2e/test_hot_edge.py."""

from __future__ import annotations

from types import SimpleNamespace

from starlette.applications import Starlette

from gateway.calls.blob_offload import has_claims
from gateway.edge.hot_requests import router_of, serve_hot
from gateway.routes.hot_path import EdgeRoutes

MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def _routes(cors: list[str] | None = None) -> EdgeRoutes:
    return EdgeRoutes(SimpleNamespace(cors_origins=cors or []))


def test_the_three_hot_routes_and_nothing_else() -> None:
    routes = _routes()
    embeddings = routes.route("/v1/embeddings", [])
    assert embeddings is not None and embeddings[1] == {}
    encode = routes.route(f"/v1/encode/{MODEL}", [])
    assert encode is not None and encode[1] == {"model": MODEL}
    assert routes.route(f"/v1/score/{MODEL}", []) is not None
    for path in ("/v1/encode/", "/v1/extract/m", "/v1/embeddings/", "/embed", "/v1/models"):
        assert routes.route(path, []) is None, path


def test_what_goes_on_to_the_asgi_stack() -> None:
    encode = f"/v1/encode/{MODEL}"
    origin = [(b"origin", b"https://page.example")]
    assert _routes().route(encode, origin) is not None  # no CORS: Origin changes nothing
    assert _routes(["https://page.example"]).route(encode, origin) is None
    assert _routes(["*"]).route("/v1/embeddings", origin) is None
    prefer = [(b"prefer", b"Respond-Async, wait=10")]
    assert _routes().route(encode, prefer) is None  # a job
    assert _routes().route("/v1/embeddings", prefer) is not None  # no jobs there
    # Only the first Prefer counts, as `prefers_async` reads it.
    assert _routes().route(encode, [(b"prefer", b"return=minimal"), *prefer]) is not None


def test_the_app_is_found_behind_uvicorns_wrappers() -> None:
    app = Starlette()
    router = _routes()
    serve_hot(app, router)
    assert router_of(app) == (app, router)
    wrapped = SimpleNamespace(app=SimpleNamespace(app=app))  # e.g. ProxyHeadersMiddleware
    assert router_of(wrapped) == (app, router)
    assert router_of(Starlette()) is None
    assert router_of(object()) is None


def test_only_large_binary_parts_need_an_upload_first() -> None:
    assert not has_claims({"items": [{"text": "a"}, {"tokens": [1, 2]}]}, 10)
    assert not has_claims({"items": [{"image": b"x" * 10}]}, 10)
    assert has_claims({"items": [{"text": "a"}, {"image": b"x" * 11}]}, 10)
    assert not has_claims({"items": "not a list"}, 10)
