"""Claim checks: a large binary part of a task carried as a reference into the blob store.

A gateway moves an image over SHOAL_CLAIM_CHECK_BYTES to the blob store
(`tasks.blobs`) and puts a claim in its place, so the broker carries a few
hundred bytes instead of megabytes:

    {"image": {"claim": {"key": "claims/1764800000-<hex>", "size": 10485760,
                         "sha256": "<64 hex digits>"}}}

The item keeps its key (`image`), so cost estimates and schema errors still see
an image. A worker fetches the claimed bytes, checks their size and sha256, and
puts them back in place of the claim (`substitute`) before the runtime sees the
request. Celery clients never need claims: they send images inline.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from tasks.errors import ErrorCode, ShoalError

CLAIM = "claim"
# The item keys whose values may be claimed: binary parts.
BINARY_KEYS = ("image",)


@dataclass(frozen=True, slots=True)
class Claim:
    key: str  # in the blob store (`tasks.blobs.CLAIMS` kind)
    size: int
    sha256: str  # hex

    def wire(self) -> dict[str, Any]:
        """The value that replaces the bytes in the item."""
        return {CLAIM: {"key": self.key, "size": self.size, "sha256": self.sha256}}


@dataclass(frozen=True, slots=True)
class Claimed:
    """A claim found in a task's kwargs: where it is, and what it names."""

    item: int  # index in `items`
    field: str  # the item's key ("image")
    claim: Claim

    def describe(self) -> str:
        return f"item {self.item}'s {self.field} ({self.claim.size} bytes, {self.claim.key})"


def claim_of(value: Any) -> Claim | None:
    """The claim a value carries, or None if it is no claim (bytes, text, anything else).
    A malformed claim is no claim: the schema check then refuses the item as it is."""
    if not isinstance(value, dict) or len(value) != 1:
        return None
    inner = value.get(CLAIM)
    if not isinstance(inner, dict):
        return None
    key, size, digest = inner.get("key"), inner.get("size"), inner.get("sha256")
    if not (isinstance(key, str) and key and isinstance(size, int) and size >= 0
            and isinstance(digest, str) and len(digest) == 64):
        return None
    return Claim(key, size, digest)


def claims_in(kwargs: Mapping[str, Any]) -> Iterator[Claimed]:
    """Every claim in a task's items, in order."""
    items = kwargs.get("items")
    if not isinstance(items, list):
        return
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        for field in BINARY_KEYS:
            claim = claim_of(item.get(field))
            if claim is not None:
                yield Claimed(index, field, claim)


def verify(claimed: Claimed, data: bytes) -> None:
    """BLOB_CORRUPT unless `data` has the claim's size and sha256."""
    claim = claimed.claim
    if len(data) != claim.size:
        raise ShoalError(ErrorCode.BLOB_CORRUPT,
                         f"{claimed.describe()} has {len(data)} bytes in the blob store, not "
                         f"the {claim.size} the request was sent with; send it again")
    if hashlib.sha256(data).hexdigest() != claim.sha256:
        raise ShoalError(ErrorCode.BLOB_CORRUPT,
                         f"{claimed.describe()} in the blob store does not match the sha256 "
                         "the request was sent with; send it again")


def substitute(kwargs: dict[str, Any], blobs: Mapping[str, bytes]) -> None:
    """Put the fetched bytes in place of every claim in `kwargs` (changed in place).
    BLOB_MISSING for a claim without bytes in `blobs` (one the worker was not told to
    fetch: a claim in a message without the `shoal_claims` header)."""
    for claimed in list(claims_in(kwargs)):
        data = blobs.get(claimed.claim.key)
        if data is None:
            raise ShoalError(ErrorCode.BLOB_MISSING,
                             f"{claimed.describe()} is a claim check the worker did not "
                             "fetch: its message has no shoal_claims header")
        kwargs["items"][claimed.item][claimed.field] = data
