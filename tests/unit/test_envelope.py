import msgpack
import pytest

from app.catalog import ModelEntry, Source
from tasks.adapters import ADAPTERS
from tasks.envelope import (
    H_REPLY_BATCH,
    Annotations,
    annotate,
    decode_body,
    read_annotations,
    task_body,
    task_headers,
    task_message,
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


def test_task_message_is_the_entrys_operation_due_in_its_timeout():
    entry = _entry()
    kwargs = {"model": "m", "items": [{"text": "abcdefgh"}]}
    message = task_message(entry, kwargs, "gw", timeout_ms=2_000)
    ann = read_annotations(message.headers)
    assert message.headers["task"] == ENCODE and message.headers["id"] == message.task_id
    assert message.headers[H_REPLY_BATCH] == 1 and decode_body(message.body) == kwargs
    assert ann is not None and (ann.items, ann.cost, ann.longest) == entry.estimate(kwargs)
    assert ann.sent_ms is not None and ann.deadline_ms == ann.sent_ms + 2_000
    assert H_REPLY_BATCH not in task_message(entry, kwargs, "gw", 1, reply_batch=False).headers


def test_missing_annotations_read_as_none():
    assert read_annotations({"task": "shoal.encode"}) is None
