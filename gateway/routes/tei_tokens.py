"""TEI's token routes, answered by the gateway from the model's own tokenizer
(`gateway.calls.model_tokenizers`), as TEI's router answers them on its CPU:

- `/tokenize` `{"inputs", "add_special_tokens"?: true, "prompt_name"?}` →
  `[[{"id", "text", "special", "start", "stop"}, ...], ...]`, one list per input: `start`
  and `stop` are character offsets into the input (`text == input[start:stop]`), null for
  a special token, whose `text` is the token itself (`[CLS]`);
- `/decode` `{"ids", "skip_special_tokens"?: true}` → `["text", ...]`, one per sequence.

The model: the body's `model` (shoal's extension), else the default of any model that
takes text (`gateway.calls.model_choice`). `prompt_name` is `query` or `document`, the
entry's prompts, put before the text as the model sees it (left out: `document`, as on
`/embed`); the offsets are then into the prompted text, as TEI's are. A pair of texts
(`[["query", "document"]]`) is tokenized as a cross-encoder reads it; each token's offsets
are into its own text of the pair. Errors are TEI's (`gateway.edge.compat_errors`).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.calls.model_choice import ModelKind, chosen_model
from gateway.calls.model_tokenizers import ModelTokenizer, run_tokenizer
from gateway.edge.api_errors import invalid
from gateway.edge.codecs import encode_response
from gateway.edge.compat_errors import tei_error
from gateway.edge.error_shapes import ROUTE_SHAPES
from gateway.routes.tei import tei_route
from gateway.routes.tei_shapes import flag, prompt_options
from gateway.routes.token_shapes import Sequence, decode_ids, tokenize_inputs
from tasks.adapters import TEXT
from tasks.catalog import ModelEntry

TEXT_MODELS = ModelKind("text", lambda e: TEXT in e.contract.inputs)
PATHS = ("/tokenize", "/decode")
ROUTE_SHAPES.update(dict.fromkeys(PATHS, tei_error))


def prompt_text(entry: ModelEntry, prompt_name: Any) -> str:
    """The text the entry puts before an input for `prompt_name` (left out: document's)."""
    is_query = prompt_options(prompt_name).get("is_query", False)
    return entry.prompts.query if is_query else entry.prompts.document


def simple_tokens(encoding: Any, texts: Sequence) -> list[dict[str, Any]]:
    """An encoding as TEI's SimpleTokens (core/src/tokenization.rs `into_tokens`)."""
    pair = texts if isinstance(texts, tuple) else (texts,)
    tokens = []
    for token_id, (start, stop), special, token, seq in zip(
            encoding.ids, encoding.offsets, encoding.special_tokens_mask, encoding.tokens,
            encoding.sequence_ids, strict=True):
        if special or seq is None:
            tokens.append({"id": token_id, "text": token, "special": True,
                           "start": None, "stop": None})
        else:
            tokens.append({"id": token_id, "text": pair[seq][start:stop], "special": False,
                           "start": start, "stop": stop})
    return tokens


def check_vocabulary(tokenizer: ModelTokenizer, sequences: list[list[int]], field: str) -> None:
    """422 for an id the model's vocabulary does not have (the tokenizer would read it as
    nothing)."""
    size = tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
    for i, ids in enumerate(sequences):
        wrong = next((t for t in ids if t >= size), None)
        if wrong is not None:
            where = f"{field}[{i}]" if len(sequences) > 1 else field
            raise invalid(f"'{where}' has the token id {wrong}, outside {tokenizer.model}'s "
                          f"vocabulary of {size} ids")


async def _tokenize(request: Request, body: dict[str, Any]) -> Response:
    entry = chosen_model(request, body.get("model"), TEXT_MODELS)
    sequences = tokenize_inputs(body.get("inputs"), request.app.state.settings.max_items)
    special = flag(body, "add_special_tokens", True)
    prompt = prompt_text(entry, body.get("prompt_name"))
    texts = [prompt + s if isinstance(s, str) else s for s in sequences]

    def tokenize(tokenizer: ModelTokenizer) -> list[list[dict[str, Any]]]:
        encodings = tokenizer.tokenizer.encode_batch(texts, add_special_tokens=special)
        return [simple_tokens(e, t) for e, t in zip(encodings, texts, strict=True)]

    return encode_response(request, await run_tokenizer(entry, tokenize))


async def _decode(request: Request, body: dict[str, Any]) -> Response:
    entry = chosen_model(request, body.get("model"), TEXT_MODELS)
    sequences = decode_ids(body.get("ids"), request.app.state.settings.max_items)
    skip = flag(body, "skip_special_tokens", True)

    def decode(tokenizer: ModelTokenizer) -> list[str]:
        check_vocabulary(tokenizer, sequences, "ids")
        return tokenizer.tokenizer.decode_batch(sequences, skip_special_tokens=skip)

    return encode_response(request, await run_tokenizer(entry, decode))


tokenize = tei_route(_tokenize)
decode = tei_route(_decode)
