"""The worker's side of the claim check: fetch claimed blobs before a request is scheduled.

A message with a `shoal_claims` header names blobs (`tasks.claims`) that the
gateway may still be uploading. `ClaimFetcher.fetch` starts fetching them at once,
on a small thread pool of its own (never the event loop, which must keep the AMQP
heartbeats going, nor the runtime's thread, which must keep computing): it
decodes the (small) body, reads each blob, and checks its size and sha256. A blob
not there yet is polled for, with backoff, until the claim's upload window
(SHOAL_CLAIM_UPLOAD_TIMEOUT_S after the request was sent) or the request's
deadline ends, whichever is first; then the request alone fails BLOB_MISSING.
Wrong bytes fail it BLOB_CORRUPT. The outcome goes back to the loop through one
queue and `call_soon`, in the order fetches ended.

`delete` removes a request's blobs once its message is acked (success or
failure); a requeued, returned or redelivered message keeps them for its next
delivery.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from app.worker import metrics
from tasks.blobs import BlobMissing, blob_store
from tasks.claims import Claimed, claims_in, verify
from tasks.envelope import decode_body
from tasks.errors import ErrorCode, ShoalError

log = logging.getLogger(__name__)

FETCH_THREADS = 4
FIRST_POLL_S = 0.01
MAX_POLL_S = 0.25


@dataclass(slots=True)
class Fetched:
    """A request's blobs by key, or why they could not be had."""

    blobs: dict[str, bytes] = field(default_factory=dict)
    error_code: str | None = None
    error_message: str | None = None


class ClaimFetcher:
    def __init__(self, url: str, upload_timeout_s: float,
                 call_soon: Callable[[Callable[[], None]], None],
                 threads: int = FETCH_THREADS) -> None:
        self.url = url
        self.upload_timeout_s = upload_timeout_s
        self.call_soon = call_soon
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="shoal-claims")
        self._done: deque[tuple[Callable[[Fetched], None], Fetched]] = deque()
        self._closing = threading.Event()

    def fetch(self, body: bytes, sent_ms: float | None, deadline_ms: int | None,
              cancelled: Callable[[], bool], on_done: Callable[[Fetched], None]) -> None:
        """Fetch and check the blobs `body` claims; `on_done` gets them on the loop."""
        sent_s = time.time() if sent_ms is None else sent_ms / 1000
        give_up = sent_s + self.upload_timeout_s
        if deadline_ms is not None:
            give_up = min(give_up, deadline_ms / 1000)
        future = self.pool.submit(self._fetch, body, give_up, cancelled)

        def done(_: object) -> None:
            try:
                fetched = future.result()
            except BaseException as exc:  # a bug must not lose the request
                log.exception("fetching claims failed")
                fetched = Fetched(error_code=ErrorCode.INTERNAL,
                                  error_message=f"fetching its claimed inputs failed: {exc!r}")
            self._done.append((on_done, fetched))
            self.call_soon(self._drain)

        future.add_done_callback(done)

    def _drain(self) -> None:
        while self._done:
            on_done, fetched = self._done.popleft()
            on_done(fetched)

    def _fetch(self, body: bytes, give_up: float, cancelled: Callable[[], bool]) -> Fetched:
        started = time.perf_counter()
        try:
            kwargs = decode_body(body)
        except ValueError as exc:
            return Fetched(error_code=ErrorCode.INVALID_REQUEST, error_message=str(exc))
        fetched = Fetched()
        try:
            for claimed in claims_in(kwargs):
                data = self._get(claimed, give_up, cancelled)
                verify(claimed, data)
                fetched.blobs[claimed.claim.key] = data
        except ShoalError as exc:
            metrics.CLAIMS_FETCHED.labels(exc.code).inc()
            return Fetched(error_code=exc.code, error_message=exc.message)
        metrics.CLAIMS_FETCHED.labels("ok").inc(len(fetched.blobs))
        metrics.CLAIM_BYTES.inc(sum(len(b) for b in fetched.blobs.values()))
        metrics.CLAIM_FETCH_SECONDS.observe(time.perf_counter() - started)
        return fetched

    def _get(self, claimed: Claimed, give_up: float, cancelled: Callable[[], bool]) -> bytes:
        """The claimed bytes, polling while they are not there (still being uploaded)."""
        key = claimed.claim.key
        delay = FIRST_POLL_S
        first = time.time()
        while True:
            try:
                return blob_store(self.url).get(key)
            except BlobMissing:
                code, why = ErrorCode.BLOB_MISSING, "is not in the blob store"
            except Exception as exc:  # the store itself failed (network, permissions)
                code, why = ErrorCode.BLOB_STORE_UNAVAILABLE, f"could not be read: {exc}"
            if cancelled() or self._closing.is_set():
                raise ShoalError(ErrorCode.CANCELLED,
                                 "the request was revoked while its inputs were fetched")
            now = time.time()
            if now + delay > give_up:
                raise ShoalError(code, f"{claimed.describe()} {why} (SHOAL_BLOB_URL); waited "
                                 f"{now - first:.1f} s, until the request's upload window "
                                 "(SHOAL_CLAIM_UPLOAD_TIMEOUT_S) or deadline ended; send the "
                                 "request again")
            time.sleep(delay)
            delay = min(delay * 2, MAX_POLL_S)

    def delete(self, body: bytes) -> None:
        """Delete the blobs `body` claims (its message was acked), on the pool."""
        if not self._closing.is_set():
            self.pool.submit(self._delete, body)

    def _delete(self, body: bytes) -> None:
        try:
            keys = [c.claim.key for c in claims_in(decode_body(body))]
            blob_store(self.url).delete(keys)
        except Exception as exc:  # swept after SHOAL_BLOB_TTL_S anyway
            log.warning("could not delete claimed blobs (they will be swept): %s", exc)
            return
        metrics.CLAIMS_DELETED.inc(len(keys))

    def close(self) -> None:
        """Stop polling; let deletions already queued finish."""
        self._closing.set()
        self.pool.shutdown(wait=True)
