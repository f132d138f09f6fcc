"""The request schema shared by gateway and runtime: what passes, what is refused and why."""

from __future__ import annotations

import base64

import pytest

from tasks.adapters import ADAPTERS, OPERATIONS
from tasks.errors import ErrorCode, ShoalError
from tasks.options import (
    ClassifyOptions,
    EncodeOptions,
    GenerateOptions,
    option_names,
    parse_options,
)
from tasks.schema import parse_encode, parse_request

TEXT_AND_IMAGE = ADAPTERS["clip"].inputs
PNG = b"\x89PNG\r\n\x1a\nnot really"


def _refused(match: str, op: str, kwargs, **kw) -> None:
    with pytest.raises(ShoalError) as err:
        parse_request(op, kwargs, **kw)
    assert match in err.value.message
    assert err.value.code in (ErrorCode.VALIDATION_ERROR, ErrorCode.UNSUPPORTED_OPERATION)


def test_every_adapter_serves_a_known_operation():
    assert {c.operation for c in ADAPTERS.values()} == set(OPERATIONS)
    for op in OPERATIONS:
        assert option_names(op)


def test_defaults_sit_under_caller_options():
    options = parse_options("encode", {"dtype": "int8"}, {"dtype": "binary", "is_query": True})
    assert options == EncodeOptions(dtype="int8", is_query=True)
    assert parse_options("generate", None) == GenerateOptions()


@pytest.mark.parametrize("op,options,fragment", [
    ("encode", {"dtype": "float64"}, "options.dtype"),
    ("encode", {"dimensions": 0}, "options.dimensions"),
    ("encode", {"dimensions": True}, "options.dimensions"),
    ("encode", {"output": "sparse-ish"}, "options.output"),
    ("encode", {"normalize": "yes"}, "options.normalize"),
    ("encode", {"colour": 1}, "colour"),
    ("score", {"top_n": 0}, "options.top_n"),
    ("score", {"activation": "tanh"}, "options.activation"),
    ("extract", {"aggregation": "mean"}, "options.aggregation"),
    ("extract", {"threshold": 1.5}, "options.threshold"),
    ("classify", {"labels": []}, "options.labels"),
    ("classify", {"labels": ["a", "a"]}, "duplicates"),
    ("classify", {"labels": ["x"] * 65}, "limit"),
    ("classify", {"hypothesis_template": "no slot"}, "hypothesis_template"),
    ("generate", {"max_tokens": 0}, "options.max_tokens"),
    ("generate", {"temperature": -1}, "options.temperature"),
    ("generate", {"top_p": 0}, "options.top_p"),
    ("generate", {"stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
    ("generate", {"stop": [""]}, "options.stop"),
    ("generate", {"seed": -1}, "options.seed"),
    ("encode", {"lora": ""}, "options.lora"),
    ("generate", {"lora": ["a"]}, "options.lora"),
    ("score", {"lora": "a"}, "unknown options"),
    ("extract", {"lora": "a"}, "unknown options"),
    ("classify", {"lora": "a"}, "unknown options"),
])
def test_bad_options_name_the_option(op, options, fragment):
    kwargs = {"items": [{"text": "x"}], "options": options}
    if op == "score":
        kwargs["query"] = "q"
    _refused(fragment, op, kwargs)


def test_single_strings_are_accepted_for_labels_and_stop():
    assert parse_options("classify", {"labels": "urgent"}) == ClassifyOptions(labels=("urgent",))
    assert parse_options("generate", {"stop": "\n"}).stop == ("\n",)


@pytest.mark.parametrize("items,fragment", [
    (None, "non-empty list"),
    ([], "non-empty list"),
    (["text"], "items[0]"),
    ([{"text": "a", "image": b"x"}], "exactly one"),
    ([{"text": 3}], "items[0].text"),
    ([{"txt": "a"}], "unknown field 'txt'"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], "unknown field 'messages'"),
])
def test_bad_items_name_the_item(items, fragment):
    _refused(fragment, "encode", {"items": items})


def test_image_to_a_text_only_model_is_refused():
    _refused("takes text only", "encode", {"items": [{"image": PNG}]}, model="m/text")


def test_images_arrive_as_bytes_base64_or_data_url():
    b64 = base64.b64encode(PNG).decode()
    for value in (PNG, b64, f"data:image/png;base64,{b64}"):
        parsed = parse_request("encode", {"items": [{"image": value}, {"text": "t"}]},
                               TEXT_AND_IMAGE)
        assert parsed.items[0].image == PNG and parsed.items[0].kind == "image"
        assert parsed.items[1].text == "t"
    _refused("not valid base64", "encode", {"items": [{"image": "%%%"}]}, inputs=TEXT_AND_IMAGE)
    _refused("empty", "encode", {"items": [{"image": b""}]}, inputs=TEXT_AND_IMAGE)
    _refused("bytes", "encode", {"items": [{"image": 5}]}, inputs=TEXT_AND_IMAGE)


def test_score_needs_a_query_and_only_score_takes_one():
    _refused("'query' is missing", "score", {"items": [{"text": "d"}]})
    _refused("'query' is missing", "score", {"items": [{"text": "d"}], "query": ""})
    _refused("only for score", "encode", {"items": [{"text": "d"}], "query": "q"})
    assert parse_request("score", {"items": [{"text": "d"}], "query": "q"}).query == "q"


def test_generate_items_are_prompts_or_chats():
    parsed = parse_request("generate", {"items": [
        {"text": "Once upon"},
        {"messages": [{"role": "system", "content": "be brief"},
                      {"role": "user", "content": "hi"}]},
    ]})
    assert parsed.items[0].text == "Once upon"
    assert parsed.items[1].messages == (("system", "be brief"), ("user", "hi"))
    _refused("role", "generate", {"items": [{"messages": [{"role": "robot", "content": "x"}]}]})
    _refused("messages", "generate", {"items": [{"messages": []}]})


def test_dimensions_checked_against_the_model_width():
    assert parse_encode({"items": [{"text": "x"}], "options": {"dimensions": 8}}, 8)
    with pytest.raises(ShoalError, match="from 1 to 8"):
        parse_encode({"items": [{"text": "x"}], "options": {"dimensions": 9}}, 8)


def test_unknown_operation_is_unsupported():
    with pytest.raises(ShoalError) as err:
        parse_request("dance", {"items": [{"text": "x"}]})
    assert err.value.code == ErrorCode.UNSUPPORTED_OPERATION


def test_encode_and_generate_name_a_lora():
    # Which names exist is the catalog entry's to check (ModelEntry.parse).
    assert parse_options("encode", {"lora": "legal"}).lora == "legal"
    assert parse_options("generate", {"lora": "team/chat.v2"}).lora == "team/chat.v2"
    assert parse_options("encode", {"lora": None}) == EncodeOptions()
    assert EncodeOptions().lora is None and GenerateOptions().lora is None


@pytest.mark.parametrize(("op", "stream"), [("generate", "yes"), ("encode", True)])
def test_stream_is_a_boolean_for_generate_only(op, stream):
    _refused("'stream' must be true or false, and true only for generate", op,
             {"items": [{"text": "x"}], "stream": stream})


def test_a_streamed_generate_request_parses():
    assert parse_request("generate", {"items": [{"text": "x"}], "stream": True}).items
