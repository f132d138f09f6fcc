"""Request mixes: how many texts each request carries, and how long each text is.

Real callers do not send one ten-word sentence per request: a search backend
embeds one query, an indexer sends 64 chunks, and a few documents are much
longer than the rest. The batch former plans by items and tokens, so a
benchmark that sends only uniform requests measures a case no one runs.

A distribution is a short spec, so a whole mix fits on a command line:

    1                        always 1
    uniform:1:8              an integer from 1 to 8, all equally likely
    pareto:1.2:1:64          heavy tail: bounded Pareto, shape 1.2, from 1 to 64
    lognormal:2.3:0.6:3:200  round(exp(N(2.3, 0.6))), clipped to 3..200
    choice:1,1,1,4,16        one of these, each listed value equally likely
                             (repeat a value to weight it)

Every draw is an integer >= 1. Mixes are deterministic for a seed.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

VOCABULARY = (
    "the", "a", "one", "every", "some", "small", "large", "quick", "slow", "bright", "dark", "old",
    "new", "quiet", "loud", "cat", "dog", "river", "city", "train", "book", "garden", "window",
    "teacher", "child", "market", "song", "storm", "mountain", "letter", "engine", "kitchen",
    "ocean", "bridge", "doctor", "farmer", "painter", "runs", "walks", "reads", "finds", "builds",
    "opens", "carries", "watches", "follows", "paints", "sings", "near", "under", "over", "behind",
    "beside", "through", "across", "into", "from", "with", "today", "yesterday", "slowly",
    "quickly", "often", "rarely", "again", "together", "alone",
)
SPEC_FORMS = ("N", "uniform:MIN:MAX", "pareto:SHAPE:MIN:MAX", "lognormal:MU:SIGMA:MIN:MAX",
              "choice:A,B,C...")


def _bad(spec: str, why: str) -> ValueError:
    return ValueError(f"bad distribution spec {spec!r}: {why} (forms: {', '.join(SPEC_FORMS)})")


@dataclass(frozen=True)
class Dist:
    """A parsed spec: a distribution over integers >= 1."""

    spec: str
    kind: str  # const | uniform | pareto | lognormal | choice
    params: tuple[float, ...]
    low: int
    high: int

    def sample(self, rng: random.Random) -> int:
        if self.kind == "const":
            return self.low
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        if self.kind == "choice":
            return int(rng.choice(self.params))
        if self.kind == "pareto":
            # Inverse CDF of the Pareto truncated to [low, high]: a true bounded
            # tail, not a spike of clipped draws at `high`.
            shape = self.params[0]
            ratio = (self.low / self.high) ** shape
            x = self.low / (1 - rng.random() * (1 - ratio)) ** (1 / shape)
        else:
            mu, sigma = self.params
            x = rng.lognormvariate(mu, sigma)
        return min(self.high, max(self.low, round(x)))


def _int(spec: str, text: str, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise _bad(spec, f"{what} must be an integer, got {text!r}") from None
    if value < 1:
        raise _bad(spec, f"{what} must be >= 1, got {value}")
    return value


def _float(spec: str, text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise _bad(spec, f"{what} must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise _bad(spec, f"{what} must be finite, got {text!r}")
    return value


def _bounds(spec: str, low_text: str, high_text: str) -> tuple[int, int]:
    low, high = _int(spec, low_text, "MIN"), _int(spec, high_text, "MAX")
    if low > high:
        raise _bad(spec, f"MIN {low} is greater than MAX {high}")
    return low, high


def parse_dist(spec: str) -> Dist:
    """The distribution a spec names; ValueError saying what is wrong otherwise."""
    text = spec.strip()
    if not text:
        raise _bad(spec, "empty")
    kind, _, rest = text.partition(":")
    kind = kind.lower()
    args = rest.split(":") if rest else []
    if not any(c.isalpha() for c in kind):
        if rest:
            raise _bad(spec, "a constant takes no parameters")
        value = _int(spec, kind, "the constant")
        return Dist(spec, "const", (), value, value)
    if kind == "uniform":
        if len(args) != 2:
            raise _bad(spec, "uniform takes MIN:MAX")
        low, high = _bounds(spec, *args)
        return Dist(spec, "uniform", (), low, high)
    if kind == "pareto":
        if len(args) != 3:
            raise _bad(spec, "pareto takes SHAPE:MIN:MAX")
        shape = _float(spec, args[0], "SHAPE")
        if shape <= 0:
            raise _bad(spec, f"SHAPE must be > 0, got {shape}")
        low, high = _bounds(spec, args[1], args[2])
        return Dist(spec, "pareto", (shape,), low, high)
    if kind == "lognormal":
        if len(args) != 4:
            raise _bad(spec, "lognormal takes MU:SIGMA:MIN:MAX")
        mu, sigma = _float(spec, args[0], "MU"), _float(spec, args[1], "SIGMA")
        if sigma < 0:
            raise _bad(spec, f"SIGMA must be >= 0, got {sigma}")
        low, high = _bounds(spec, args[2], args[3])
        return Dist(spec, "lognormal", (mu, sigma), low, high)
    if kind == "choice":
        values = [v.strip() for v in rest.split(",")] if rest else []
        if not values or any(not v for v in values):
            raise _bad(spec, "choice takes a comma-separated list of integers")
        choices = tuple(float(_int(spec, v, "each choice")) for v in values)
        return Dist(spec, "choice", choices, int(min(choices)), int(max(choices)))
    raise _bad(spec, f"unknown kind {kind!r}")


def make_text(rng: random.Random, words: int) -> str:
    """A sentence of exactly `words` words from the vocabulary."""
    return " ".join(rng.choice(VOCABULARY) for _ in range(words)).capitalize() + "."


def make_texts(count: int = 200, seed: int = 0) -> list[str]:
    """Deterministic short English-ish sentences of 5-15 words (the classic benchmark texts:
    one text per request)."""
    rng = random.Random(seed)
    return [make_text(rng, rng.randint(5, 15)) for _ in range(count)]


def make_requests(count: int, items_spec: str, words_spec: str,
                  seed: int = 0) -> list[list[str]]:
    """`count` requests, each a list of texts, drawn from the two distributions."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    items, words = parse_dist(items_spec), parse_dist(words_spec)
    # Separate streams: the items per request do not change when only the
    # words spec does, so two mixes differ only where their specs differ.
    items_rng, words_rng = random.Random(f"{seed}/items"), random.Random(f"{seed}/words")
    requests = []
    for _ in range(count):
        n = items.sample(items_rng)
        requests.append([make_text(words_rng, words.sample(words_rng)) for _ in range(n)])
    return requests


@dataclass(frozen=True)
class MixSummary:
    items_spec: str
    words_spec: str
    seed: int
    requests: int
    items: int
    mean_items: float
    median_items: float
    max_items: int
    mean_words: float
    median_words: float
    max_words: int


def summarize(requests: list[list[str]], items_spec: str = "", words_spec: str = "",
              seed: int = 0) -> MixSummary:
    sizes = [len(r) for r in requests]
    lengths = [len(t.split()) for r in requests for t in r]
    return MixSummary(
        items_spec=items_spec,
        words_spec=words_spec,
        seed=seed,
        requests=len(requests),
        items=sum(sizes),
        mean_items=statistics.fmean(sizes) if sizes else 0.0,
        median_items=float(statistics.median(sizes)) if sizes else 0.0,
        max_items=max(sizes, default=0),
        mean_words=statistics.fmean(lengths) if lengths else 0.0,
        median_words=float(statistics.median(lengths)) if lengths else 0.0,
        max_words=max(lengths, default=0),
    )


def describe(summary: MixSummary) -> str:
    """One line for a report."""
    return (f"items/request {summary.items_spec or '?'} (mean {summary.mean_items:.1f}, "
            f"max {summary.max_items}), words/text {summary.words_spec or '?'} "
            f"(mean {summary.mean_words:.1f}, max {summary.max_words}), "
            f"{summary.requests} distinct requests, seed {summary.seed}")
