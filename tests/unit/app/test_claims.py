"""The claim check's helpers: the claim format, the gateway's check-out, the worker's fetcher
(against a real blob store in a temporary folder) and the ack hook that deletes blobs."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from app.worker.lifecycle.claims import ClaimFetcher, Fetched
from app.worker.lifecycle.held import Held
from app.worker.lifecycle.replies import Delivery
from app.worker.lifecycle.splits import Split
from gateway.broker.outbox import _coalescible, _Outgoing
from gateway.calls.blob_offload import check_out
from tasks.blobs import CLAIMS, BlobStore
from tasks.claims import Claim, Claimed, claim_of, claims_in, substitute, verify
from tasks.envelope import (
    H_CLAIMS,
    Annotations,
    Part,
    decode_body,
    read_annotations,
    single_message,
    task_body,
)
from tasks.errors import ErrorCode, ShoalError
from tests.unit.app.test_returns import Message
from tests.unit.test_imports import _loaded_by

BIG = os.urandom(300_000)


def _claim(data: bytes, key: str = "claims/1-a") -> Claim:
    return Claim(key, len(data), hashlib.sha256(data).hexdigest())


# --- the claim format -------------------------------------------------------------------------

def test_a_claim_round_trips_and_malformed_ones_are_no_claims():
    claim = _claim(b"abc")
    assert claim.wire() == {"claim": {"key": "claims/1-a", "size": 3,
                                      "sha256": hashlib.sha256(b"abc").hexdigest()}}
    assert claim_of(claim.wire()) == claim
    for value in (b"bytes", "text", None, {"claim": "x"}, {"claim": {"key": "k", "size": -1,
                                                                     "sha256": "0" * 64}},
                  {"claim": {"key": "k", "size": 1, "sha256": "short"}},
                  {**claim.wire(), "extra": 1}):
        assert claim_of(value) is None


def test_claims_are_found_in_items_and_substituted_in_place():
    kwargs = {"items": [{"text": "a"}, {"image": _claim(BIG, "claims/1-x").wire()},
                        {"image": b"small"}]}
    found = list(claims_in(kwargs))
    assert [(c.item, c.field, c.claim.key) for c in found] == [(1, "image", "claims/1-x")]
    substitute(kwargs, {"claims/1-x": BIG})
    assert kwargs["items"] == [{"text": "a"}, {"image": BIG}, {"image": b"small"}]
    assert list(claims_in(kwargs)) == []


def test_a_claim_without_fetched_bytes_is_missing():
    kwargs = {"items": [{"image": _claim(b"abc").wire()}]}
    with pytest.raises(ShoalError) as caught:
        substitute(kwargs, {})
    assert caught.value.code == ErrorCode.BLOB_MISSING and "item 0" in caught.value.message


@pytest.mark.parametrize("data", [b"abcd", b"abd"], ids=["size", "sha256"])
def test_bytes_that_do_not_match_the_claim_are_corrupt(data):
    claimed = Claimed(2, "image", _claim(b"abc"))
    verify(claimed, b"abc")
    with pytest.raises(ShoalError) as caught:
        verify(claimed, data)
    assert caught.value.code == ErrorCode.BLOB_CORRUPT and "item 2" in caught.value.message


# --- the gateway -----------------------------------------------------------------------------

def test_check_out_claims_only_images_over_the_threshold():
    kwargs = {"model": "m", "items": [{"image": BIG}, {"image": b"tiny"}, {"text": "t"}]}
    claimed, uploads = asyncio.run(check_out(kwargs, 256 * 1024))
    assert kwargs["items"][0] == {"image": BIG}  # the caller's kwargs are left alone
    assert [u.data for u in uploads] == [BIG]
    claim = claim_of(claimed["items"][0]["image"])
    assert claim == uploads[0].claim and claim.key.startswith(f"{CLAIMS}/")
    assert claim.size == len(BIG) and claim.sha256 == hashlib.sha256(BIG).hexdigest()
    assert claimed["items"][1:] == kwargs["items"][1:]
    # The message carries the claim, not the bytes.
    assert BIG not in task_body(claimed) and len(task_body(claimed)) < 1000
    same, none = asyncio.run(check_out(kwargs, len(BIG)))
    assert same is kwargs and none == []
    _, every = asyncio.run(check_out(kwargs, 0))
    assert len(every) == 2


def test_the_claims_header_travels_and_claimed_requests_are_never_coalesced():
    annotations = Annotations("m", "encode", 1, 50, 50, None, 1.0, claims=1)
    message = single_message(Part("t1", annotations, b"body"), "gw")
    assert message.headers[H_CLAIMS] == 1
    assert read_annotations(message.headers).claims == 1
    plain = Annotations("m", "encode", 1, 5, 5, None, 1.0)
    assert H_CLAIMS not in single_message(Part("t0", plain, b"b"), "gw").headers

    def outgoing(task_id: str, a: Annotations) -> _Outgoing:
        return _Outgoing(Part(task_id, a, b"small body"), 1.0, None)  # type: ignore[arg-type]

    groups = _coalescible([outgoing("a", plain), outgoing("b", annotations),
                           outgoing("c", plain)])
    assert [[o.part.task_id for o in g] for g in groups] == [["b"], ["a", "c"]]


def test_the_gateway_does_not_import_fsspec():
    modules, _ = _loaded_by("gateway.app")
    assert "fsspec" not in modules and "gateway.calls.blob_offload" in modules


# --- the worker ------------------------------------------------------------------------------

class Fetching:
    """A ClaimFetcher on a real store, its outcomes collected (no event loop: `call_soon`
    runs the drain on the fetcher's thread)."""

    def __init__(self, root: Path, upload_timeout_s: float = 5.0) -> None:
        self.store = BlobStore(str(root))
        self.fetcher = ClaimFetcher(str(root), upload_timeout_s, lambda fn: fn())
        self.outcomes: list[Fetched] = []
        self.done = threading.Event()

    def fetch(self, kwargs: dict, sent_ms: float | None = None,
              deadline_ms: int | None = None,
              cancelled: Callable[[], bool] = lambda: False) -> Fetched:
        self.done.clear()

        def on_done(fetched: Fetched) -> None:
            self.outcomes.append(fetched)
            self.done.set()

        self.fetcher.fetch(task_body(kwargs), sent_ms, deadline_ms, cancelled, on_done)
        assert self.done.wait(30), "the fetch never ended"
        return self.outcomes[-1]


@pytest.fixture
def fetching(tmp_path):
    f = Fetching(tmp_path / "blobs", upload_timeout_s=1.0)
    yield f
    f.fetcher.close()


def test_the_fetcher_waits_for_a_blob_still_being_uploaded(fetching):
    key = BlobStore.new_key(CLAIMS)
    kwargs = {"items": [{"text": "t"}, {"image": _claim(BIG, key).wire()}]}
    misses: list[bool] = []

    def upload_after_a_miss() -> bool:
        # The fetcher asks whether the request was revoked after each miss: the upload
        # lands once it has looked and not found the blob.
        if not misses:
            fetching.store.put(key, BIG)
        misses.append(True)
        return False

    fetched = fetching.fetch(kwargs, sent_ms=time.time() * 1000, cancelled=upload_after_a_miss)
    assert len(misses) == 1  # it missed once, then found the upload
    assert fetched.error_code is None and fetched.blobs == {key: BIG}


def test_a_blob_that_never_comes_is_missing_and_named(fetching):
    kwargs = {"items": [{"text": "t"}, {"image": _claim(BIG, "claims/1-gone").wire()}]}
    fetched = fetching.fetch(kwargs, sent_ms=time.time() * 1000)
    assert fetched.error_code == ErrorCode.BLOB_MISSING
    assert "item 1's image" in fetched.error_message and "claims/1-gone" in fetched.error_message


def test_the_deadline_ends_the_wait_before_the_upload_window(tmp_path):
    f = Fetching(tmp_path / "blobs", upload_timeout_s=3600)
    try:
        kwargs = {"items": [{"image": _claim(BIG, "claims/1-gone").wire()}]}
        now_ms = time.time() * 1000
        fetched = f.fetch(kwargs, sent_ms=now_ms, deadline_ms=int(now_ms) + 100)
        assert fetched.error_code == ErrorCode.BLOB_MISSING
    finally:
        f.fetcher.close()


def test_a_blob_with_other_bytes_is_corrupt(fetching):
    key = BlobStore.new_key(CLAIMS)
    fetching.store.put(key, BIG[:-1] + b"\0")
    fetched = fetching.fetch({"items": [{"image": _claim(BIG, key).wire()}]})
    assert fetched.error_code == ErrorCode.BLOB_CORRUPT and "sha256" in fetched.error_message


def test_an_acked_message_deletes_its_blobs_and_a_requeued_one_keeps_them(fetching):
    keys = [BlobStore.new_key(CLAIMS) for _ in range(2)]
    for key in keys:
        fetching.store.put(key, BIG)
    bodies = [task_body({"items": [{"image": _claim(BIG, key).wire()}]}) for key in keys]
    acked, requeued = Delivery(Message()), Delivery(Message())
    acked.on_acked = [lambda: fetching.fetcher.delete(bodies[0])]
    requeued.on_acked = [lambda: fetching.fetcher.delete(bodies[1])]
    requeued.requeue()
    acked.settle()
    fetching.fetcher.close()  # waits for the deletion it queued
    assert not fetching.store.exists(keys[0]) and fetching.store.exists(keys[1])
    assert acked.message.acks == 1 and requeued.message.requeues == 1


def test_parts_of_a_split_request_keep_its_fetched_blobs():
    annotations = Annotations("m", "encode", 2, 100, 50, None, None, claims=2)
    body = task_body({"items": [{"image": _claim(BIG, "k").wire()}]})
    whole = Held(Delivery(Message()), "t", annotations, body, blobs={"k": BIG})
    split = Split([(annotations, body), (annotations, body)])
    part = split.part_held(whole, 1)
    assert part.blobs == {"k": BIG} and part.body == body  # the body keeps the claim
    assert claim_of(decode_body(part.body)["items"][0]["image"]) is not None
