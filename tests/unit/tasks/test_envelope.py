import msgpack
import pytest

from tasks.adapters import ADAPTERS
from tasks.catalog import ModelEntry, Source
from tasks.envelope import (
    H_BULK,
    H_COALESCED,
    H_DEADLINE,
    H_MODEL,
    H_OP,
    H_REPLY_BATCH,
    Annotations,
    Part,
    annotate,
    coalesce,
    decode_body,
    read_annotations,
    read_coalesced,
    single_message,
    task_body,
    task_headers,
    task_part,
)
from tasks.names import ENCODE, SCORE


def test_headers_carry_celery_fields_and_annotations():
    ann = Annotations("m/x", "encode", 2, 10, 6, deadline_ms=2_000_000_000_000, sent_ms=1)
    headers = task_headers("tid", ENCODE, ann, "gw")
    assert headers["task"] == "shoal.encode" and headers["id"] == "tid"
    assert headers["root_id"] == "tid" and headers["lang"] == "py"
    assert headers["expires"].startswith("2033-05-18")
    assert read_annotations(headers) == ann


def test_body_is_celery_protocol_v2_in_msgpack():
    kwargs = {"model": "m", "items": [{"text": "hi"}], "options": {}}
    body = task_body(kwargs)
    args, kw, embed = msgpack.unpackb(body)
    assert args == [] and kw == kwargs and set(embed) == {"callbacks", "errbacks", "chain",
                                                           "chord"}
    assert decode_body(body) == kwargs


@pytest.mark.parametrize("body", [b"\xc1", msgpack.packb({"a": 1}), msgpack.packb([1, 2])])
def test_malformed_bodies_raise_value_error(body):
    with pytest.raises(ValueError):
        decode_body(body)


def _entry(adapter: str = "dense", **fields) -> ModelEntry:
    dims = {"dims": 4} if ADAPTERS[adapter].has_dims else {}
    return ModelEntry(id="m", adapter=adapter, source=Source(path="/nowhere"),
                      **dims, **fields)


def test_annotate_tolerates_garbage_items():
    entry = _entry()
    ann = annotate(ENCODE, {"model": "m", "items": [{"text": 5}, "x", {"text": "abcdefgh"}]},
                   entry)
    assert ann.items == 3 and ann.op == "encode" and ann.longest == 4
    assert annotate(ENCODE, {"model": "m", "items": "nope"}, entry).items == 0
    assert annotate(ENCODE, "not a dict", entry).items == 0


def test_annotations_are_the_entrys_estimate():
    entry = _entry("clip", max_seq_length=8, image_tokens=7)
    kwargs = {"model": "m", "items": [{"text": "x" * 400}, {"image": b"png"}],
              "options": {"lora": "adapter-a"}}
    ann = annotate(ENCODE, kwargs, entry, deadline_ms=5, sent_ms=3)
    assert (ann.items, ann.cost, ann.longest) == entry.estimate(kwargs) == (2, 8 + 7, 8)
    assert (ann.model, ann.deadline_ms, ann.sent_ms, ann.lora) == ("m", 5, 3, "adapter-a")


def test_the_task_not_the_entry_names_the_operation():
    """So the runtime can refuse a score task sent to an encode model."""
    assert annotate(SCORE, {"model": "m", "items": []}, _entry()).op == "score"


def test_a_model_without_an_entry_is_annotated_by_name_only():
    ann = annotate(ENCODE, {"model": "nobody/knows", "items": [{"text": "hi"}]}, None)
    assert (ann.model, ann.items, ann.cost, ann.longest) == ("nobody/knows", 0, 0, 0)


def test_a_request_is_the_entrys_operation_due_in_its_timeout():
    entry = _entry()
    kwargs = {"model": "m", "items": [{"text": "abcdefgh"}]}
    message = single_message(task_part(entry, kwargs, timeout_ms=2_000), "gw")
    ann = read_annotations(message.headers)
    assert message.headers["task"] == ENCODE and message.headers["id"] == message.task_id
    assert message.headers[H_REPLY_BATCH] == 1 and decode_body(message.body) == kwargs
    assert ann is not None and (ann.items, ann.cost, ann.longest) == entry.estimate(kwargs)
    assert ann.sent_ms is not None and ann.deadline_ms == int(ann.sent_ms) + 2_000
    assert H_REPLY_BATCH not in single_message(task_part(entry, kwargs, 1), "gw",
                                               reply_batch=False).headers


def test_a_bulk_jobs_part_says_so_and_a_callers_request_does_not():
    entry = _entry()
    kwargs = {"model": "m", "items": [{"text": "abcdefgh"}]}
    part = read_annotations(single_message(task_part(entry, kwargs, 1_000, bulk=True),
                                           "gw").headers)
    plain = read_annotations(single_message(task_part(entry, kwargs, 1_000), "gw").headers)
    assert part is not None and part.bulk
    assert plain is not None and not plain.bulk
    assert H_BULK not in single_message(task_part(entry, kwargs, 1_000), "gw").headers


def test_missing_annotations_read_as_none():
    assert read_annotations({"task": "shoal.encode"}) is None


def _parts() -> list[Part]:
    entry = _entry()
    first = task_part(entry, {"model": "m", "items": [{"text": "abc"}]}, 1_000)
    second = task_part(entry, {"model": "m", "items": [{"text": "x" * 40}, {"text": "y"}],
                               "options": {"lora": "a"}}, 5_000)
    return [first, Part(second.task_id, second.annotations, second.body, returns=2)]


def test_a_coalesced_message_carries_each_request_whole():
    parts = _parts()
    message = coalesce("m", "encode", parts, "gw")
    assert message.headers[H_COALESCED] == 2 and message.headers["task"] == ENCODE
    assert (message.headers[H_MODEL], message.headers[H_OP]) == ("m", "encode")
    assert message.headers[H_REPLY_BATCH] == 1
    # the message lives as long as its longest-lived request
    assert message.headers[H_DEADLINE] == max(p.annotations.deadline_ms for p in parts)
    assert message.task_id not in {p.task_id for p in parts}
    read = read_coalesced(message.headers, message.body)
    assert read == parts
    assert [decode_body(p.body)["items"][0]["text"] for p in read] == ["abc", "x" * 40]
    assert read[1].annotations.lora == "a" and read[1].returns == 2


def test_a_request_alone_is_a_plain_celery_message():
    part = _parts()[0]
    message = single_message(part, "gw", reply_batch=False)
    assert message.task_id == part.task_id == message.headers["id"]
    assert H_COALESCED not in message.headers and H_REPLY_BATCH not in message.headers
    assert read_annotations(message.headers) == part.annotations
    assert message.body == part.body


@pytest.mark.parametrize("body", [b"\xc1", msgpack.packb({"a": 1}), msgpack.packb([[1, 2]]),
                                  msgpack.packb([["id", "x", 1, 1, None, None, None, 0, b""]]),
                                  msgpack.packb([[7, 1, 1, 1, None, None, None, 0, b""]])])
def test_malformed_coalesced_messages_raise_value_error(body):
    with pytest.raises(ValueError):
        read_coalesced({H_MODEL: "m", H_OP: "encode", H_COALESCED: 1}, body)


def test_a_coalesced_message_needs_its_model_and_operation():
    message = coalesce("m", "encode", _parts(), "gw")
    with pytest.raises(ValueError, match="shoal_model"):
        read_coalesced({H_COALESCED: 2}, message.body)
