"""The adapter contract on the runtime side: check one request, run a batch.

Every runtime that loads models in the runtime process (PyTorch, ONNX Runtime) builds on
it; `runtimes.pytorch.adapter` adds torch's number format. An adapter is one loaded
model of one family (`tasks.adapters` declares what
each family serves). The host calls `prepare` on every request of a batch
(a ShoalError there fails that request only) and then `run` once on the
requests that passed; an exception from `run` fails the batch and the
process runtime bisects it to find the request to blame.

LoRA adapters: an adapter with `supports_lora` serves requests whose
options.lora names one of its catalog entry's `loras`, once the caller has
loaded it (`load_lora`); requests for different LoRAs share one batch. Its engine
provides what holds them (`Loras`; PyTorch's is `runtimes.pytorch.lora.LoraSet`).

Streaming: an adapter with `streams` runs a batch whole, `run(planned, stream)`, telling
the host each step's deltas through the `Stream` it is given.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from io import BytesIO
from typing import Any, ClassVar, Protocol

from tasks.adapters import GENERATE, SCORE, TEXT
from tasks.catalog import ModelEntry
from tasks.errors import ErrorCode, ShoalError
from tasks.schema import ParsedRequest


class Loras(Protocol):
    """The LoRA adapters loaded on one model, by the catalog's names."""

    @property
    def names(self) -> set[str]: ...

    def load(self, name: str, ref: str) -> int:
        """Load the peft LoRA in the local directory `ref` as `name`: the bytes it takes."""
        ...

    def unload(self, name: str) -> None: ...


# (request's place in the batch, item index, text, completion tokens so far)
RowDelta = tuple[int, int, str, int]


@dataclass(frozen=True, slots=True)
class Stream:
    """Where a streamed batch's deltas go: `requests` are the places (in the batch) of the
    requests that stream; `send` takes one step's deltas and returns the places of the
    requests whose callers left."""

    requests: frozenset[int]
    send: Callable[[list[RowDelta]], set[int]]


class Adapter(ABC):
    # Whether this family serves LoRA adapters (`tasks.catalog.LORA_ADAPTERS` says the same
    # for the catalog); one that does sets `loras` to its engine's `Loras` of its model.
    supports_lora: ClassVar[bool] = False
    loras: Loras | None = None
    # Whether it streams deltas (see the module doc).
    streams: ClassVar[bool] = False

    def __init__(self, entry: ModelEntry, ref: str, *, device: str = "cpu",
                 chunk_tokens: int = 16_384, precision: str = "fp32") -> None:
        """`ref` is the model's local directory (`tasks.sources.resolve_source`);
        `precision` the forward pass's number format (`runtimes.model_files.precision`)."""
        self.entry = entry
        self.contract = entry.contract
        self.device = device
        self.chunk_tokens = chunk_tokens
        self.precision = precision

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
        texts = [prompt + (item.text or "") for item in parsed.items]  # `parsed.texts`, prompted
        return [t.lower() for t in texts] if lower else texts

    def parse(self, kwargs: Any) -> ParsedRequest:
        """The entry's own check (`ModelEntry.parse`), the one the gateway made."""
        return self.entry.parse(kwargs)

    def prepare(self, kwargs: Any) -> Any:
        """What `run` needs for one request; ShoalError if this model cannot serve it
        (MODEL_UNAVAILABLE for a LoRA of the catalog that is not loaded)."""
        parsed = self.parse(kwargs)
        lora = getattr(parsed.options, "lora", None)
        if lora is not None and lora not in self.loaded_loras:
            raise ShoalError(ErrorCode.MODEL_UNAVAILABLE,
                             f"LoRA {lora} of model {self.entry.id} is not loaded")
        return self.check(parsed)

    def check(self, parsed: ParsedRequest) -> Any:
        """Model-specific checks (lengths, labels, images); returns what `run` takes."""
        return parsed

    @abstractmethod
    def run(self, prepared: list[Any]) -> list[dict[str, Any]]:
        """One result per request, in order; each has `usage: {"tokens": n}`."""

    # --- stages: how a pipelined runtime runs a batch ------------------------------------
    # The runtime process overlaps batches (runtimes.child_side.server): while the device runs one
    # batch's `forward`, the next batch's `plan` and the previous one's `finish` run on
    # other threads. Per batch they run in this order, and `forward` of one batch at a
    # time. A family that does not split its work runs it whole in `forward`.

    def plan(self, prepared: list[Any]) -> Any:
        """The host work before the device (tokenize, pad); any thread."""
        return prepared

    def forward(self, planned: Any) -> Any:
        """The device work: queue it, and the copy of its outputs to the host, without
        waiting for them where the device allows; the device stage's thread."""
        return self.run(planned)

    def finish(self, planned: Any, output: Any) -> list[dict[str, Any]]:
        """The results, once `forward`'s outputs are on the host; any thread."""
        return output

    # --- LoRA adapters -----------------------------------------------------------------

    def load_lora(self, name: str, ref: str) -> int:
        """Load the peft LoRA adapter in the local directory `ref` as `name` (a key of the
        entry's `loras`): the bytes its tensors take on the device. ValueError if `name`
        is loaded already or the adapter cannot be served; the model is unchanged then."""
        return self._lora_set().load(name, ref)

    def unload_lora(self, name: str) -> None:
        """Free a loaded LoRA (never one a running batch uses); KeyError if not loaded."""
        self._lora_set().unload(name)

    @property
    def loaded_loras(self) -> set[str]:
        return set() if self.loras is None else self.loras.names

    def _lora_set(self) -> Loras:
        if not self.supports_lora or self.loras is None:
            raise NotImplementedError(f"adapter {self.contract.name!r} serves no LoRA adapters")
        return self.loras


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
