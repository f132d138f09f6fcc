"""API keys: how they are made, stored (hashed) and found, and the file that lists them.

A key is `shoal-` and 32 random bytes (256 bits, base64url). Only its SHA-256
is stored. A plain hash suffices because the key is random, not a password a
person chose: a slow KDF (bcrypt, scrypt) protects low-entropy secrets from a
dictionary; against 2^256 possible keys a preimage search is hopeless at any
speed, and one SHA-256 costs ~1 µs per request where a KDF would cost ~50 ms.

The keys file (SHOAL_API_KEYS_FILE), YAML or JSON:

    keys:
      - name: search-team                 # shown in logs and errors, never the key
        hash: sha256:9f86d0...            # `shoal keys add` prints the entry
        models: ["BAAI/*", "sentence-transformers/all-MiniLM-L6-v2"]  # default: all
        requests_per_minute: 600          # default: no limit
        tokens_per_minute: 200000         # default: no limit
        inputs: ["search-team/*"]         # blob-store keys its bulk jobs may name as
                                          # "input" (globs; default: none but its own)
        admin: false                      # true: sees and cancels every key's jobs
        concurrent_jobs: 10               # jobs queued or running at once (default:
                                          # SHOAL_JOBS_PER_KEY; 0: no limit)
        queued_job_texts: 10000000        # items its jobs hold not yet done (default:
                                          # SHOAL_JOB_TEXTS_PER_KEY; 0: no limit)

A job belongs to the key (by name) that created it: another key is told there is no such
job (`gateway.routes.job_routes`). A key's name is its tenant: a rotated key (a new secret, the same
name) keeps its jobs.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

KEY_PREFIX = "shoal-"
HASH_PREFIX = "sha256:"


def new_key() -> str:
    """A fresh API key: 256 random bits."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    """How a key is stored: `sha256:` and the hex digest of its UTF-8 bytes."""
    return HASH_PREFIX + hashlib.sha256(key.encode()).hexdigest()


class KeyEntry(BaseModel):
    """One entry of the keys file, checked."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=200)
    hash: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")
    models: list[str] = Field(default_factory=lambda: ["*"], min_length=1)
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    inputs: list[str] = Field(default_factory=list)
    admin: bool = False
    concurrent_jobs: int | None = Field(None, ge=0)
    queued_job_texts: int | None = Field(None, ge=0)


class KeyFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keys: list[KeyEntry]

    @model_validator(mode="after")
    def _unique(self) -> KeyFile:
        for what in ("name", "hash"):
            seen: set[str] = set()
            for entry in self.keys:
                value = getattr(entry, what)
                if value in seen:
                    shown = value if what == "name" else value[:20] + "..."
                    raise ValueError(f"two keys have the {what} {shown!r}")
                seen.add(value)
        return self


class KeyFileError(ValueError):
    """A keys file that cannot be used; the message names the file and what is wrong."""


@dataclass(eq=False)
class ApiKey:
    """A configured key as the gateway uses it."""

    name: str
    digest: bytes  # the SHA-256 of the key
    models: tuple[str, ...]
    requests_per_minute: int | None
    tokens_per_minute: int | None
    inputs: tuple[str, ...] = ()  # blob-store key globs its jobs may read as "input"
    admin: bool = False  # sees and cancels every key's jobs
    concurrent_jobs: int | None = None  # None: SHOAL_JOBS_PER_KEY (gateway.jobs.key_jobs)
    queued_job_texts: int | None = None  # None: SHOAL_JOB_TEXTS_PER_KEY
    _allowed: dict[str, bool] = field(default_factory=dict, repr=False)

    @classmethod
    def from_entry(cls, entry: KeyEntry) -> ApiKey:
        return cls(entry.name, bytes.fromhex(entry.hash.removeprefix(HASH_PREFIX)),
                   tuple(entry.models), entry.requests_per_minute, entry.tokens_per_minute,
                   tuple(entry.inputs), entry.admin, entry.concurrent_jobs,
                   entry.queued_job_texts)

    @property
    def limited(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None

    @property
    def bucket(self) -> str:
        """Its rate-limit state's name: from the hash, so a rotated key starts afresh
        and a renamed one keeps its state."""
        return self.digest[:12].hex()

    def allows(self, model: str) -> bool:
        """Whether the key may use `model` (a catalog id; globs as in SHOAL_MODELS)."""
        allowed = self._allowed.get(model)
        if allowed is None:
            allowed = any(fnmatch.fnmatchcase(model, glob) for glob in self.models)
            if len(self._allowed) < 10_000:  # callers choose the names: bound the cache
                self._allowed[model] = allowed
        return allowed

    def may_read_input(self, blob_key: str) -> bool:
        """Whether a job of this key may name `blob_key` as its input by the grants of
        the keys file (an admin key may name any)."""
        return self.admin or any(fnmatch.fnmatchcase(blob_key, g) for g in self.inputs)

    def owns(self, owner: str | None) -> bool:
        """Whether a job created by the key named `owner` (None: made with keys off) is
        this key's to see and cancel."""
        return self.admin or owner == self.name


class KeyRing:
    """The configured keys, found by the key a caller presents."""

    def __init__(self, keys: list[ApiKey]) -> None:
        self.keys = keys

    def find(self, presented: str) -> ApiKey | None:
        """The key whose hash is the presented key's, compared in constant time with every
        stored hash (no early exit): how long it takes says nothing about which matched."""
        digest = hashlib.sha256(presented.encode("utf-8", "surrogateescape")).digest()
        found = None
        for key in self.keys:
            if hmac.compare_digest(key.digest, digest):
                found = key
        return found


def parse_key_file(text: str, source: str) -> KeyFile:
    """The checked contents of a keys file; KeyFileError saying what is wrong where."""
    try:
        raw: Any = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise KeyFileError(f"{source}: not valid YAML or JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise KeyFileError(f"{source}: expected a mapping with 'keys: [...]' (see `shoal keys "
                           "add`), got {type(raw).__name__}")
    try:
        return KeyFile.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'file'}: {err['msg']}"
            for err in exc.errors(include_url=False))
        raise KeyFileError(f"{source}: {problems}") from None


def load_key_ring(path: Path) -> KeyRing:
    try:
        text = path.read_text()
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read the keys file (SHOAL_API_KEYS_FILE): "
                           f"{exc.strerror or exc}") from None
    return KeyRing([ApiKey.from_entry(e) for e in parse_key_file(text, str(path)).keys])
