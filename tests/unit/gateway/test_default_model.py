"""gateway.calls.model_choice: the model of a request that names none, from
SHOAL_DEFAULT_MODELS, the gateway's only model of the kind, or the only one workers serve
now (the gateway's pool view, fed here the workers' real pool-state messages)."""

from __future__ import annotations

import time
import uuid

import pytest
from starlette.requests import Request

from gateway.calls.model_choice import chosen_model, default_model
from gateway.routes.rerank import RERANKERS
from gateway.routes.tei import EMBEDDERS
from gateway.routes.tei_root import root_route
from tasks.errors import ErrorCode, ShoalError
from tasks.pool_state import encode_state
from tasks.settings import Settings
from tests.conftest import MINILM, RERANKER, SENTIMENT, TINY_CLS, UNSERVED


def _request(gateway_models: list[str], default_models: list[str] = (),
             served: list[str] = ()) -> Request:
    from gateway.app import create_app

    app = create_app(Settings(queue_prefix=f"shoal-choice-{uuid.uuid4().hex[:8]}",
                              gateway_models=gateway_models, default_models=list(default_models)))
    if served:
        models = [{"id": m, "state": "resident", "pinned": False, "bytes": 1} for m in served]
        app.state.broker.pool.update(encode_state({"worker": "w1@h", "at": 0.0,
                                                   "models": models}), now=time.monotonic())
    return Request({"type": "http", "app": app, "method": "POST", "path": "/embed",
                    "headers": [], "query_string": b""})


def test_a_named_default_wins_over_the_served_one():
    request = _request([MINILM, TINY_CLS, RERANKER], [RERANKER, TINY_CLS], served=[MINILM])
    assert chosen_model(request, None, EMBEDDERS).id == TINY_CLS  # first of its kind
    assert chosen_model(request, None, RERANKERS).id == RERANKER


def test_the_only_model_of_a_kind_needs_no_worker():
    assert default_model(_request([MINILM, RERANKER]), EMBEDDERS).id == MINILM


def test_the_only_one_served_now_of_several():
    request = _request([MINILM, TINY_CLS, UNSERVED], served=[TINY_CLS, RERANKER])
    assert chosen_model(request, None, EMBEDDERS).id == TINY_CLS


def test_a_default_not_served_here_is_skipped():
    request = _request([MINILM, TINY_CLS], ["nope/model"], served=[MINILM])
    assert chosen_model(request, None, EMBEDDERS).id == MINILM


@pytest.mark.parametrize("served", [[], [MINILM, TINY_CLS]])
def test_several_and_none_alone_served_is_a_400_listing_them(served):
    request = _request([MINILM, TINY_CLS, UNSERVED], served=served)
    with pytest.raises(ShoalError) as raised:
        chosen_model(request, None, EMBEDDERS)
    assert raised.value.code == ErrorCode.INVALID_REQUEST
    message = raised.value.message
    assert "SHOAL_DEFAULT_MODELS" in message and UNSERVED in message
    assert ("no worker serves one now" in message) == (not served)
    if served:
        assert f"workers serve {sorted(served)} now" in message


def test_a_named_model_is_never_overridden():
    request = _request([MINILM, TINY_CLS], [TINY_CLS], served=[TINY_CLS])
    assert chosen_model(request, MINILM, EMBEDDERS).id == MINILM


@pytest.mark.parametrize(("body", "route"), [
    ({"inputs": "hi"}, "embed"),
    ({"inputs": ["a", "b"], "normalize": True}, "embed"),
    ({"inputs": {"source_sentence": "a", "sentences": ["b"]}, "parameters": {}}, "similarity"),
    ({"query": "q", "texts": ["a"]}, "rerank"),
    ({"query": "q", "documents": ["a"]}, "rerank"),
    ({"inputs": "hi", "parameters": {}}, "predict"),  # huggingface_hub's text_classification
    ({"inputs": "hi", "model": SENTIMENT}, "predict"),
    ({"inputs": "hi", "model": RERANKER}, "rerank"),
])
def test_root_routes_by_body_shape_then_model_kind(body, route):
    request = _request([MINILM, TINY_CLS, RERANKER, SENTIMENT], served=[MINILM, SENTIMENT])
    assert root_route(request, body) == route


def test_root_with_inputs_and_two_served_embedders_asks_for_a_model():
    request = _request([MINILM, TINY_CLS, SENTIMENT], served=[MINILM, TINY_CLS, SENTIMENT])
    with pytest.raises(ShoalError) as raised:
        root_route(request, {"inputs": "hi"})
    assert raised.value.code == ErrorCode.INVALID_REQUEST
    assert root_route(request, {"inputs": "hi", "parameters": {}}) == "predict"
