"""The adapter contract on the runtime side: check one request, run a batch.

An adapter is one loaded model of one family (`tasks.adapters` declares what
each family serves). The host calls `prepare` on every request of a batch
(a ShoalError there fails that request only) and then `run` once on the
requests that passed; an exception from `run` fails the batch and the
process runtime bisects it to find the request to blame.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from io import BytesIO
from typing import Any

from app.catalog import ModelEntry
from tasks.adapters import GENERATE, SCORE, TEXT
from tasks.schema import ParsedRequest


class Adapter(ABC):
    def __init__(self, entry: ModelEntry, ref: str, *, device: str = "cpu",
                 chunk_tokens: int = 16_384) -> None:
        """`ref` is the model's local directory (`runtimes.sources.resolve_source`)."""
        self.entry = entry
        self.contract = entry.contract
        self.device = device
        self.chunk_tokens = chunk_tokens

    @property
    def operation(self) -> str:
        return self.contract.operation

    def probe(self) -> dict[str, Any]:
        """The kwargs of a small request this model answers whenever it works: what the
        process runtime runs to tell a broken runtime from a bad request."""
        return probe_kwargs(self.operation, self.contract.inputs)

    def prompt(self, parsed: ParsedRequest) -> str:
        """The entry's text to put before each input: its query or its document prompt."""
        prompts = self.entry.prompts
        return prompts.query if parsed.options.is_query else prompts.document

    def prompted(self, parsed: ParsedRequest, lower: bool = False) -> list[str]:
        """Each text with the prompt before it; lowercased for a model that was trained
        on lowercased text (a sentence-transformers `do_lower_case`)."""
        prompt = self.prompt(parsed)
        texts = [prompt + t for t in parsed.texts]
        return [t.lower() for t in texts] if lower else texts

    def parse(self, kwargs: Any) -> ParsedRequest:
        """The entry's own check (`ModelEntry.parse`), the one the gateway made."""
        return self.entry.parse(kwargs)

    def prepare(self, kwargs: Any) -> Any:
        """What `run` needs for one request; ShoalError if this model cannot serve it."""
        return self.check(self.parse(kwargs))

    def check(self, parsed: ParsedRequest) -> Any:
        """Model-specific checks (lengths, labels, images); returns what `run` takes."""
        return parsed

    @abstractmethod
    def run(self, prepared: list[Any]) -> list[dict[str, Any]]:
        """One result per request, in order; each has `usage: {"tokens": n}`."""


def probe_kwargs(operation: str, inputs: frozenset[str]) -> dict[str, Any]:
    """One short item of what the model takes (text if it takes text), shaped for the
    operation: score needs a query, and generate stops after one token."""
    item = {"text": "probe"} if TEXT in inputs else {"image": probe_image()}
    kwargs: dict[str, Any] = {"items": [item]}
    if operation == SCORE:
        kwargs["query"] = "probe"
    if operation == GENERATE:
        kwargs["options"] = {"max_tokens": 1}
    return kwargs


def probe_image() -> bytes:
    """A small white PNG, for models that take images only."""
    from PIL import Image

    buffer = BytesIO()
    Image.new("RGB", (32, 32), "white").save(buffer, format="PNG")
    return buffer.getvalue()
