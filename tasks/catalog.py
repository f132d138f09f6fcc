"""The model catalog: one YAML file per served model.

shoal ships the repository's `models/` (installed as package data); a user's own
folder (SHOAL_CATALOG_DIR) adds entries or replaces shipped ones with the same id.

An entry says what a model is (adapter, where its weights come from, limits)
and how to batch it; it holds no code. A wrong entry fails at load time with
the file, the field and what is allowed.
"""

from __future__ import annotations

import re
from fnmatch import fnmatchcase
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from tasks import engines
from tasks.adapters import ADAPTERS, OPERATIONS, AdapterContract
from tasks.errors import ErrorCode, ShoalError
from tasks.options import GenerateOptions, parse_options
from tasks.precision import Precision
from tasks.schema import ParsedRequest, parse_encode, parse_request
from tasks.settings import PACKAGED_CATALOG_DIR
from tasks.token_estimate import (
    DEFAULT_IMAGE_TOKENS,
    DEFAULT_MAX_TOKENS,
    Estimate,
    estimate_request,
)
from tasks.topology import QueueType


class CatalogError(ValueError):
    """A catalog file is missing, unreadable or invalid."""


# The adapters (model families) whose runtime serves LoRA adapters (peft format) per
# request: a catalog entry of any other adapter may not list `loras`. The runtime
# classes say the same with `supports_lora` (the catalog imports no runtime code).
LORA_ADAPTERS = frozenset({"dense", "causal-lm"})
# The adapters whose runtimes take token-id items (`{"tokens": [...]}`, `tasks.schema`):
# a dense embedder's input ids and a causal LM's prompt. The other families refuse them
# where a request is parsed, the gateway included.
TOKEN_ADAPTERS = frozenset({"dense", "causal-lm"})
# A LoRA adapter's name: no ':' (OpenAI-style callers name one "model:lora", split on the
# last ':'), no spaces; it travels in a message header and in URLs as it is.
LORA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")


class Source(BaseModel):
    """Where the weights come from: exactly one of `path`, `package` or `hub`."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(None, description="a local directory")
    package: str | None = Field(None, description="an installed Python package shipping weights")
    subdir: str = Field("", description="directory inside the package or path")
    hub: str | None = Field(None, description="a Hugging Face hub id (needs network)")
    revision: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> Source:
        given = [k for k in ("path", "package", "hub") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of path, package or hub (got {given or 'none'})")
        return self


class BatchProfile(BaseModel):
    """Batching parameters tuned for one device type."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(16_384, ge=1, description="padded tokens per batch")
    max_items: int = Field(64, ge=1)
    max_delay_ms: float = Field(0.0, ge=0)
    max_wait_ms: float = Field(500.0, gt=0, description="age after which a request runs next")
    latency_target_ms: float | None = Field(None, gt=0, description="cap on a batch's latency")
    hold_horizon_batches: float | None = Field(
        None, gt=0, description="batches of work held beyond the running one (default: "
        "SHOAL_HOLD_HORIZON_BATCHES)")
    hold_horizon_ms: float | None = Field(
        None, gt=0, description="held work must be predicted to start within this (default: "
        "SHOAL_HOLD_HORIZON_MS, or latency_target_ms if smaller)")
    # Seed of the cost model, latency = a + b*T + c*T*L (T padded tokens, L longest);
    # the worker refines it from measured batches.
    cost_a_ms: float = Field(5.0, ge=0)
    cost_b_us: float = Field(20.0, ge=0, description="microseconds per padded token")
    cost_c_ns: float = Field(0.0, ge=0, description="nanoseconds per padded token x length")
    measured: str | None = Field(None, description="the benchmark run this came from")
    # How long a load takes and what the model occupies on this device: the sim runtime
    # sleeps and counts these; a real worker starts from load_ms and measures both.
    load_ms: float = Field(1000.0, ge=0, description="how long a load takes")
    host_load_ms: float | None = Field(
        None, ge=0, description="sim: how long a reload from the host-memory tier takes "
        "(default: a tenth of load_ms)")
    footprint_bytes: int | None = Field(
        None, ge=1, description="sim: device bytes the loaded model takes (default: 100 MB)")
    precision: Precision | None = Field(
        None, description="the forward pass's number format (default: bf16 on a CUDA device "
        "that supports it, else fp16 on CUDA, fp32 on CPU); fp16 is refused on cpu")
    runtime: str | None = Field(
        None, description="the engine measured fastest on this device with vectors within "
        "the parity bound (`shoal onboard`/`shoal tune` write it): it serves the model on "
        "this device when the entry names no `runtime` and SHOAL_RUNTIME is not set")

    @field_validator("runtime")
    @classmethod
    def _known_runtime(cls, value: str | None) -> str | None:
        return None if value is None else engines.known(value, *engines.PER_MODEL)


class Prompts(BaseModel):
    """Text put before each input, e.g. e5's "query: " and "passage: "."""

    model_config = ConfigDict(extra="forbid")

    query: str = ""
    document: str = ""


class ModelEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    id: str = Field(min_length=1, description="the Hugging Face id users know")
    adapter: str = Field(description="the model family; see `shoal models adapters`")
    description: str = ""
    source: Source
    tasks: list[str] | None = Field(None, description="default: the adapter's operation")
    dims: int | None = Field(None, ge=1, description="width of the output vectors")
    max_seq_length: int | None = Field(
        None, ge=1, description="default: read from the model's files"
    )
    pooling: Literal["mean", "cls", "lasttoken"] | None = Field(
        None, description="dense: default read from the sentence-transformers files"
    )
    normalize: bool | None = Field(
        None, description="default: true when the model ships a Normalize module"
    )
    prompts: Prompts = Field(default_factory=Prompts)
    image_tokens: int = Field(DEFAULT_IMAGE_TOKENS, ge=1, description="cost of one image")
    defaults: dict[str, Any] = Field(
        default_factory=dict, description="request options used where the caller gives none"
    )
    profiles: dict[str, BatchProfile] = Field(default_factory=dict)
    loras: dict[str, Source] = Field(
        default_factory=dict, description="LoRA adapters (peft format) by name; a request "
        "picks one with options.lora")
    runtime: str = Field(
        engines.DEFAULT, description="the engine that serves the model, one of the registry's "
        "(`tasks.engines`: pytorch, shoal's PyTorch runtime; sglang, an SGLang server; onnx, "
        "ONNX Runtime on a graph `shoal export` makes; docs/runtimes.md), each for the "
        "families its entry lists")
    queue_type: QueueType | None = Field(
        None, description="the type of the model's queue: quorum (replicated, poison "
        "messages dead-lettered after SHOAL_QUEUE_DELIVERY_LIMIT deliveries) or classic (one "
        "node, no delivery limit, less broker work per message); default: SHOAL_QUEUE_TYPE. "
        "One value for the model everywhere, not per device: the gateway and every worker "
        "declare the same queue (docs/models.md, \"Queue type\")")

    @field_validator("adapter")
    @classmethod
    def _known_adapter(cls, value: str) -> str:
        if value not in ADAPTERS:
            raise ValueError(f"unknown adapter {value!r}; allowed: {sorted(ADAPTERS)}")
        return value

    @field_validator("runtime")
    @classmethod
    def _known_runtime(cls, value: str) -> str:
        return engines.known(value, *engines.PER_MODEL)

    @field_validator("loras")
    @classmethod
    def _lora_names(cls, value: dict[str, Source]) -> dict[str, Source]:
        wrong = [name for name in value if not LORA_NAME.fullmatch(name)]
        if wrong:
            raise ValueError(f"LoRA names {wrong} are not allowed: a name is 1 to 128 of "
                             "letters, digits, '.', '_', '-' and '/', starting with a letter "
                             "or digit (no ':', which separates model and LoRA in 'model:lora')")
        return value

    @model_validator(mode="after")
    def _fits_adapter(self) -> ModelEntry:
        contract = self.contract
        if self.tasks is None:
            self.tasks = [contract.operation]
        elif self.tasks != [contract.operation]:
            raise ValueError(f"tasks: adapter {self.adapter!r} serves {[contract.operation]}, "
                             f"not {self.tasks} (allowed operations: {list(OPERATIONS)})")
        if contract.has_dims and self.dims is None:
            raise ValueError(f"dims: adapter {self.adapter!r} needs the width of its vectors")
        try:
            parse_options(contract.operation, {}, self.defaults)
        except ShoalError as exc:
            raise ValueError(f"defaults: {exc.message}") from None
        if "lora" in self.defaults:
            raise ValueError("defaults: lora cannot be a default; a request names its LoRA "
                             "adapter in options.lora")
        self._check_engine()
        self._check_profile_engines()
        self._check_precisions()
        if self.loras and self.adapter not in LORA_ADAPTERS:
            raise ValueError(f"loras: adapter {self.adapter!r} does not serve LoRA adapters; "
                             f"those that do: {sorted(LORA_ADAPTERS)}")
        return self

    def _check_engine(self) -> None:
        runs_on = engines.engine(self.runtime)
        if self.adapter not in runs_on.families:
            raise ValueError(f"runtime: adapter {self.adapter!r} cannot run on {self.runtime}; "
                             f"the adapters that can: {sorted(runs_on.families)} (or say "
                             f"runtime: {engines.DEFAULT})")
        if self.loras and not runs_on.loras:
            # ONNX: a graph is exported without them; shoal's SGLang runtime loads none.
            raise ValueError(f"loras: the {self.runtime} runtime serves no LoRA adapters; say "
                             f"runtime: {engines.DEFAULT} to serve them per request")

    def _check_profile_engines(self) -> None:
        for device, profile in self.profiles.items():
            if profile.runtime is None:
                continue
            runs_on = engines.engine(profile.runtime)
            if self.adapter not in runs_on.families or (self.loras and not runs_on.loras):
                why = "no LoRA adapters" if self.adapter in runs_on.families else \
                    f"the adapters {sorted(runs_on.families)}"
                raise ValueError(f"profiles.{device}.runtime: {profile.runtime} serves {why}, "
                                 f"not this {self.adapter} entry; say {engines.DEFAULT}")

    def _check_precisions(self) -> None:
        for device, profile in self.profiles.items():
            if profile.precision is None:
                continue
            # A profile's precision is that of the engine it names, else of the entry's.
            runtime = profile.runtime or self.runtime
            known = engines.engine(runtime).precisions
            if profile.precision not in known:
                raise ValueError(f"profiles.{device}.precision: {profile.precision} is not a "
                                 f"format of runtime {runtime}; its formats: {list(known)}")
            on_cpu = engines.engine(runtime).cpu_precisions
            if device == "cpu" and profile.precision not in on_cpu:
                raise ValueError(f"profiles.cpu.precision: {profile.precision} is not served "
                                 "on a CPU (its fp16 CPU kernels are slow or missing); use one "
                                 f"of {list(on_cpu)}")

    @property
    def contract(self) -> AdapterContract:
        return ADAPTERS[self.adapter]

    @property
    def operation(self) -> str:
        return self.contract.operation

    def parse(self, kwargs: Any) -> ParsedRequest:
        """A task's kwargs checked for this model: its operation, inputs and defaults, and
        for encode its kind of embedding and width. ShoalError(VALIDATION_ERROR) if wrong;
        LORA_NOT_FOUND for an options.lora that is none of the entry's `loras`."""
        contract = self.contract
        tokens = self.adapter in TOKEN_ADAPTERS
        if contract.operation == "encode":
            parsed = parse_encode(kwargs, self.dims, contract.inputs, self.defaults, self.id,
                                  contract.outputs[0], tokens)
        else:
            parsed = parse_request(contract.operation, kwargs, contract.inputs, self.defaults,
                                   self.id, tokens)
        lora = getattr(parsed.options, "lora", None)
        if lora is not None and lora not in self.loras:
            raise ShoalError(ErrorCode.LORA_NOT_FOUND, self._lora_not_found(lora))
        return parsed

    def _lora_not_found(self, lora: str) -> str:
        if not self.loras:
            return f"{self.id} has no LoRA adapters (asked for {lora!r}); leave options.lora unset"
        return f"{self.id} has no LoRA adapter {lora!r}; its LoRA adapters: {sorted(self.loras)}"

    def estimate(self, kwargs: Any) -> Estimate:
        """(items, real tokens, longest item's tokens) of a request to this model, counted
        without a tokenizer: the one estimate every scheduler input comes from (the
        gateway's headers, a Celery client's, the sim's sleep, bench's messages). Anything
        malformed counts as small; it is rejected where it is parsed."""
        return estimate_request(self.operation, kwargs, self.max_seq_length or DEFAULT_MAX_TOKENS,
                                self.image_tokens,
                                self.defaults.get("max_tokens", GenerateOptions.max_tokens))

    def profile(self, device: str) -> BatchProfile | None:
        """The tuned profile for a device type ('cpu', 'l4', 'h100', ...), if any."""
        return self.profiles.get(device)

    @property
    def names_runtime(self) -> bool:
        """Whether the entry says `runtime:` itself (pytorch included), which no profile's
        choice overrides."""
        return "runtime" in self.model_fields_set


def load_entry(path: Path) -> ModelEntry:
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise CatalogError(f"{path}: cannot read: {exc}") from exc
    if not isinstance(raw, dict):
        raise CatalogError(f"{path}: expected a mapping at the top level")
    try:
        return ModelEntry.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"field '{'.'.join(str(p) for p in err['loc'])}': {err['msg']}" for err in exc.errors()
        )
        raise CatalogError(f"{path}: {problems}") from exc


class Catalog:
    """All entries of a catalog directory, by model id."""

    def __init__(self, entries: dict[str, ModelEntry],
                 origins: dict[str, Path] | None = None) -> None:
        self._entries = entries
        self._origins = origins or {}

    @classmethod
    def from_dir(cls, directory: Path) -> Catalog:
        if not directory.is_dir():
            raise CatalogError(f"catalog directory {directory} does not exist")
        entries: dict[str, ModelEntry] = {}
        origin: dict[str, Path] = {}
        for path in sorted(directory.glob("*.yaml")):
            entry = load_entry(path)
            if entry.id in entries:
                raise CatalogError(f"{path}: id '{entry.id}' is also defined in {origin[entry.id]}")
            entries[entry.id] = entry
            origin[entry.id] = path
        return cls(entries, origin)

    def origin(self, model_id: str) -> Path | None:
        """The file an entry was read from."""
        return self._origins.get(model_id)

    def get(self, model_id: str) -> ModelEntry | None:
        return self._entries.get(model_id)

    def require(self, model_ids: list[str]) -> list[ModelEntry]:
        """The entries for `model_ids`; an id missing from the catalog is an error."""
        missing = [m for m in model_ids if m not in self._entries]
        if missing:
            raise CatalogError(
                f"models {missing} are not in the catalog; known: {sorted(self._entries)}"
            )
        return [self._entries[m] for m in model_ids]

    def select(self, patterns: list[str]) -> list[ModelEntry]:
        """The entries that `patterns` name, in catalog order: ids, or globs ('*',
        'BAAI/*'). An id that is no entry, or a glob that matches none, is an error."""
        unmatched = [p for p in patterns
                     if not any(fnmatchcase(model_id, p) for model_id in self._entries)]
        if unmatched:
            raise CatalogError(f"models {unmatched} match nothing in the catalog; known: "
                               f"{sorted(self._entries)}")
        return [e for model_id, e in self._entries.items()
                if any(fnmatchcase(model_id, p) for p in patterns)]

    def __iter__(self):
        return iter(self._entries.values())


@lru_cache(maxsize=8)
def load_catalog(directory: Path | str | None = None) -> Catalog:
    """The packaged catalog with the entries of `directory` (a user's folder, e.g.
    SHOAL_CATALOG_DIR) read over it: an entry there replaces the packaged one of its id.

    One directory names the whole catalog, so the worker can hand it to its runtime
    process as a single `--catalog-dir`."""
    layers = [PACKAGED_CATALOG_DIR]
    if directory is not None and Path(directory).resolve() != PACKAGED_CATALOG_DIR.resolve():
        layers.append(Path(directory))
    entries: dict[str, ModelEntry] = {}
    origins: dict[str, Path] = {}
    for layer in layers:
        catalog = Catalog.from_dir(layer)
        for entry in catalog:
            entries[entry.id] = entry
            origins[entry.id] = catalog._origins[entry.id]
    return Catalog(entries, origins)
