"""Token-id items (`{"tokens": [...]}`): the contract (which models take them, which ids
pass), their cost, OpenAI's `input` shapes, and how a runtime fits them to a length limit."""

from __future__ import annotations

import pytest

from gateway.calls.openai_input import openai_input_items
from runtimes.families.token_ids import Vocabulary, encode_inputs, vocabulary
from tasks.adapters import ADAPTERS, TEXT
from tasks.catalog import TOKEN_ADAPTERS, ModelEntry, Source
from tasks.errors import ErrorCode, ShoalError
from tasks.schema import MAX_TOKEN_ID, Item, parse_items, parse_request
from tasks.token_estimate import estimate_request

TEXT_ONLY = frozenset({TEXT})


def _entry(adapter: str) -> ModelEntry:
    dims = 8 if ADAPTERS[adapter].has_dims else None
    return ModelEntry(id=f"test/{adapter}", adapter=adapter, source=Source(path="/nowhere"),
                      dims=dims)


def _message(call, *args, **kwargs) -> str:
    with pytest.raises(ShoalError) as err:
        call(*args, **kwargs)
    assert err.value.code == ErrorCode.VALIDATION_ERROR
    return err.value.message


def test_a_tokens_item_is_its_ids_beside_texts():
    items = parse_items([{"text": "hi"}, {"tokens": [101, 7592, 102]}], TEXT_ONLY,
                        tokens=True)
    assert items == [Item(text="hi"), Item(tokens=(101, 7592, 102))]


@pytest.mark.parametrize("ids,fragment", [
    ([], "items[0].tokens must be a non-empty list"),
    ("101", "items[0].tokens must be a non-empty list"),
    ([101, True], "items[0].tokens[1] is True"),
    ([101, 1.0], "items[0].tokens[1] is 1.0"),
    ([101, -1], "items[0].tokens[1] is -1"),
    ([MAX_TOKEN_ID + 1], f"integer from 0 to {MAX_TOKEN_ID}"),
])
def test_bad_ids_name_the_item_and_the_id(ids, fragment):
    assert fragment in _message(parse_items, [{"tokens": ids}], TEXT_ONLY, tokens=True)


def test_only_dense_embedders_and_causal_lms_take_token_ids():
    for adapter in ADAPTERS:
        entry = _entry(adapter)
        kwargs = {"items": [{"tokens": [1, 2]}], "query": "q",
                  "options": {"labels": ["a"]} if adapter == "zero-shot" else {}}
        if entry.operation != "score":
            kwargs.pop("query")
        if adapter in TOKEN_ADAPTERS:
            assert entry.parse(kwargs).items == [Item(tokens=(1, 2))]
        else:
            message = _message(entry.parse, kwargs)
            assert "token-id input is for dense embeddings and completions" in message
            assert "items[0]" in message and entry.id in message
    # Without the model's word, the contract takes none.
    assert "does not take them" in _message(parse_request, "encode",
                                            {"items": [{"tokens": [1]}]})


def test_a_tokens_item_costs_its_ids_capped_at_the_limit():
    kwargs = {"items": [{"tokens": [1] * 3}, {"tokens": [1] * 1000}]}
    assert estimate_request("encode", kwargs, 512) == (2, 3 + 512, 512)
    kwargs = {"items": [{"tokens": [1] * 7}], "options": {"max_tokens": 5}}
    assert estimate_request("generate", kwargs, 512) == (1, 12, 12)
    assert _entry("dense").estimate({"items": [{"tokens": [5, 6]}]}) == (1, 2, 2)


class TestOpenAIInput:
    def test_strings_are_text_items(self):
        assert openai_input_items("hi") == [{"text": "hi"}]
        assert openai_input_items(["a", "b"]) == [{"text": "a"}, {"text": "b"}]

    def test_ids_are_one_tokens_item_and_lists_of_ids_one_each(self):
        assert openai_input_items([101, 102]) == [{"tokens": [101, 102]}]
        assert openai_input_items([[101], [7, 8]]) == [{"tokens": [101]}, {"tokens": [7, 8]}]

    @pytest.mark.parametrize("value,fragment", [
        ("", "'input' is an empty string"),
        (["a", ""], "input[1] is an empty string"),
        ([], "'input' is an empty list"),
        ([[1], []], "input[1] must be a non-empty list of token ids"),
        ([1, -2], "input[1] is -2"),
        ([[1], [2, False]], "input[1][1] is False"),
        (["a", [1]], "input[1] is not a string"),
        ([[1], "a"], "input[1] must be a non-empty list of token ids"),
        ([1, "a"], "input[1] is 'a'"),
        (5, "'input' must be a string, a list of strings, a list of token ids"),
        (None, "'input' must be"),
    ])
    def test_what_openai_refuses_is_refused_by_index(self, value, fragment):
        assert fragment in _message(openai_input_items, value)

    def test_the_field_is_named(self):
        assert "prompt[0]" in _message(openai_input_items, [[]], "prompt")


BERT = Vocabulary(100, prefix=(1,), suffix=(2,))


class TestFit:
    def test_short_ids_are_kept(self):
        assert BERT.fit((1, 5, 6, 2), 4) == [1, 5, 6, 2]

    def test_long_ids_keep_the_special_ids_around_them(self):
        assert BERT.fit((1, 5, 6, 7, 8, 2), 4) == [1, 5, 6, 2]

    def test_left_truncating_tokenizers_keep_the_end(self):
        left = Vocabulary(100, prefix=(1,), suffix=(2,), left=True)
        assert left.fit((1, 5, 6, 7, 8, 2), 4) == [1, 7, 8, 2]

    def test_ids_without_the_special_ids_are_cut_plainly(self):
        assert BERT.fit((5, 6, 7, 8, 9), 3) == [5, 6, 7]
        assert Vocabulary(100, (), (3,)).fit((5, 6, 7, 3), 3) == [5, 6, 3]

    def test_out_of_vocabulary_ids_name_item_id_and_range(self):
        message = _message(BERT.check, [Item(text="x"), Item(tokens=(1, 100, 2))], "m")
        assert message == ("items[1] has token id 100, but m's vocabulary has 100 ids "
                           "(0-99): send ids from this model's own tokenizer, or send text")
        BERT.check([Item(tokens=(1, 99, 2)), Item(tokens=(1, 2))], "m")

    def test_ids_without_the_tokenizers_special_ids_are_refused(self):
        framed = Vocabulary(100, (1,), (2,), frame="start with [CLS] (1) and end with [SEP] (2)")
        for ids in ((5, 6), (1, 5), (5, 2), (1,)):
            message = _message(framed.check, [Item(tokens=ids)], "m")
            assert message.startswith("items[0] does not start with [CLS] (1) and end with "
                                      "[SEP] (2), as m's tokenizer puts them around every text")
            assert "check_embedding_ctx_length=False" in message
        Vocabulary(100, (), ()).check([Item(tokens=(5,))], "m")  # a tokenizer that adds none


def test_bert_tokenizer_ids_fit_as_the_tokenizer_truncates():
    from transformers import AutoTokenizer

    from tests.tiny_models import MINILM_DIR

    tokenizer = AutoTokenizer.from_pretrained(str(MINILM_DIR))
    vocab = vocabulary(tokenizer)
    assert (vocab.size, vocab.prefix, vocab.suffix) == (30522, (101,), (102,))
    assert vocab.frame == "start with [CLS] (101) and end with [SEP] (102)"
    text = "many words here " * 100
    full = tokenizer(text)["input_ids"]
    cut = tokenizer(text, truncation=True, max_length=64)["input_ids"]
    assert len(full) > 64 and vocab.fit(full, 64) == cut
    ids, types = encode_inputs(tokenizer, ["hello", tuple(full)], 64, vocab)
    assert ids == [tokenizer("hello")["input_ids"], cut]
    assert types == [[0] * 3, [0] * 64]
