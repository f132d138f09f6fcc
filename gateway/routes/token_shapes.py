"""The bodies of the token routes, read as their servers read them: TEI's `/tokenize` and
`/decode` (router/src/http/types.rs: TokenizeRequest, DecodeRequest) and vLLM's
`/v1/tokenize` and `/v1/detokenize` (TokenizeCompletionRequest, TokenizeChatRequest,
DetokenizeRequest). Pure functions of the body; the routes are `gateway.routes.tei_tokens`
and `gateway.routes.vllm_tokens`.

TEI's `inputs`: a string, or a list of strings (one sequence each); shoal also takes a pair
`[text, text]` inside that list (`[["query", "document"]]`), tokenized as one sequence of two
texts the way a cross-encoder reads them. A field a server does not know is ignored, as
theirs are.
"""

from __future__ import annotations

from typing import Any

from gateway.edge.api_errors import ApiError, invalid
from gateway.edge.compat_errors import empty_batch
from tasks.errors import ErrorCode
from tasks.render import shown

Sequence = str | tuple[str, str]
_MAX_ID = 2**32  # TEI reads ids as u32


def too_many(count: int, limit: int) -> ApiError:
    """TEI's batch size error (413 Validation)."""
    return ApiError(ErrorCode.PAYLOAD_TOO_LARGE,
                    f"batch size {count} > maximum allowed batch size {limit}")


def tokenize_inputs(value: Any, limit: int) -> list[Sequence]:
    """TEI's /tokenize `inputs` as sequences: a text, or a pair of texts."""
    if isinstance(value, str):
        return [value]
    if type(value) is not list:
        raise invalid("'inputs' must be a string or a list of strings (a pair of texts as "
                      "[text, text] inside the list)")
    if not value:
        raise empty_batch("inputs")
    if len(value) > limit:
        raise too_many(len(value), limit)
    sequences: list[Sequence] = []
    for i, one in enumerate(value):
        if isinstance(one, str):
            sequences.append(one)
        elif type(one) is list and len(one) == 2 and all(isinstance(t, str) for t in one):
            sequences.append((one[0], one[1]))
        else:
            raise invalid(f"inputs[{i}] is {shown(one)}: each input is a string or a pair "
                          "[text, text]")
    return sequences


def _ids(value: Any, where: str) -> list[int]:
    if type(value) is not list or not all(type(i) is int for i in value):
        raise invalid(f"'{where}' must be a list of token ids (whole numbers), got {shown(value)}")
    wrong = next((i for i in value if not 0 <= i < _MAX_ID), None)
    if wrong is not None:
        raise invalid(f"'{where}' has the token id {wrong}: ids are 0 or more, below 2^32")
    return value


def decode_ids(value: Any, limit: int) -> list[list[int]]:
    """TEI's /decode `ids`: one sequence of ids, or a list of them (a batch)."""
    if type(value) is not list:
        raise invalid("'ids' must be a list of token ids or a list of such lists")
    if value and all(type(one) is list for one in value):
        if len(value) > limit:
            raise too_many(len(value), limit)
        return [_ids(one, f"ids[{i}]") for i, one in enumerate(value)]
    return [_ids(value, "ids")]  # [] too: TEI reads it as one empty sequence, ""


def _content(value: Any, where: str) -> str:
    """A message's content: a string, or OpenAI's list of text parts (joined)."""
    if isinstance(value, str):
        return value
    if type(value) is list and all(isinstance(p, dict) and p.get("type") == "text"
                                   and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    raise invalid(f"'{where}' must be a string or a list of text parts "
                  "([{\"type\": \"text\", \"text\": ...}]), got " + shown(value))


def chat_messages(value: Any, limit: int) -> list[dict[str, str]]:
    """vLLM's (OpenAI's) `messages`: `[{"role", "content"}]`, content as text."""
    if type(value) is not list or not value:
        raise invalid("'messages' must be a non-empty list of {\"role\", \"content\"}")
    if len(value) > limit:
        raise too_many(len(value), limit)
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not message["role"]:
            raise invalid(f"messages[{i}] must be an object with a 'role' string and "
                          f"'content', got {shown(message)}")
        messages.append({"role": message["role"],
                         "content": _content(message.get("content"), f"messages[{i}].content")})
    return messages


def vllm_prompt(body: dict[str, Any]) -> str:
    """/v1/tokenize's `prompt`: one string (vLLM's TokenizeCompletionRequest)."""
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise invalid(f"'prompt' must be a string (or send 'messages' instead), got "
                      f"{shown(prompt)}")
    return prompt


def vllm_tokens(value: Any) -> list[int]:
    """/v1/detokenize's `tokens`."""
    return _ids(value, "tokens")
