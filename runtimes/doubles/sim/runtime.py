"""A runtime that computes nothing and takes as long as a real device would.

Fleet experiments (a dozen workers, several device kinds, queueing and
hold-back behaviour) need workers whose batches take realistic time, which a
small machine cannot give with real models. `SimRuntime` checks each request
exactly as the real runtime does (`ModelEntry.parse`, plus the model-independent
checks of the adapters), sleeps once per batch for the latency the scheduler's
own formula (`batching.latency_model`) predicts on the simulated device, and answers with results
of the right shape: deterministic pseudo-random numbers, never a model's.
Every result carries `"simulated"` (the device and its constants, see
`tasks.served`), which the gateway turns into an `X-Simulated` header, so no
one mistakes them for real embeddings.

Token counts come from `ModelEntry.estimate`, the estimate every message's
headers carry, so the scheduler and the simulated
device agree on what a batch costs. Checks that need a tokenizer (the
`truncate: false` length checks, a causal LM's context) are not simulated.

It runs on the worker's runtime thread (`time.sleep` frees the GIL) and
imports neither torch nor transformers, so many simulated workers fit on a
small machine.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from batching.latency_model import BatchShape, CostModel
from batching.pool import keys_of, lora_key
from runtimes.base import (
    BatchesOnly,
    Capabilities,
    LoadFailed,
    OnDeltas,
    Outcome,
    Request,
    RuntimeClosed,
    SentAhead,
    failed,
    prepare_each,
)
from runtimes.child_side.host_tier import HostTier
from runtimes.doubles.sim.devices import SimConstants, sim_constants
from runtimes.families.vectors import dense_result
from tasks.adapters import CLASSIFY, ENCODE, EXTRACT, GENERATE, MULTIVECTOR, SCORE, SPARSE
from tasks.catalog import BatchProfile, ModelEntry
from tasks.errors import ErrorCode
from tasks.schema import ParsedRequest, invalid
from tasks.served import stamp_batch

log = logging.getLogger(__name__)

SIM_VOCAB_SIZE = 30_522  # BERT's WordPiece vocabulary, what SPLADE models use
SPARSE_TERMS = 8  # non-zero terms per simulated sparse vector (at most one per token)
DEFAULT_LABELS = ("LABEL_0", "LABEL_1")  # transformers' names for an unnamed 2-way head
DEFAULT_FOOTPRINT_BYTES = 100 * 2**20
SIM_LORA_BYTES = 8 * 2**20  # a rank-16 LoRA of a small model, roughly
SIM_LORA_S = 0.02
FILLER = ("lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit")


@dataclass(slots=True)
class _Prepared:
    """A request that passed the checks, with its token estimate."""

    request: Request
    parsed: ParsedRequest
    items: int
    tokens: int
    longest: int


class _SimModel:
    """One served entry: its checks, its cost and its fake outputs."""

    def __init__(self, entry: ModelEntry, constants: SimConstants) -> None:
        self.entry = entry
        self.constants = constants
        self.cost: CostModel = constants.cost_model()

    @property
    def operation(self) -> str:
        return self.entry.operation

    def item_tokens(self, kwargs: dict[str, Any]) -> list[int]:
        """The estimate of each item alone (multivector lengths, generate's prompts)."""
        items = kwargs.get("items") or []
        return [self.entry.estimate({**kwargs, "items": [item]})[1] for item in items]

    # --- checks ----------------------------------------------------------------------------

    def parse(self, kwargs: Any) -> ParsedRequest:
        """The entry's check, as the real adapter makes it, then the adapter's own checks
        that need no weights (their messages copied from runtimes/pytorch)."""
        entry = self.entry
        parsed = entry.parse(kwargs)
        options = parsed.options
        if entry.adapter == "sequence-classification" and (
            options.labels is not None or options.hypothesis_template is not None
        ):
            raise invalid(f"{entry.id} has fixed labels {list(DEFAULT_LABELS)}; options.labels "
                          "and options.hypothesis_template are for zero-shot models")
        elif entry.adapter == "zero-shot" and options.labels is None:
            raise invalid("options.labels is missing: zero-shot classification needs the "
                          'candidate labels, e.g. {"labels": ["sports", "politics", "music"]}')
        return parsed

    # --- outputs ---------------------------------------------------------------------------

    def result(self, p: _Prepared) -> dict[str, Any]:
        """A result shaped like the real adapter's, filled with deterministic noise."""
        op, parsed = p.parsed.op, p.parsed
        if op == ENCODE:
            kind = self.entry.contract.outputs[0]
            if kind == SPARSE:
                return self._sparse(p)
            if kind == MULTIVECTOR:
                return self._multivector(p)
            rows = np.stack([self._noise(item) for item in _keys(parsed)])
            normalize = True if self.entry.normalize is None else self.entry.normalize
            return dense_result(rows, parsed.options, normalize, p.tokens)
        if op == SCORE:
            scores = [float(self._rng(("score", parsed.query, key)).random())
                      for key in _keys(parsed)]
            return {"scores": scores, "usage": {"tokens": p.tokens}}
        if op == EXTRACT:
            return {"entities": [[] for _ in parsed.items], "usage": {"tokens": p.tokens}}
        if op == CLASSIFY:
            return self._classify(p)
        if op == GENERATE:
            return self._generate(p)
        raise AssertionError(f"no simulated output for {op!r}")  # the contracts list every op

    def _noise(self, key: Any) -> np.ndarray:
        """A dense vector of deterministic noise for `key`, cheap to make: the sim's own CPU
        per item would otherwise blur the pipeline's that it is there to measure."""
        digest = hashlib.blake2b(repr((self.entry.id, key)).encode(), digest_size=64).digest()
        dims = self.entry.dims or 1
        raw = np.frombuffer(digest * (dims // len(digest) + 1), dtype=np.uint8)[:dims]
        return raw.astype(np.float32) - 127.5

    def _rng(self, key: Any) -> np.random.Generator:
        """A generator seeded by the model and the input, so a text always gets the same
        numbers from the same model (caches, dedup and comparisons behave as with a model)."""
        digest = hashlib.blake2b(repr((self.entry.id, key)).encode(), digest_size=8).digest()
        return np.random.default_rng(int.from_bytes(digest, "little"))

    def _sparse(self, p: _Prepared) -> dict[str, Any]:
        embeddings = []
        for key, tokens in zip(_keys(p.parsed), self.item_tokens(p.request.kwargs),
                               strict=True):
            rng = self._rng(key)
            k = max(1, min(SPARSE_TERMS, tokens))
            indices = np.sort(rng.choice(SIM_VOCAB_SIZE, size=k, replace=False))
            values = rng.uniform(0.05, 3.0, size=k).astype(np.float32)
            embeddings.append({"indices": [int(i) for i in indices],
                               "values": [float(v) for v in values]})
        return {"output": "sparse", "count": len(embeddings), "vocab_size": SIM_VOCAB_SIZE,
                "embeddings": embeddings, "usage": {"tokens": p.tokens}}

    def _multivector(self, p: _Prepared) -> dict[str, Any]:
        dims = self.entry.dims or 1
        lengths = [max(1, n) for n in self.item_tokens(p.request.kwargs)]
        rows = []
        for key, n in zip(_keys(p.parsed), lengths, strict=True):
            vectors = self._rng(key).standard_normal((n, dims), dtype=np.float32)
            rows.append(vectors / np.linalg.norm(vectors, axis=1, keepdims=True))
        return {"output": "multivector", "dims": dims, "count": len(rows), "dtype": "float32",
                "lengths": lengths,
                "embeddings": np.ascontiguousarray(np.concatenate(rows), dtype="<f4").tobytes(),
                "usage": {"tokens": p.tokens}}

    def _classify(self, p: _Prepared) -> dict[str, Any]:
        options = p.parsed.options
        names = list(options.labels or DEFAULT_LABELS)
        labels = []
        for key in _keys(p.parsed):
            raw = self._rng(("classify", tuple(names), key)).random(len(names))
            scores = raw if options.multi_label else raw / raw.sum()
            order = np.argsort(-scores, kind="stable")[: options.top_k]
            labels.append([{"label": names[i], "score": float(scores[i])} for i in order])
        return {"labels": labels, "usage": {"tokens": p.tokens}}

    def _generate(self, p: _Prepared) -> dict[str, Any]:
        max_tokens = p.parsed.options.max_tokens
        text = " ".join(FILLER[i % len(FILLER)] for i in range(max_tokens))
        choices = [
            {"index": i, "text": text, "finish_reason": "length",
             "prompt_tokens": max(tokens - max_tokens, 0), "completion_tokens": max_tokens}
            for i, tokens in enumerate(self.item_tokens(p.request.kwargs))
        ]
        prompt = sum(c["prompt_tokens"] for c in choices)
        completion = sum(c["completion_tokens"] for c in choices)
        return {"choices": choices, "usage": {"tokens": prompt + completion,
                                              "prompt_tokens": prompt,
                                              "completion_tokens": completion}}


def _keys(parsed: ParsedRequest) -> list[Any]:
    """What identifies each item: its text, image bytes, messages or token ids (the sim has
    no tokenizer: a text and its ids get different numbers)."""
    return [("image", hashlib.blake2b(item.image).hexdigest()) if item.image is not None
            else ("tokens", item.tokens) if item.tokens is not None
            else item.messages or item.text for item in parsed.items]


class SimRuntime(BatchesOnly):
    """The `Runtime` protocol on simulated devices: real checks, simulated time and numbers.

    `device` picks the constants (`runtimes.doubles.sim.devices`); `speed` divides
    every latency (2.0: a device twice as fast, or time compressed twice);
    `constants` (a_ms, b_us, c_ns) overrides the device for every model.
    Nothing crashes here, so `restarts`, `poison_isolated`, `spare_promotions` and
    `start_failures` stay 0 and there is no child `pid`; they exist because the worker's
    metrics read them.

    `entries` are the models it may serve; `loaded` those resident from the start
    (default: all). A load sleeps the profile's `load_ms` (over `speed`) and takes its
    `footprint_bytes`; `device_bytes` is what the simulated device holds (None: the
    worker's setting decides).

    `host_bytes` models the host-memory tier (`runtimes.child_side.host_tier`; 0: off): an
    unloaded model's footprint is kept in `tier` while it fits (least recently unloaded
    dropped first), and loading it again sleeps the profile's `host_load_ms` (default a
    tenth of `load_ms`) instead of `load_ms`.
    """

    def __init__(self, entries: list[ModelEntry], device: str, speed: float = 1.0,
                 constants: tuple[float, float, float] | None = None,
                 loaded: list[str] | None = None, device_bytes: int | None = None,
                 host_bytes: int = 0) -> None:
        if not (isinstance(speed, int | float) and 0 < speed < float("inf")):
            raise ValueError(f"speed must be a finite number > 0, got {speed!r}")
        self.device = device
        self.speed = float(speed)
        self.restarts = 0
        self.poison_isolated = 0
        self.spare_promotions = 0  # no child, so no spare either
        self.start_failures = 0
        self.capabilities = Capabilities()  # one simulated batch at a time
        self.pid: int | None = None
        self._closed = False
        self._models = {e.id: _SimModel(e, sim_constants(e, device, constants)) for e in entries}
        self.device_bytes = device_bytes
        self.tier: HostTier[bool] = HostTier(host_bytes)  # unloaded models' footprints
        self.resident: dict[str, int] = {
            m: self.footprint(m) for m in (self._models if loaded is None else loaded)}
        for model in self._models.values():
            c = model.constants
            log.warning("SIMULATED runtime: %s on %s x%g: a=%gms b=%gus c=%gns (%s); results "
                        "are not a model's", model.entry.id, device, self.speed, c.a_ms, c.b_us,
                        c.c_ns, c.source)

    def footprint(self, model_id: str) -> int:
        """The device bytes the simulated model takes (the profile's, else 100 MB)."""
        profile = self._models[model_id].entry.profile(self.device)
        return (profile.footprint_bytes if profile and profile.footprint_bytes
                else DEFAULT_FOOTPRINT_BYTES)

    def estimate_bytes(self, model_id: str, lora: str | None = None) -> int:
        return self.footprint(model_id) if lora is None else SIM_LORA_BYTES

    def load(self, model_id: str, lora: str | None = None) -> int:
        """Sleep as long as the profile says a load takes (on the caller's thread, beside
        batches); the footprint. A LoRA adapter takes SIM_LORA_S and SIM_LORA_BYTES."""
        model = self._models.get(model_id)
        if model is None:
            raise LoadFailed(f"{model_id} is not one of this worker's models")
        if lora is not None:
            if model_id not in self.resident or lora not in model.entry.loras:
                raise LoadFailed(f"LoRA {lora} of {model_id}: no such adapter, or the model "
                                 "is not loaded")
            _sleep_until(time.perf_counter() + SIM_LORA_S / self.speed)
            self.resident[lora_key(model_id, lora)] = SIM_LORA_BYTES
            return SIM_LORA_BYTES
        profile = model.entry.profile(self.device) or BatchProfile()
        load_ms = profile.load_ms
        if model_id not in self.resident and self.tier.take(model_id):
            load_ms = profile.load_ms / 10 if profile.host_load_ms is None \
                else profile.host_load_ms
        _sleep_until(time.perf_counter() + load_ms / 1000 / self.speed)
        self.resident[model_id] = self.footprint(model_id)
        return self.resident[model_id]

    def unload(self, model_id: str, lora: str | None = None) -> None:
        if lora is not None:
            self.resident.pop(lora_key(model_id, lora), None)
            return
        footprint = self.resident.get(model_id)
        for key in keys_of(model_id, self.resident):
            del self.resident[key]
        if footprint is not None and self.tier.on:
            self.tier.put(model_id, True, footprint)

    def constants(self, model_id: str) -> SimConstants:
        return self._models[model_id].constants

    def latency(self, model_id: str, shape: BatchShape) -> float:
        """Seconds a batch of this shape sleeps: the device's a + b*T + c*T*L over speed."""
        return self._models[model_id].cost.predict(shape) / self.speed

    def cancel(self, request_ids: list[str]) -> None:
        """Nothing to stop: a simulated batch streams nothing and ends on its own."""

    def ready_in(self, model_id: str) -> float | None:
        return None  # nothing restarts

    def watch_availability(self, callback: Callable[[], None]) -> None:
        """Nothing to watch: `ready_in` is always None."""

    def run_batch(self, model_id: str, requests: list[Request],
                  on_deltas: OnDeltas | None = None, ahead: SentAhead | None = None
                  ) -> list[Outcome]:
        if self._closed:
            raise RuntimeClosed("the runtime is closed")
        model = self._models.get(model_id) if model_id in self.resident else None
        if model is None:
            return [failed(r.id, ErrorCode.MODEL_NOT_FOUND,
                           f"this worker does not serve {model_id}") for r in requests]

        def prepare(request: Request) -> _Prepared:
            parsed = model.parse(request.kwargs)
            # The entry's estimate, the one the scheduler's headers carry: the sleep agrees.
            items, tokens, longest = model.entry.estimate(request.kwargs)
            return _Prepared(request, parsed, items, tokens, longest)

        outcomes, checked = prepare_each(model_id, model.operation, requests, prepare)
        runnable = [prepared for _, prepared in checked]
        if runnable:
            shape = BatchShape(items=sum(p.items for p in runnable),
                               longest=max(p.longest for p in runnable),
                               tokens=sum(p.tokens for p in runnable))
            started = time.perf_counter()
            # Outputs first, then sleep the rest: the batch takes the simulated time,
            # not that plus the noise, as long as making the noise is the shorter.
            results = [model.result(p) for p in runnable]
            busy = self.latency(model_id, shape)
            _sleep_until(started + busy)
            c = model.constants
            simulated = {"device": self.device, "a_ms": c.a_ms, "b_us": c.b_us, "c_ns": c.c_ns,
                         "speed": self.speed}
            stamp_batch(results, model_id, (p.request.kwargs for p in runnable), started,
                        simulated, device_s=busy)
            for p, result in zip(runnable, results, strict=True):
                result["usage"] = {**result.get("usage", {}), "tokens": p.tokens}
                outcomes[p.request.id] = Outcome(p.request.id, result=result)
        return [outcomes[r.id] for r in requests]

    def close(self) -> None:
        self._closed = True


def _sleep_until(deadline: float) -> None:
    """Sleep until `deadline` (perf_counter time): never less, whatever wakes the thread."""
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(left)
