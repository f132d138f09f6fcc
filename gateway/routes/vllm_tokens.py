"""vLLM's token routes, for OpenAI-shaped clients that count or chunk by tokens before they
send (vllm/entrypoints/openai/protocol.py: TokenizeRequest, DetokenizeRequest):

- `POST /v1/tokenize` `{"model"?, "prompt", "add_special_tokens"?: true}` or
  `{"model"?, "messages", "add_generation_prompt"?: true, "continue_final_message"?: false,
  "add_special_tokens"?: false}` → `{"count", "max_model_len", "tokens", "token_strs"}`
  (`token_strs`: the tokens' strings with `"return_token_strs": true`, else null);
- `POST /v1/detokenize` `{"model"?, "tokens"}` → `{"prompt"}` (special tokens kept, as
  vLLM decodes).

`messages` are rendered by the model's chat template (`gateway.calls.chat_template`) and
the text tokenized without special tokens, as vLLM does (the template writes its own).
`max_model_len` is the model's longest input: the entry's `max_seq_length`, else its
config's. The model: `model`, else the default of any model that takes text
(`gateway.calls.model_choice`); the tokenizer is the gateway's (`gateway.calls.model_tokenizers`).
Errors are OpenAI's envelope, as vLLM's are (`OPENAI_ROUTES`).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.calls.chat_template import render_chat
from gateway.calls.model_choice import chosen_model
from gateway.calls.model_tokenizers import ModelTokenizer, run_tokenizer
from gateway.edge.api_errors import invalid
from gateway.edge.codecs import encode_response, read_body
from gateway.edge.error_shapes import OPENAI_ROUTES
from gateway.routes.tei_shapes import flag
from gateway.routes.tei_tokens import TEXT_MODELS, check_vocabulary
from gateway.routes.token_shapes import chat_messages, vllm_prompt, vllm_tokens

OPENAI_ROUTES.update({"/v1/tokenize": "prompt", "/v1/detokenize": "tokens"})


async def _body(request: Request) -> dict[str, Any]:
    body = await read_body(request, request.app.state.settings.max_body_bytes)
    if not isinstance(body, dict):
        raise invalid("the body must be a JSON object")
    return body


async def create_tokenize(request: Request) -> Response:
    body = await _body(request)
    entry = chosen_model(request, body.get("model"), TEXT_MODELS)
    chat = body.get("messages") is not None
    if chat:
        if body.get("prompt") is not None:
            raise invalid("send either 'prompt' or 'messages', not both")
        messages = chat_messages(body["messages"], request.app.state.settings.max_items)
        generation = flag(body, "add_generation_prompt", True)
        continued = flag(body, "continue_final_message", False)
        if generation and continued:
            raise invalid("'add_generation_prompt' and 'continue_final_message' cannot both "
                          "be true")
    else:
        prompt = vllm_prompt(body)
    special = flag(body, "add_special_tokens", not chat)
    strs = flag(body, "return_token_strs", False)

    def tokenize(tokenizer: ModelTokenizer) -> dict[str, Any]:
        text = render_chat(tokenizer, messages, generation, continued) if chat else prompt
        encoding = tokenizer.tokenizer.encode(text, add_special_tokens=special)
        return {"count": len(encoding.ids), "max_model_len": tokenizer.max_length(entry),
                "tokens": encoding.ids, "token_strs": encoding.tokens if strs else None}

    return encode_response(request, await run_tokenizer(entry, tokenize))


async def create_detokenize(request: Request) -> Response:
    body = await _body(request)
    entry = chosen_model(request, body.get("model"), TEXT_MODELS)
    tokens = vllm_tokens(body.get("tokens"))

    def detokenize(tokenizer: ModelTokenizer) -> dict[str, str]:
        check_vocabulary(tokenizer, [tokens], "tokens")
        return {"prompt": tokenizer.tokenizer.decode(tokens, skip_special_tokens=False)}

    return encode_response(request, await run_tokenizer(entry, detokenize))
