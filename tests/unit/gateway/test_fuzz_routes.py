"""Fuzz every POST route of the real gateway app with generated JSON and msgpack bodies.

The app runs in-process without its lifespan: its broker never connects, so a body
that passes every check the gateway makes ends at the publish step with 503
BROKER_UNAVAILABLE ("the message broker is not connected"), the designed answer when
the gateway cannot publish, and nothing is ever published or stored. Everything
before publishing (decoding, field and option checks, error messages) is what a
hostile body can reach, and that is what this exercises; what happens after a
publish is the e2e tests' part. This keeps 10,000+ bodies within a minute.

Bodies mix the routes' real field and option names (with values of every type,
nested, wrong) with random keys, including bytes keys next to str keys in msgpack,
plus raw bytes and values nested past any recursion limit. The test asserts no
response is a 5xx other than that designed 503, and that every 4xx and 5xx carries
the error body of its route (OpenAI's envelope on the OpenAI routes).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import msgpack
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.edge.error_shapes import is_openai_path
from tasks.errors import ErrorCode
from tasks.settings import Settings
from tests.conftest import CLIP, COLBERT, LLAMA, MINILM, NER, NLI, RERANKER, SENTIMENT, SPLADE

# Generating a nested body costs hypothesis ~10 ms, posting it ~2 ms: each example is
# posted in 5 variants (`_variants`), 25 routes x 2 codecs x 600 = 30,000 bodies.
EXAMPLES_PER_CASE = 120
BODIES_PER_CASE = 600

ROUTES = {
    "encode": f"/v1/encode/{MINILM}",
    "score": f"/v1/score/{RERANKER}",
    "extract": f"/v1/extract/{NER}",
    "classify": f"/v1/classify/{SENTIMENT}",
    "zero-shot": f"/v1/classify/{NLI}",
    "embeddings": "/v1/embeddings",
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "jobs": "/v1/jobs",
    "batches": "/v1/batches",
    "rerank": "/v1/rerank",
    "rerank-v2": "/v2/rerank",
    "tei-embed": "/embed",
    "tei-rerank": "/rerank",
    "tei-predict": "/predict",
    "tei-embed-sparse": "/embed_sparse",
    "tei-embed-all": "/embed_all",
    "tei-similarity": "/similarity",
    "tei-tokenize": "/tokenize",
    "tei-decode": "/decode",
    "tei-root": "/",
    "vllm-tokenize": "/v1/tokenize",
    "vllm-detokenize": "/v1/detokenize",
    "embeddings-image": "/v1/embeddings",
    "cohere-embed": "/v2/embed",
    "cohere-embed-v1": "/v1/embed",
}
# Routes the gateway answers itself (its tokenizers): a valid body gets 200, not the
# unstarted broker's 503; a model whose files are not on this host gets 503 MODEL_UNAVAILABLE.
ANSWERED_HERE = {"tei-tokenize", "tei-decode", "vllm-tokenize", "vllm-detokenize"}
# The routes that speak another server's API, and their error bodies' keys.
RERANK_SHAPE = {"message", "detail", "error"}
TEI_SHAPE = {"error", "error_type"}
SHAPE_OF_ROUTE = {"/v1/rerank": RERANK_SHAPE, "/v2/rerank": RERANK_SHAPE,
                  "/v2/embed": RERANK_SHAPE, "/v1/embed": RERANK_SHAPE,  # Cohere's
                  "/embed": TEI_SHAPE, "/rerank": TEI_SHAPE, "/predict": TEI_SHAPE,
                  **{path: TEI_SHAPE for path in ("/embed_sparse", "/embed_all", "/similarity",
                                                   "/tokenize", "/decode", "/")}}
# The fields of a valid body that `_variants` fills with generated values, per route.
MAIN_FIELDS = {
    "encode": ("items", "options", "query"), "score": ("items", "options", "query"),
    "extract": ("items", "options", "model"), "classify": ("items", "options", "stream"),
    "zero-shot": ("items", "options", "query"),
    "embeddings": ("input", "model", "dimensions"),
    "completions": ("prompt", "max_tokens", "stop"),
    "chat": ("messages", "temperature", "stream"),
    "jobs": ("items", "options", "operation"),
    "batches": ("input_file_id", "endpoint", "metadata"),
    "rerank": ("documents", "query", "rank_fields"),
    "rerank-v2": ("documents", "top_n", "return_documents"),
    "tei-embed": ("inputs", "dimensions", "prompt_name"),
    "tei-rerank": ("texts", "query", "raw_scores"),
    "tei-predict": ("inputs", "truncate", "truncation_direction"),
    "tei-embed-sparse": ("inputs", "prompt_name", "truncate"),
    "tei-embed-all": ("inputs", "model", "truncation_direction"),
    "tei-similarity": ("inputs", "parameters", "model"),
    "tei-tokenize": ("inputs", "add_special_tokens", "prompt_name"),
    "tei-decode": ("ids", "skip_special_tokens", "model"),
    "tei-root": ("inputs", "parameters", "query"),
    "vllm-tokenize": ("prompt", "messages", "add_special_tokens"),
    "vllm-detokenize": ("tokens", "model", "prompt"),
    "embeddings-image": ("input", "messages", "encoding_format"),
    "cohere-embed": ("inputs", "images", "embedding_types"),
    "cohere-embed-v1": ("texts", "input_type", "truncate"),
}
FIELD_NAMES = [
    # native bodies and items
    "items", "options", "query", "text", "image", "messages", "role", "content",
    # options of every operation
    "normalize", "dimensions", "truncate", "dtype", "output", "is_query", "lora", "top_n",
    "activation", "aggregation", "threshold", "labels", "multi_label", "hypothesis_template",
    "top_k", "max_tokens", "temperature", "top_p", "stop", "seed",
    # OpenAI bodies
    "model", "input", "prompt", "encoding_format", "user", "stream", "stream_options", "n",
    "logprobs", "echo", "response_format", "max_completion_tokens", "include_usage", "type",
    # jobs, and OpenAI's batches
    "operation", "input_file_id", "endpoint", "completion_window", "metadata",
    # rerank (Cohere's and Jina's shape) and TEI's routes
    "documents", "return_documents", "rank_fields", "max_chunks_per_doc", "texts", "inputs",
    "raw_scores", "return_text", "prompt_name", "truncation_direction",
    # TEI's and vLLM's token routes, /similarity
    "ids", "skip_special_tokens", "add_special_tokens", "parameters", "source_sentence",
    "sentences", "tokens", "add_generation_prompt", "continue_final_message",
    "return_token_strs",
    # images (/v1/embeddings, vLLM's messages) and Cohere's embed
    "image_url", "url", "images", "input_type", "embedding_types", "output_dimension",
]
MODELS = [MINILM, RERANKER, NER, SENTIMENT, NLI, LLAMA, CLIP, f"{LLAMA}:nope", "nope", ""]
WORDS = ["encode", "score", "extract", "classify", "generate", "float32", "binary", "dense",
         "sparse", "simple", "sigmoid", "user", "system", "assistant", "base64", "float",
         "This example is {}.", "data:image/png;base64,iVBORw0KGgo=", "aGVsbG8=", "image_url",
         "text", "search_query", "ubinary", "int8", "NONE", "START", "http://127.0.0.1:9/a.png",
         "data:image/bmp;base64,AA==", "data:image/png;base64,%", *MODELS]


PNG_URI = "data:image/png;base64,iVBORw0KGgo="  # bytes the gateway passes on, unopened
IMAGE_PART = {"type": "image_url", "image_url": {"url": PNG_URI}}
VALID = {
    "encode": {"items": [{"text": "a"}]},
    "score": {"query": "q", "items": [{"text": "a"}]},
    "extract": {"items": [{"text": "a"}]},
    "classify": {"items": [{"text": "a"}]},
    "zero-shot": {"items": [{"text": "a"}], "options": {"labels": ["x", "y"]}},
    "embeddings": {"model": MINILM, "input": "a"},
    "embeddings-image": {"model": CLIP, "input": ["a", PNG_URI, IMAGE_PART]},
    "cohere-embed": {"model": CLIP, "input_type": "image", "embedding_types": ["float", "int8"],
                     "inputs": [{"content": [IMAGE_PART]}, {"content": [{"type": "text",
                                                                          "text": "a"}]}]},
    "cohere-embed-v1": {"model": MINILM, "texts": ["a"], "input_type": "search_query"},
    "completions": {"model": LLAMA, "prompt": "a"},
    "chat": {"model": LLAMA, "messages": [{"role": "user", "content": "a"}]},
    "jobs": {"operation": "encode", "model": MINILM, "items": [{"text": "a"}]},
    "batches": {"input_file_id": "file-x", "endpoint": "/v1/embeddings",
                "completion_window": "24h"},
    "rerank": {"model": RERANKER, "query": "q", "documents": ["a", {"text": "b"}]},
    "rerank-v2": {"model": RERANKER, "query": "q", "documents": ["a"], "top_n": 1},
    "tei-embed": {"model": MINILM, "inputs": ["a", [101, 102]]},
    "tei-rerank": {"model": RERANKER, "query": "q", "texts": ["a"]},
    "tei-predict": {"model": SENTIMENT, "inputs": "a"},
    "tei-embed-sparse": {"model": SPLADE, "inputs": ["a", "b"]},
    "tei-embed-all": {"model": COLBERT, "inputs": "a"},
    "tei-similarity": {"model": MINILM, "inputs": {"source_sentence": "a", "sentences": ["b"]}},
    "tei-tokenize": {"model": MINILM, "inputs": ["a", ["q", "d"]]},
    "tei-decode": {"model": MINILM, "ids": [[101, 102]]},
    "tei-root": {"model": MINILM, "inputs": "a"},
    "vllm-tokenize": {"model": MINILM, "prompt": "a"},
    "vllm-detokenize": {"model": MINILM, "tokens": [101, 102]},
}


def _leaves(binary: bool) -> st.SearchStrategy[Any]:
    leaves = [
        st.none(), st.booleans(),
        st.integers(min_value=-(2**63), max_value=2**64 - 1),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=20), st.sampled_from(WORDS), st.sampled_from(FIELD_NAMES),
    ]
    if binary:
        leaves.append(st.binary(max_size=20))
    return st.one_of(*leaves)


def _keys(binary: bool) -> st.SearchStrategy[Any]:
    keys = [st.sampled_from(FIELD_NAMES), st.text(max_size=8)]
    if binary:  # msgpack maps may mix str and bytes keys
        keys.append(st.sampled_from(FIELD_NAMES).map(str.encode))
    return st.one_of(*keys)


def _values(binary: bool) -> st.SearchStrategy[Any]:
    return st.recursive(
        _leaves(binary),
        lambda inner: st.one_of(
            st.lists(inner, max_size=4),
            st.dictionaries(_keys(binary), inner, max_size=4),
        ),
        max_leaves=8,
    )


def _items(binary: bool) -> st.SearchStrategy[Any]:
    text = st.fixed_dictionaries({"text": st.one_of(st.text(max_size=10), _values(binary))})
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x", 1]),
                                     "content": st.one_of(st.text(max_size=10), _values(binary))})
    chat = st.fixed_dictionaries({"messages": st.lists(message, max_size=3)})
    image = st.fixed_dictionaries({"image": st.one_of(st.binary(max_size=8) if binary
                                                      else st.text(max_size=8), _values(binary))})
    return st.lists(st.one_of(text, chat, image, _values(binary)), max_size=4)


def _bodies(binary: bool) -> st.SearchStrategy[Any]:
    """Maps whose keys are mostly the routes' own names, with values right or wrong."""
    known = st.dictionaries(
        st.sampled_from(FIELD_NAMES),
        st.one_of(_values(binary), _items(binary), st.sampled_from(MODELS),
                  st.dictionaries(st.sampled_from(FIELD_NAMES), _values(binary), max_size=5)),
        max_size=6,
    )
    with_model = st.builds(lambda body, model, items: {"model": model, "items": items, **body},
                           known, st.sampled_from(MODELS), _items(binary))
    with_extra = st.builds(lambda body, extra: {**body, **extra}, known,
                           st.dictionaries(_keys(binary), _values(binary), max_size=3))
    return st.one_of(known, with_model, with_extra, _values(binary))


def _deep(depth: int, binary: bool) -> bytes:
    """A body `{"items": [...], "options": <depth nested maps and lists>}`, written by hand:
    encoders refuse to nest that deep, a hostile client does not ask them."""
    if binary:
        head = b"\x82" + msgpack.packb("items") + msgpack.packb([{"text": "a"}])
        return head + msgpack.packb("options") + b"\x81\xa1a\x91" * depth + b"\xc0"
    return b'{"items":[{"text":"a"}],"options":' + b'{"a":[' * depth + b"null" + \
        b"]}" * depth + b"}"


@pytest.fixture(scope="module")
def client() -> Iterator[tuple[asyncio.AbstractEventLoop, httpx.AsyncClient]]:
    from gateway.app import create_app

    # A queue prefix of its own: nothing is published (no lifespan), but nothing could
    # touch the session's queues or jobs either.
    app = create_app(Settings(queue_prefix=f"shoal-fuzz-{uuid.uuid4().hex[:8]}"))
    loop = asyncio.new_event_loop()
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://fuzz")
    yield loop, http
    loop.run_until_complete(http.aclose())
    loop.close()


def _check(response: httpx.Response) -> None:
    status = response.status_code
    if status < 400:
        return
    if response.headers.get("content-type", "").startswith("application/msgpack"):
        body = msgpack.unpackb(response.content)
    else:
        body = orjson.loads(response.content)
    path = response.request.url.path
    compat = SHAPE_OF_ROUTE.get(path)
    if compat is not None:  # Cohere's/Jina's or TEI's shape (gateway.edge.compat_errors)
        assert set(body) == compat and all(body[k] for k in compat), body
        if status >= 500:
            # the unstarted broker, as below, or a model's tokenizer not on this host
            assert status == 503, body
        return
    error = body["error"]
    assert error["code"] in ErrorCode.__members__, body
    assert isinstance(error["message"], str) and error["message"], body
    # OpenAI's envelope and statuses on its routes (400, never 422), shoal's elsewhere.
    if is_openai_path(path):
        assert set(error) == {"message", "type", "param", "code"} and status != 422, body
    else:
        assert set(error) == {"code", "message"}, body
    if status >= 500:
        # The one designed 5xx here: the body passed every check and met the unstarted broker
        # (or, on the token routes, a model whose tokenizer files are not on this host).
        tokenizer = path in ("/v1/tokenize", "/v1/detokenize") and \
            error["code"] == "MODEL_UNAVAILABLE"
        assert (status, error["code"]) == (503, "BROKER_UNAVAILABLE") or \
            (status == 503 and tokenizer), body


def _post(client, route: str, content: bytes, binary: bool) -> httpx.Response:
    loop, http = client
    kind = "application/msgpack" if binary else "application/json"
    return loop.run_until_complete(http.post(ROUTES[route], content=content,
                                             headers={"content-type": kind}))


def _encode(body: Any, binary: bool) -> bytes:
    if binary:
        return msgpack.packb(body, use_bin_type=True)
    return orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS)


def _variants(route: str, body: Any) -> list[Any]:
    """The generated body as it is, over a valid body, and in each of the route's main
    fields of a valid body: every check deep in a valid body meets generated values too
    (and each generated example, the costly part, makes several bodies)."""
    valid = VALID[route]
    merged = {**valid, **body} if isinstance(body, dict) else {**valid, "options": body}
    return [body, merged, *({**valid, field: body} for field in MAIN_FIELDS[route])]


@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_no_generated_body_gets_a_500(client, route: str, binary: bool) -> None:
    posted = 0

    @settings(max_examples=EXAMPLES_PER_CASE, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=_bodies(binary))
    def post(body: Any) -> None:
        nonlocal posted
        for variant in _variants(route, body):
            _check(_post(client, route, _encode(variant, binary), binary))
            posted += 1

    post()
    assert posted >= BODIES_PER_CASE, posted


@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_raw_bytes_and_deep_nesting_get_a_4xx(client, route: str, binary: bool) -> None:
    for depth in (10, 200, 1000, 5000):
        response = _post(client, route, _deep(depth, binary), binary)
        _check(response)
        assert response.status_code < 500, response.text

    @settings(max_examples=50, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(raw=st.binary(max_size=64))
    def post(raw: bytes) -> None:
        _check(_post(client, route, raw, binary))

    post()


@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_a_valid_body_reaches_the_publish_step(client, route: str, binary: bool) -> None:
    """What the fuzz asserts means something: a right body on the same route and codec
    passes every check and gets the unstarted broker's 503, not a 4xx."""
    response = _post(client, route, _encode(VALID[route], binary), binary)
    assert response.status_code == (200 if route in ANSWERED_HERE else 503), response.text
    _check(response)
