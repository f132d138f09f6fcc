"""The token-classification adapter against transformers' NER pipeline on the same weights."""

from __future__ import annotations

import msgpack
import pytest
from transformers import pipeline

from tests.tiny_classifiers import build_tiny_ner, run, serve

TEXTS = [
    "Arnold Schwarzenegger visited the Kölnerdom in Köln, then Microsoft's HQ!",
    "Grüße aus Köln: Straße, Äpfel und Öl. 東京は雨です。 Привет, мир! 🚀",
    "Dr. Jean-Pierre O'Neill (IBM) met Angela Merkel at 10:30 a.m. in São Paulo.",
    "unbelievably unconstitutional antidisestablishmentarianism  double  spaced",
]
LONG = "Angela Merkel met Schwarzenegger in Köln. " * 40  # far past the 128-token limit
STRATEGIES = ("none", "simple", "first", "average", "max")
ARCHITECTURES = ("bert", "xlm-roberta")


@pytest.fixture(scope="module", params=ARCHITECTURES)
def ner(request, tmp_path_factory):
    """(host, model id, model directory) for a tiny tagger of each architecture."""
    path = build_tiny_ner(tmp_path_factory.mktemp("ner") / request.param, request.param)
    model_id = f"test/ner-{request.param}"
    return serve(model_id, "token-classification", path), model_id, path


def _extract(ner, texts, **options):
    host, model_id, _ = ner
    (outcome,) = run(host, model_id, "extract",
                     {"items": [{"text": t} for t in texts], "options": options})
    assert outcome.ok, outcome.error_message
    return outcome.result


def _reference(path, texts, strategy):
    tagger = pipeline("token-classification", model=str(path), tokenizer=str(path),
                      aggregation_strategy=strategy, device="cpu")
    key = "entity" if strategy == "none" else "entity_group"
    return [[(e[key], e["start"], e["end"], float(e["score"])) for e in tagger(text)]
            for text in texts]


def _assert_same(result, reference, texts):
    assert len(result["entities"]) == len(reference) == len(texts)
    for ours, theirs, text in zip(result["entities"], reference, texts, strict=True):
        assert [(e["label"], e["start"], e["end"]) for e in ours] == \
            [(label, start, end) for label, start, end, _ in theirs]
        for entity, (*_, score) in zip(ours, theirs, strict=True):
            assert entity["score"] == pytest.approx(score, abs=1e-4)
            assert entity["text"] == text[entity["start"] : entity["end"]]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_matches_the_pipeline(ner, strategy):
    texts = [*TEXTS, LONG]  # the long one truncated at 128 tokens by both
    result = _extract(ner, texts, aggregation=strategy)
    _assert_same(result, _reference(ner[2], texts, strategy), texts)
    assert any(result["entities"]), "the tiny model should find some entities"


def test_result_format(ner):
    result = _extract(ner, TEXTS[:1], aggregation="simple")
    assert set(result) >= {"entities", "usage"}
    entity = result["entities"][0][0]
    assert set(entity) == {"label", "text", "start", "end", "score"}
    assert not entity["label"].startswith(("B-", "I-"))
    assert type(entity["score"]) is float and type(entity["start"]) is int
    msgpack.packb(result)  # plain data only
    none = _extract(ner, TEXTS[:1], aggregation="none")
    assert all(e["label"].startswith(("B-", "I-")) for e in none["entities"][0])


def test_usage_counts_real_tokens(ner):
    _, _, path = ner
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    texts = [*TEXTS, LONG]
    expected = sum(min(len(ids), 128) for ids in tokenizer(texts)["input_ids"])
    assert _extract(ner, texts)["usage"] == {"tokens": expected}


def test_threshold_drops_low_scores(ner):
    everything = _extract(ner, TEXTS, aggregation="first")["entities"]
    kept = _extract(ner, TEXTS, aggregation="first", threshold=0.5)["entities"]
    assert kept == [[e for e in item if e["score"] >= 0.5] for item in everything]
    dropped = sum(map(len, everything)) - sum(map(len, kept))
    assert dropped > 0 and sum(map(len, kept)) > 0


def test_empty_text_has_no_entities(ner):
    result = _extract(ner, ["", " ", TEXTS[0]])
    assert result["entities"][:2] == [[], []] and result["entities"][2]


def test_deterministic_and_batch_independent(ner):
    host, model_id, path = ner
    together = _extract(ner, TEXTS, aggregation="average")
    assert _extract(ner, TEXTS, aggregation="average")["entities"] == together["entities"]
    outcomes = run(host, model_id, "extract",
                   *[{"items": [{"text": t}], "options": {"aggregation": "average"}}
                     for t in reversed(TEXTS)])
    alone = [o.result["entities"][0] for o in reversed(outcomes)]
    _assert_same({"entities": alone}, [[(e["label"], e["start"], e["end"], e["score"])
                                        for e in item] for item in together["entities"]], TEXTS)
    # Small chunks: every text runs in a forward pass of its own.
    chunked = serve(model_id, "token-classification", path, chunk_tokens=40)
    (outcome,) = run(chunked, model_id, "extract",
                     {"items": [{"text": t} for t in TEXTS], "options": {"aggregation": "average"}})
    _assert_same(outcome.result, [[(e["label"], e["start"], e["end"], e["score"])
                                   for e in item] for item in together["entities"]], TEXTS)


def test_too_long_without_truncation(ner):
    host, model_id, _ = ner
    too_long, fits = run(host, model_id, "extract",
                         {"items": [{"text": "hi"}, {"text": LONG}],
                          "options": {"truncate": False}},
                         {"items": [{"text": TEXTS[0]}], "options": {"truncate": False}})
    assert too_long.error_code == "INPUT_TOO_LONG"
    assert "items[1]" in too_long.error_message and "truncate" in too_long.error_message
    assert fits.ok and fits.result["batch"]["requests"] == 1


def test_bad_options_are_validation_errors(ner):
    host, model_id, _ = ner
    outcomes = run(host, model_id, "extract",
                   {"items": [{"text": "x"}], "options": {"aggregation": "longest"}},
                   {"items": [{"text": "x"}], "options": {"threshold": 2}},
                   {"items": [{"text": "x"}], "options": {"labels": ["PER"]}})
    assert [o.error_code for o in outcomes] == ["VALIDATION_ERROR"] * 3
