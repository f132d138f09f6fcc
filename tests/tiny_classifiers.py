"""Tiny randomly initialised classifiers of real architectures, saved like a user's model.

Rerankers, NER taggers, sentiment, multi-label topic and NLI models, loaded
back through `from_pretrained` by the adapters and by the reference libraries
(transformers pipelines, sentence-transformers) the tests compare them with;
`serve` puts one behind a ModelHost. They borrow the MiniLM tokenizer so
nothing is downloaded. A random model at the usual initialisation gives every
input nearly the same scores, which would make any comparison pass, so they
are made to tell inputs apart: sequence classifiers start from wider random
weights, taggers get their classifier scaled up (which keeps the tags mixed,
so NER finds entities of every type and some "O").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    BertForTokenClassification,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    XLMRobertaConfig,
    XLMRobertaForTokenClassification,
)

from runtimes.base import Outcome, Request
from runtimes.child_side.host import ModelHost
from tasks.catalog import ModelEntry
from tests.tiny_models import MINILM_DIR

NER_LABELS = ("O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC")
NLI_LABELS = ("contradiction", "neutral", "entailment")
SENTIMENT_LABELS = ("negative", "positive")
TOPIC_LABELS = ("sports", "politics", "science", "music")
MAX_POSITIONS = 128
SEQUENCE_INIT_RANGE = 0.2  # transformers' default 0.02 hardly tells one text from another
TAGGER_SHARPEN = 20.0

_SIZE = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
         "intermediate_size": 37}


def _tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(MINILM_DIR))


def _label_maps(labels: tuple[str, ...]) -> dict[str, dict]:
    return {"id2label": dict(enumerate(labels)),
            "label2id": {label: i for i, label in enumerate(labels)}}


def _save(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out: Path,
          sharpen: float = 1.0) -> Path:
    # The reference pipelines truncate at the tokenizer's limit, not the model's.
    tokenizer.model_max_length = MAX_POSITIONS
    with torch.no_grad():
        model.classifier.weight.mul_(sharpen)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_tiny_bert_classifier(out: Path, labels: tuple[str, ...], seed: int = 0,
                               problem_type: str | None = None) -> Path:
    """A BERT sequence classifier (reranker with one label, sentiment, NLI, topics)."""
    tokenizer = _tokenizer()
    config = BertConfig(vocab_size=tokenizer.vocab_size, max_position_embeddings=MAX_POSITIONS,
                        problem_type=problem_type, initializer_range=SEQUENCE_INIT_RANGE,
                        **_SIZE, **_label_maps(labels))
    torch.manual_seed(seed)
    return _save(BertForSequenceClassification(config), tokenizer, out)


def build_tiny_cross_encoder(out: Path, num_labels: int = 1, seed: int = 0) -> Path:
    """A reranker: one relevance logit, or several classes whose last is 'relevant'."""
    labels = ("LABEL_0",) if num_labels == 1 else tuple(f"LABEL_{i}" for i in range(num_labels))
    return build_tiny_bert_classifier(out, labels, seed=seed)


def build_tiny_sentiment(out: Path, seed: int = 0) -> Path:
    return build_tiny_bert_classifier(out, SENTIMENT_LABELS, seed=seed)


def build_tiny_topics(out: Path, seed: int = 0) -> Path:
    """Multi-label: each topic scored on its own (sigmoid)."""
    return build_tiny_bert_classifier(out, TOPIC_LABELS, seed=seed,
                                      problem_type="multi_label_classification")


def build_tiny_nli(out: Path, labels: tuple[str, ...] = NLI_LABELS, seed: int = 0) -> Path:
    return build_tiny_bert_classifier(out, labels, seed=seed)


def build_tiny_ner(out: Path, architecture: str = "bert", seed: int = 0) -> Path:
    """A BIO tagger over NER_LABELS: BERT, or an XLM-RoBERTa model.

    XLM-R's own tokenizer needs its sentencepiece files, so the XLM-R model gets
    the BERT tokenizer and a vocabulary of its size; the modelling code is XLM-R's
    (positions counted after the padding id, no token types).
    """
    tokenizer = _tokenizer()
    if architecture == "bert":
        config = BertConfig(vocab_size=tokenizer.vocab_size,
                            max_position_embeddings=MAX_POSITIONS, **_SIZE,
                            **_label_maps(NER_LABELS))
        torch.manual_seed(seed)
        model: PreTrainedModel = BertForTokenClassification(config)
    elif architecture == "xlm-roberta":
        # XLM-R positions start after the padding id, so it needs more of them than
        # the tokens it reads (the tokenizer's limit stays MAX_POSITIONS).
        config = XLMRobertaConfig(vocab_size=tokenizer.vocab_size,
                                  max_position_embeddings=MAX_POSITIONS + 2, type_vocab_size=1,
                                  pad_token_id=tokenizer.pad_token_id, **_SIZE,
                                  **_label_maps(NER_LABELS))
        torch.manual_seed(seed)
        model = XLMRobertaForTokenClassification(config)
    else:
        raise ValueError(f"unknown architecture {architecture!r}")
    return _save(model, tokenizer, out, sharpen=TAGGER_SHARPEN)


def serve(model_id: str, adapter: str, path: Path, chunk_tokens: int = 16_384,
          precision: str | None = None, engine: str = "pytorch", **entry: Any) -> ModelHost:
    """A host serving the model at `path` as a catalog entry with that adapter (in
    `precision` if given, else the entry's default: fp32 on CPU), on PyTorch or ONNX
    Runtime (`engine`)."""
    host = ModelHost(chunk_tokens=chunk_tokens, precision=precision, engine=engine)
    host.load([ModelEntry.model_validate(
        {"id": model_id, "adapter": adapter, "source": {"path": str(path)}, **entry})])
    return host


def run(host: ModelHost, model_id: str, op: str, *kwargs_list: dict[str, Any]) -> list[Outcome]:
    """One batch with a request per kwargs, each given `model`."""
    requests = [Request(str(i), op, {"model": model_id, **kwargs})
                for i, kwargs in enumerate(kwargs_list)]
    return host.run_batch(model_id, requests)
