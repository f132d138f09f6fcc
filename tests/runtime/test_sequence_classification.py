"""The classify adapters against transformers' text- and zero-shot-classification pipelines."""

from __future__ import annotations

import msgpack
import pytest
from transformers import AutoTokenizer, pipeline

from tests.tiny_classifiers import (
    NLI_LABELS,
    SENTIMENT_LABELS,
    TOPIC_LABELS,
    build_tiny_nli,
    build_tiny_sentiment,
    build_tiny_topics,
    run,
    serve,
)

TEXTS = [
    "I loved this film, the acting was wonderful.",
    "",
    "Terrible service; we waited two hours and left hungry!",
    "Grüße aus Köln: Straße, Äpfel und Öl. 東京は雨です。 🚀",
    "The match went to extra time before the home side scored. " * 20,  # over 128 tokens
]
CANDIDATES = ["sports", "politics", "cooking", "music"]
NLI_TEXTS = [t for t in TEXTS if t]  # the zero-shot pipeline refuses an empty text
SENTIMENT = "test/sentiment"
TOPICS = "test/topics"
NLI = "test/nli"


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("classify")
    return {SENTIMENT: build_tiny_sentiment(root / "sentiment"),
            TOPICS: build_tiny_topics(root / "topics"),
            NLI: build_tiny_nli(root / "nli")}


@pytest.fixture(scope="module")
def hosts(paths):
    return {SENTIMENT: serve(SENTIMENT, "sequence-classification", paths[SENTIMENT]),
            TOPICS: serve(TOPICS, "sequence-classification", paths[TOPICS]),
            NLI: serve(NLI, "zero-shot", paths[NLI])}


def _classify(hosts, model_id, texts=TEXTS, **options):
    (outcome,) = run(hosts[model_id], model_id, "classify",
                     {"items": [{"text": t} for t in texts], "options": options})
    assert outcome.ok, outcome.error_message
    return outcome.result


def _as_dicts(labels_per_item):
    return [{e["label"]: e["score"] for e in item} for item in labels_per_item]


def _assert_ranked(labels_per_item):
    for item in labels_per_item:
        scores = [e["score"] for e in item]
        assert scores == sorted(scores, reverse=True)
        assert all(type(s) is float for s in scores)


def _assert_close(ours, theirs):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert a.keys() == b.keys()
        for label in a:
            assert a[label] == pytest.approx(b[label], abs=1e-5), label


def _text_pipeline(path, texts=TEXTS, **kwargs):
    classifier = pipeline("text-classification", model=str(path), tokenizer=str(path),
                          top_k=None, device="cpu")
    return _as_dicts(classifier(texts, truncation=True, **kwargs))


# --- sequence classification -----------------------------------------------------------------


def test_sentiment_matches_the_pipeline(hosts, paths):
    result = _classify(hosts, SENTIMENT)
    _assert_ranked(result["labels"])
    ours = _as_dicts(result["labels"])
    _assert_close(ours, _text_pipeline(paths[SENTIMENT]))
    assert all(set(item) == set(SENTIMENT_LABELS) for item in ours)
    assert all(sum(item.values()) == pytest.approx(1.0, abs=1e-5) for item in ours)
    assert len({round(item["positive"], 4) for item in ours}) == len(TEXTS), \
        "the tiny model should tell texts apart"
    msgpack.packb(result)


def test_multi_label_model_uses_sigmoid(hosts, paths):
    ours = _as_dicts(_classify(hosts, TOPICS)["labels"])
    _assert_close(ours, _text_pipeline(paths[TOPICS]))
    assert all(set(item) == set(TOPIC_LABELS) for item in ours)
    assert any(abs(sum(item.values()) - 1) > 0.05 for item in ours)


def test_multi_label_option_uses_sigmoid(hosts, paths):
    ours = _as_dicts(_classify(hosts, SENTIMENT, multi_label=True)["labels"])
    _assert_close(ours, _text_pipeline(paths[SENTIMENT], function_to_apply="sigmoid"))


def test_top_k_keeps_the_best(hosts):
    full = _classify(hosts, TOPICS)["labels"]
    assert _classify(hosts, TOPICS, top_k=2)["labels"] == [item[:2] for item in full]
    assert _classify(hosts, TOPICS, top_k=10)["labels"] == full


def test_labels_are_for_zero_shot(hosts):
    outcomes = run(hosts[SENTIMENT], SENTIMENT, "classify",
                   {"items": [{"text": "x"}], "options": {"labels": ["a", "b"]}},
                   {"items": [{"text": "x"}], "options": {"hypothesis_template": "It is {}."}})
    for outcome in outcomes:
        assert outcome.error_code == "VALIDATION_ERROR"
        assert "fixed labels ['negative', 'positive']" in outcome.error_message
        assert "zero-shot" in outcome.error_message


def test_batching_and_chunking_keep_results(hosts, paths):
    together = _classify(hosts, SENTIMENT)["labels"]
    outcomes = run(hosts[SENTIMENT], SENTIMENT, "classify",
                   *[{"items": [{"text": t}]} for t in TEXTS])
    _assert_close(_as_dicts([o.result["labels"][0] for o in outcomes]), _as_dicts(together))
    chunked = serve(SENTIMENT, "sequence-classification", paths[SENTIMENT], chunk_tokens=40)
    _assert_close(_as_dicts(_classify({SENTIMENT: chunked}, SENTIMENT)["labels"]),
                  _as_dicts(together))


def test_sequence_usage_and_too_long(hosts, paths):
    tokenizer = AutoTokenizer.from_pretrained(str(paths[SENTIMENT]))
    expected = sum(len(ids) for ids in tokenizer(TEXTS, truncation=True)["input_ids"])
    assert _classify(hosts, SENTIMENT)["usage"] == {"tokens": expected}
    (outcome,) = run(hosts[SENTIMENT], SENTIMENT, "classify",
                     {"items": [{"text": t} for t in TEXTS], "options": {"truncate": False}})
    assert outcome.error_code == "INPUT_TOO_LONG" and "items[4]" in outcome.error_message


# --- zero-shot -------------------------------------------------------------------------------


def _zero_shot_pipeline(path, texts, labels, **kwargs):
    classifier = pipeline("zero-shot-classification", model=str(path), tokenizer=str(path),
                          device="cpu")
    out = classifier(texts, candidate_labels=labels, **kwargs)
    return [dict(zip(r["labels"], r["scores"], strict=True)) for r in out]


@pytest.mark.parametrize("multi_label", [False, True])
@pytest.mark.parametrize("template", [None, "The topic of this text is {}."])
def test_zero_shot_matches_the_pipeline(hosts, paths, multi_label, template):
    options = {"labels": CANDIDATES, "multi_label": multi_label}
    reference = {"multi_label": multi_label}
    if template is not None:
        options["hypothesis_template"] = reference["hypothesis_template"] = template
    result = _classify(hosts, NLI, NLI_TEXTS, **options)
    _assert_ranked(result["labels"])
    ours = _as_dicts(result["labels"])
    _assert_close(ours, _zero_shot_pipeline(paths[NLI], NLI_TEXTS, CANDIDATES, **reference))
    if not multi_label:
        assert all(sum(item.values()) == pytest.approx(1.0, abs=1e-5) for item in ours)
    assert len({round(item["sports"], 4) for item in ours}) > 1
    msgpack.packb(result)


def test_zero_shot_one_label_is_scored_on_its_own(hosts, paths):
    ours = _as_dicts(_classify(hosts, NLI, NLI_TEXTS, labels=["sports"])["labels"])
    _assert_close(ours, _zero_shot_pipeline(paths[NLI], NLI_TEXTS, ["sports"]))
    assert all(item["sports"] < 1.0 for item in ours)


def test_zero_shot_top_k_and_empty_text(hosts):
    full = _classify(hosts, NLI, labels=CANDIDATES)["labels"]
    assert _classify(hosts, NLI, labels=CANDIDATES, top_k=1)["labels"] == \
        [item[:1] for item in full]
    assert len(full[TEXTS.index("")]) == len(CANDIDATES)


def test_zero_shot_needs_labels(hosts):
    (outcome,) = run(hosts[NLI], NLI, "classify", {"items": [{"text": "x"}]})
    assert outcome.error_code == "VALIDATION_ERROR"
    assert outcome.error_message.startswith("options.labels is missing")


def test_zero_shot_needs_an_entailment_label(paths):
    with pytest.raises(ValueError, match="entailment"):
        serve("test/not-nli", "zero-shot", paths[SENTIMENT])


def test_zero_shot_two_way_nli(tmp_path):
    path = build_tiny_nli(tmp_path / "two-way", labels=("entailment", "not_entailment"))
    host = serve("test/nli-2", "zero-shot", path)
    for multi_label in (False, True):
        (outcome,) = run(host, "test/nli-2", "classify",
                         {"items": [{"text": t} for t in NLI_TEXTS],
                          "options": {"labels": CANDIDATES, "multi_label": multi_label}})
        _assert_close(_as_dicts(outcome.result["labels"]),
                      _zero_shot_pipeline(path, NLI_TEXTS, CANDIDATES, multi_label=multi_label))


def test_zero_shot_labels_run_as_one_batch(hosts, paths):
    """Every text x label pair is one sequence of the batch, counted in usage, and the
    pairs of several requests run together give what each gives alone."""
    texts = TEXTS[:3]
    result = _classify(hosts, NLI, texts, labels=CANDIDATES)
    tokenizer = AutoTokenizer.from_pretrained(str(paths[NLI]))
    pairs = tokenizer([t for t in texts for _ in CANDIDATES],
                      [f"This example is {label}." for label in CANDIDATES] * len(texts),
                      truncation="only_first", max_length=128)
    assert result["usage"] == {"tokens": sum(map(len, pairs["input_ids"]))}
    outcomes = run(hosts[NLI], NLI, "classify",
                   {"items": [{"text": texts[0]}], "options": {"labels": CANDIDATES}},
                   {"items": [{"text": t} for t in texts[1:]],
                    "options": {"labels": CANDIDATES[:2], "multi_label": True}},
                   {"items": [{"text": t} for t in texts[1:]], "options": {"labels": CANDIDATES}})
    batch = outcomes[0].result["batch"]
    assert (batch["requests"], batch["items"]) == (3, 5)
    _assert_close(_as_dicts(outcomes[0].result["labels"] + outcomes[2].result["labels"]),
                  _as_dicts(result["labels"]))
    alone = _classify(hosts, NLI, texts[1:], labels=CANDIDATES[:2], multi_label=True)
    _assert_close(_as_dicts(outcomes[1].result["labels"]), _as_dicts(alone["labels"]))
    chunked = serve(NLI, "zero-shot", paths[NLI], chunk_tokens=64)
    _assert_close(_as_dicts(_classify({NLI: chunked}, NLI, texts, labels=CANDIDATES)["labels"]),
                  _as_dicts(result["labels"]))


def test_zero_shot_lengths(hosts):
    (outcome,) = run(hosts[NLI], NLI, "classify",
                     {"items": [{"text": t} for t in TEXTS],
                      "options": {"labels": CANDIDATES, "truncate": False}})
    assert outcome.error_code == "INPUT_TOO_LONG" and "items[4]" in outcome.error_message
    (outcome,) = run(hosts[NLI], NLI, "classify",
                     {"items": [{"text": "x"}], "options": {"labels": ["ok", "word " * 200]}})
    assert outcome.error_code == "INPUT_TOO_LONG" and "options.labels[1]" in outcome.error_message


def test_nli_labels_are_read_from_the_config(hosts):
    adapter = hosts[NLI].adapter(NLI)
    assert (adapter.entailment, adapter.contradiction) == \
        (NLI_LABELS.index("entailment"), NLI_LABELS.index("contradiction"))
