"""A chat model's messages rendered by its own chat template (tokenizer_config.json's
`chat_template`), in the gateway, for vLLM's `/v1/tokenize` with `messages`: the text whose
tokens the model will read, as transformers' `apply_chat_template(tokenize=False)` writes it.

The template runs in jinja2's immutable sandbox with what transformers gives a template
(`messages`, `add_generation_prompt`, the special tokens, `raise_exception`,
`strftime_now`), so a template
cannot reach the gateway's objects; a template that refuses the messages is the caller's 400.
"""

from __future__ import annotations

from datetime import datetime
from functools import lru_cache
from typing import Any

from gateway.calls.model_tokenizers import ModelTokenizer
from gateway.edge.api_errors import invalid

_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


def template_of(tokenizer: ModelTokenizer) -> str | None:
    """The model's chat template: a string, or the one named `default` of several."""
    template = tokenizer.config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


@lru_cache(maxsize=64)
def _compiled(source: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env.from_string(source)


def render_chat(tokenizer: ModelTokenizer, messages: list[dict[str, str]],
                add_generation_prompt: bool, continue_final_message: bool = False) -> str:
    """The prompt text of `messages` (400 for a model without a chat template, or one whose
    template refuses them)."""
    from jinja2 import TemplateError

    source = template_of(tokenizer)
    if source is None:
        raise invalid(f"{tokenizer.model} has no chat template: send a 'prompt' instead of "
                      "'messages'")
    specials = {name: tokenizer.special_token(name) or "" for name in _SPECIAL}
    try:
        text = _compiled(source).render(messages=messages,
                                        add_generation_prompt=add_generation_prompt,
                                        **specials)
    except (TemplateError, ValueError, TypeError) as exc:
        raise invalid(f"'messages': {tokenizer.model}'s chat template refused them: {exc}") \
            from None
    if continue_final_message:
        # The last message stays open (vLLM's continue_final_message): cut what the
        # template wrote after its content.
        last = messages[-1]["content"]
        end = text.rfind(last)
        if last and end >= 0:
            text = text[:end + len(last)]
    return text
