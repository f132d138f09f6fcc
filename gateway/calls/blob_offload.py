"""The gateway's side of the claim check: large images go to the blob store, not the broker.

`check_out` replaces every image over SHOAL_CLAIM_CHECK_BYTES in a task's items
by a claim (`tasks.claims`: key, size, sha256). `submit_claimed` then publishes
the request *and* uploads the images at the same time: the message queues (and a
worker may already start polling for the blobs) while the bytes are on their way,
so the upload overlaps the queueing instead of adding to it. If the upload fails
or outlives SHOAL_CLAIM_UPLOAD_TIMEOUT_S, the caller gets 503
BLOB_STORE_UNAVAILABLE and the request is revoked.

Blob store calls block (fsspec's sync API) and hashing 10 MB takes ~20 ms: both run
in a thread, never on the event loop. The blobs of an answered request are deleted
by the worker once its message is acked; those of a request that never reached a
worker (refused, revoked, timed out before the upload ended) are deleted here, and
anything else left behind is swept after SHOAL_BLOB_TTL_S (`sweep_forever`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from gateway.edge.api_errors import ApiError
from gateway.edge.gateway_metrics import BLOBS_SWEPT, CLAIM_BYTES, CLAIM_UPLOAD_SECONDS, CLAIMS
from tasks.claims import BINARY_KEYS, Claim
from tasks.envelope import Part
from tasks.errors import ErrorCode

log = logging.getLogger(__name__)

# Hash on the loop below this many bytes in all (a thread hop costs more than that).
HASH_INLINE_BYTES = 1024 * 1024
_background: set[asyncio.Future[Any]] = set()


@dataclass(frozen=True, slots=True)
class Upload:
    claim: Claim
    data: bytes


def _claims_for(parts: list[bytes]) -> list[Claim]:
    from tasks.blobs import CLAIMS, BlobStore

    return [Claim(BlobStore.new_key(CLAIMS), len(data), hashlib.sha256(data).hexdigest())
            for data in parts]


def has_claims(kwargs: dict[str, Any], threshold: int) -> bool:
    """Whether `check_out` would turn any part of `kwargs` into a claim (a text request's
    items hold no bytes: one type test per item)."""
    items = kwargs.get("items")
    if not isinstance(items, list):
        return False
    for item in items:
        if type(item) is not dict or (len(item) == 1 and "text" in item):
            continue  # a plain text item, as most are
        for field in BINARY_KEYS:
            value = item.get(field)
            if isinstance(value, bytes) and len(value) > threshold:
                return True
    return False


async def check_out(kwargs: dict[str, Any], threshold: int
                    ) -> tuple[dict[str, Any], list[Upload]]:
    """`kwargs` with every binary part over `threshold` bytes replaced by a claim, and the
    uploads those claims need. Without such parts, `kwargs` itself and no uploads."""
    items = kwargs.get("items")
    if not isinstance(items, list):
        return kwargs, []
    big = [(i, field, value) for i, item in enumerate(items) if isinstance(item, dict)
           for field in BINARY_KEYS
           if isinstance(value := item.get(field), bytes) and len(value) > threshold]
    if not big:
        return kwargs, []
    parts = [value for _, _, value in big]
    if sum(len(p) for p in parts) > HASH_INLINE_BYTES:
        claims = await asyncio.to_thread(_claims_for, parts)
    else:
        claims = _claims_for(parts)
    items = list(items)
    for (index, field, _), claim in zip(big, claims, strict=True):
        items[index] = {**items[index], field: claim.wire()}
    return {**kwargs, "items": items}, [Upload(c, p) for c, p in zip(claims, parts, strict=True)]


def _put_all(url: str, uploads: list[Upload]) -> None:
    from tasks.blobs import blob_store

    store = blob_store(url)
    for upload in uploads:
        store.put(upload.claim.key, upload.data)


async def upload_first(url: str, uploads: list[Upload]) -> None:
    """Upload before publishing: for a job's request, which nobody waits on, so overlapping
    the upload with the queueing would gain nothing and a failed upload is retried."""
    await asyncio.to_thread(_put_all, url, uploads)
    CLAIMS.labels("uploaded").inc(len(uploads))
    CLAIM_BYTES.inc(sum(u.claim.size for u in uploads))


def _delete_all(url: str, uploads: list[Upload]) -> None:
    from tasks.blobs import blob_store

    blob_store(url).delete([u.claim.key for u in uploads])


def _in_background(future: asyncio.Future[Any]) -> None:
    _background.add(future)
    future.add_done_callback(_background.discard)


def _delete_when_uploaded(upload: asyncio.Future[None], url: str, uploads: list[Upload]) -> None:
    """Delete the blobs of a request that no worker will fetch, once their upload ends
    (a thread cannot be stopped; deleting earlier would race it)."""

    async def delete() -> None:
        # A failed blob is not there (atomic writes); the others of the request may be.
        with contextlib.suppress(BaseException):
            await upload
        try:
            await asyncio.to_thread(_delete_all, url, uploads)
        except Exception as exc:
            log.warning("could not delete unused claim blobs (swept later): %s", exc)

    _in_background(asyncio.ensure_future(delete()))


async def submit_claimed(broker: Any, model: str, part: Part, timeout_s: float,
                         uploads: list[Upload], url: str, upload_timeout_s: float,
                         caller: Any = None) -> dict:
    """Publish `part` and upload its blobs concurrently; its result, as `Broker.submit`
    (`caller`: the waiting request's ASGI scope, as there).

    503 BLOB_STORE_UNAVAILABLE (and the request revoked) if the upload fails or is not
    done within `upload_timeout_s` (workers stop waiting for a blob after that window)."""
    started = time.perf_counter()
    upload = asyncio.ensure_future(asyncio.to_thread(_put_all, url, uploads))
    submit = asyncio.ensure_future(broker.submit(model, part, timeout_s, caller))
    uploaded = False
    try:
        # A result (or a refusal: a full queue, the deadline) before the upload ends is
        # the caller's answer as it is.
        await asyncio.wait({upload, submit}, timeout=upload_timeout_s,
                           return_when=asyncio.FIRST_COMPLETED)
        if not submit.done():
            # The upload ended first (or its window did): it must have succeeded by now.
            try:
                await asyncio.wait_for(asyncio.shield(upload),
                                       max(0.0, upload_timeout_s - (time.perf_counter()
                                                                    - started)))
            except Exception as exc:
                CLAIMS.labels("failed").inc(len(uploads))
                why = "took too long" if isinstance(exc, TimeoutError) else f"failed: {exc}"
                log.warning("claim upload for %s %s", part.task_id, why)
                raise ApiError(ErrorCode.BLOB_STORE_UNAVAILABLE,
                               f"the upload of the request's large inputs to the blob store "
                               f"(SHOAL_BLOB_URL) {why}; retry later", retry_after=1) from None
            uploaded = True
            CLAIMS.labels("uploaded").inc(len(uploads))
            CLAIM_BYTES.inc(sum(u.claim.size for u in uploads))
            CLAIM_UPLOAD_SECONDS.observe(time.perf_counter() - started)
        return await submit
    finally:
        if not submit.done():
            submit.cancel()  # unpublished yet: never sent; published: revoked below
            _in_background(asyncio.ensure_future(broker.cancel([part.task_id])))
        if not uploaded:
            # Answered (or refused) before the upload ended: nobody will fetch the blobs.
            _delete_when_uploaded(upload, url, uploads)


def _sweep(url: str, ttl_s: float) -> list[str]:
    from tasks.blobs import CLAIMS, blob_store

    return blob_store(url).sweep(CLAIMS, ttl_s)


async def sweep_forever(url: str, ttl_s: float, interval_s: float) -> None:
    """Every `interval_s`, delete claim blobs older than `ttl_s`: those of requests that
    were dead-lettered or lost (their worker acks nothing, so deletes nothing)."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            swept = await asyncio.to_thread(_sweep, url, ttl_s)
        except Exception as exc:  # an unreachable store must not end the loop
            log.warning("sweeping orphaned claim blobs failed: %s", exc)
            continue
        if swept:
            BLOBS_SWEPT.inc(len(swept))
            log.info("swept %d orphaned claim blobs older than %.0f s", len(swept), ttl_s)
