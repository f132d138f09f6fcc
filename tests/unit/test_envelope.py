import msgpack
import pytest

from tasks.envelope import (
    Annotations,
    annotate,
    decode_body,
    read_annotations,
    task_body,
    task_headers,
)
from tasks.names import ENCODE


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


def test_annotate_tolerates_garbage_items():
    ann = annotate(ENCODE, {"model": "m", "items": [{"text": 5}, "x", {"text": "abcdefgh"}]})
    assert ann.items == 3 and ann.op == "encode" and ann.longest == 4
    assert annotate(ENCODE, {"model": "m", "items": "nope"}).items == 0


def test_missing_annotations_read_as_none():
    assert read_annotations({"task": "shoal.encode"}) is None
