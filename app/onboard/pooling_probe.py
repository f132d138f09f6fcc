"""Which pooling the weights were trained with, asked of the weights themselves.

Parity proves shoal computes what the reference library computes from the same files;
it cannot notice files that lie (a fine-tune trained with CLS pooling, saved with the
base model's mean-pooling config): both sides then compute the same wrong vectors. A
trained embedder pairs paraphrases it has never seen far better with the pooling it was
trained with, so the probe embeds short paraphrase pairs with little word overlap under
each pooling and scores how often a text's nearest neighbour among the second halves is
its own paraphrase.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# Paraphrases sharing few words, so that token overlap alone does not pair them.
PAIRS: tuple[tuple[str, str], ...] = (
    ("the car would not start this morning", "my vehicle failed to turn on at dawn"),
    ("she is learning to play the violin", "a woman takes lessons on a string instrument"),
    ("heavy rain flooded the streets", "downpours left roads under water"),
    ("the shop closes at nine", "the store shuts its doors at 9 pm"),
    ("he forgot his keys at home", "the man left the house without them, locked out"),
    ("prices went up again last month", "inflation rose once more recently"),
    ("the child fell asleep on the sofa", "a kid dozed off on the couch"),
    ("our flight was delayed for hours", "the plane departed very late"),
    ("please send me the report by friday", "I need that document before the weekend"),
    ("the team won the final match", "they were victorious in the championship game"),
    ("this soup is far too salty", "the broth has too much seasoning"),
    ("the printer is out of paper", "no sheets are left in the copier"),
)

# A stated pooling is doubted only when another pairs this much better.
MARGIN = 0.25


def pairing_accuracy(first: np.ndarray, second: np.ndarray) -> float:
    """Fraction of rows of `first` whose most cosine-similar row of `second` is their own."""
    a = first / np.linalg.norm(first, axis=1, keepdims=True).clip(1e-12)
    b = second / np.linalg.norm(second, axis=1, keepdims=True).clip(1e-12)
    nearest = (a @ b.T).argmax(axis=1)
    return float((nearest == np.arange(len(a))).mean())


def score_poolings(fields: dict[str, Any], poolings: list[str]) -> dict[str, float]:
    """Pairing accuracy of shoal's dense adapter under each pooling (fp32, PyTorch)."""
    from runtimes.base import Request
    from runtimes.child_side.host import ModelHost
    from tasks.catalog import ModelEntry

    scores: dict[str, float] = {}
    texts = [p[0] for p in PAIRS] + [p[1] for p in PAIRS]
    for pooling in poolings:
        entry = ModelEntry.model_validate({**fields, "pooling": pooling})
        host = ModelHost(precision="fp32")
        try:
            host.load([entry])
            (outcome,) = host.run_batch(entry.id, [Request("probe", "encode", {
                "model": entry.id, "items": [{"text": t} for t in texts]})])
        finally:
            host.close()
        if not outcome.ok:
            raise RuntimeError(f"the pooling probe failed: {outcome.error}")
        vectors = np.frombuffer(outcome.result["embeddings"], "<f4").reshape(
            outcome.result["count"], outcome.result["dims"])
        scores[pooling] = pairing_accuracy(vectors[:len(PAIRS)], vectors[len(PAIRS):])
    return scores


def doubted(stated: str, scores: dict[str, float]) -> str | None:
    """The pooling that pairs clearly better than the stated one, if any."""
    best = max(scores, key=lambda p: scores[p])
    if best != stated and scores[best] - scores[stated] >= MARGIN:
        return best
    return None
