"""TEI's `GET /info`, `GET /health` and `POST /` (with SageMaker's `/invocations`).

- `/info` → TEI's Info object for the model `POST /` serves (`?model=` names another):
  `model_id`, `model_sha` (the source's revision), `model_dtype`, `served_model_name`,
  `model_type` (`{"embedding": {"pooling"}}`, `{"classifier": {"id2label", "label2id"}}`,
  `{"reranker": ...}`), `max_concurrent_requests`, `max_input_length`, `max_batch_tokens`
  and `max_batch_requests` (the model's tuned batch), `max_client_batch_size`
  (SHOAL_MAX_ITEMS), `auto_truncate` (true: shoal's default), `tokenization_workers` (the
  gateway's tokenizer threads), `version` (shoal's), `sha`, `docker_label`;
- `/health` → 200, empty, when the broker is connected (as `/readyz`); 503 Unhealthy while
  it is not or while the gateway drains (`GET /` is the same: TEI's Inference API probe);
- `POST /`: TEI routes it by its one model's kind; shoal, serving many, by the body's shape
  and then the model's kind. `inputs` as an object (`source_sentence`, `sentences`) is
  `/similarity`; a `query` with `texts` (or `documents`) is `/rerank`; otherwise the body's
  `model`, or the default model (`gateway.calls.model_choice`), decides: a dense embedder
  `/embed`, a sparse one `/embed_sparse`, a reranker `/rerank`, a classifier `/predict`.
  Without a model, an `inputs` body looks for a default embedder first, then a sparse one,
  then a classifier; one that nests its fields in `parameters` (the Hugging Face pipelines'
  shape, which huggingface_hub's `text_classification` sends; its `feature_extraction`
  sends them flat) looks for a classifier first.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.calls.model_choice import ModelKind, candidates, chosen_model, default_model
from gateway.calls.model_tokenizers import THREADS, run_tokenizer
from gateway.edge.api_errors import ApiError, invalid
from gateway.edge.codecs import encode_response, read_body
from gateway.edge.compat_errors import tei_error
from gateway.edge.error_shapes import ROUTE_SHAPES
from gateway.routes import tei, tei_vectors
from gateway.routes.rerank import RERANKERS
from gateway.routes.status import readyz
from tasks.catalog import BatchProfile, ModelEntry
from tasks.errors import ErrorCode, ShoalError

# The kinds TEI's `/` answers, by the route that serves each.
ROOT_KINDS: dict[str, ModelKind] = {"embed": tei.EMBEDDERS,
                                    "embed_sparse": tei_vectors.SPARSE_EMBEDDERS,
                                    "rerank": RERANKERS, "predict": tei.CLASSIFIERS}
TEI_MODELS = ModelKind("TEI (embedding, sparse embedding, rerank or classification)",
                       lambda e: any(kind.fits(e) for kind in ROOT_KINDS.values()))
_HANDLERS = {**tei.BODY_HANDLERS, **tei_vectors.BODY_HANDLERS}
PATHS = ("/", "/invocations", "/health", "/info")
ROUTE_SHAPES.update(dict.fromkeys(PATHS, tei_error))
_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int8": "int8"}


def route_of(entry: ModelEntry) -> str:
    return next(name for name, kind in ROOT_KINDS.items() if kind.fits(entry))


def root_route(request: Request, body: dict[str, Any]) -> str:
    """The TEI route that answers `body` on `/` (the module's rules)."""
    if isinstance(body.get("inputs"), dict):
        return "similarity"
    if "query" in body and ("texts" in body or "documents" in body):
        return "rerank"
    if body.get("model") is not None:
        return route_of(chosen_model(request, body["model"], TEI_MODELS))
    pipeline = isinstance(body.get("parameters"), dict)
    order = ("predict", "embed", "embed_sparse") if pipeline else \
        ("embed", "embed_sparse", "predict")
    for name in order:
        kind = ROOT_KINDS[name]
        if not candidates(request, kind):
            continue
        if default_model(request, kind) is None:
            chosen_model(request, None, kind)  # raises: several, none named or served alone
        return name
    raise ApiError(ErrorCode.MODEL_NOT_FOUND, "this gateway serves no model that TEI's / "
                   "answers an 'inputs' body with (a text embedder or a classifier)")


async def root(request: Request) -> Response:
    body = await read_body(request, request.app.state.settings.max_body_bytes)
    if not isinstance(body, dict):
        raise invalid("the body must be a JSON object")
    return await _HANDLERS[root_route(request, body)](request, body)


async def health(request: Request) -> Response:
    await readyz(request)  # its 503s (broker, draining) come in TEI's shape: Unhealthy
    return Response(status_code=200)


def _root_model(request: Request) -> ModelEntry:
    named = request.query_params.get("model")
    if named is not None:
        return chosen_model(request, named, TEI_MODELS)
    for kind in ROOT_KINDS.values():
        entry = default_model(request, kind)
        if entry is not None:
            return entry
    return chosen_model(request, None, tei.EMBEDDERS)  # raises, listing the embedders


def _labels(config: dict[str, Any]) -> dict[str, Any]:
    id2label = config.get("id2label")
    id2label = {str(k): str(v) for k, v in id2label.items()} if isinstance(id2label, dict) \
        else {}
    return {"id2label": id2label, "label2id": {v: int(k) for k, v in id2label.items()
                                               if k.isdigit()}}


async def _model_type(entry: ModelEntry) -> dict[str, Any]:
    name = route_of(entry)
    if name in ("embed", "embed_sparse"):
        pooling = "splade" if name == "embed_sparse" else entry.pooling or "mean"
        return {"embedding": {"pooling": pooling}}
    try:
        config = await run_tokenizer(entry, lambda tokenizer: tokenizer.model_config)
    except ShoalError:
        config = {}  # the gateway has not the model's files: its labels are the workers'
    return {"reranker" if name == "rerank" else "classifier": _labels(config)}


def _shoal_version() -> str:
    try:
        return version("shoal")
    except PackageNotFoundError:
        return "unknown"


async def info(request: Request) -> Response:
    entry = _root_model(request)
    settings = request.app.state.settings
    profile = next(iter(entry.profiles.values()), None) or BatchProfile()
    precision = next((p.precision for p in entry.profiles.values() if p.precision), "fp32")
    max_input = entry.max_seq_length
    if max_input is None:
        try:
            max_input = await run_tokenizer(entry, lambda t: t.max_length(entry))
        except ShoalError:
            max_input = None
    return encode_response(request, {
        "model_id": entry.id, "model_sha": entry.source.revision,
        "model_dtype": _DTYPES.get(precision, precision), "served_model_name": entry.id,
        "model_type": await _model_type(entry),
        "max_concurrent_requests": settings.queue_max_length,  # the queue admits that many
        "max_input_length": max_input or 512,
        "max_batch_tokens": profile.max_tokens, "max_batch_requests": profile.max_items,
        "max_client_batch_size": settings.max_items, "auto_truncate": True,
        "tokenization_workers": THREADS, "version": _shoal_version(), "sha": None,
        "docker_label": None})
