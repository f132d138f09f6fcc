"""bench.pool's traffic, pure: popularity, tiers, the split, the running order, and each
round's arrivals (steady, with a popularity ranking that rotates, or with a burst of one
cold model)."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from app.tuning.mix import make_requests

# Twelve models the sim serves with one operation (encode, dense vectors), most popular
# first by default; `--models` picks others.
MODELS = (
    "sentence-transformers/all-MiniLM-L6-v2",
    "BAAI/bge-small-en-v1.5",
    "intfloat/e5-small-v2",
    "thenlper/gte-small",
    "Snowflake/snowflake-arctic-embed-s",
    "intfloat/multilingual-e5-small",
    "sentence-transformers/paraphrase-multilingual-MiniLM-L12-v2",
    "sentence-transformers/all-mpnet-base-v2",
    "BAAI/bge-base-en-v1.5",
    "mixedbread-ai/mxbai-embed-large-v1",
    "BAAI/bge-m3",
    "openai/clip-vit-base-patch32",
)
# Popularity tiers by rank (1-based, inclusive).
TIERS = (("head", 1, 2), ("torso", 3, 6), ("tail", 7, 12))


def zipf_weights(n: int, s: float) -> list[float]:
    """Popularity of ranks 1..n under Zipf(s): proportional to 1/k^s, summing to 1."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not (s >= 0 and math.isfinite(s)):
        raise ValueError(f"s must be a finite number >= 0, got {s}")
    raw = [1 / k**s for k in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def tier_of(rank: int, tiers: Sequence[tuple[str, int, int]] = TIERS) -> str:
    """The tier of a 1-based popularity rank."""
    for name, first, last in tiers:
        if first <= rank <= last:
            return name
    raise ValueError(f"rank {rank} is in no tier of {tiers}")


def tier_shares(weights: Sequence[float],
                tiers: Sequence[tuple[str, int, int]] = TIERS) -> dict[str, float]:
    """The share of the traffic each tier gets."""
    return {name: sum(weights[first - 1:last]) for name, first, last in tiers}


def split_models(weights: Sequence[float], mode: str = "balanced") -> tuple[list[int], list[int]]:
    """Two equal halves of the ranks (0-based indices): `contiguous` (the first half, the
    rest), or `balanced`: the halves whose busier one gets the least traffic (exhaustive;
    ties: the first found, which holds index 0)."""
    n = len(weights)
    if n < 2 or n % 2:
        raise ValueError(f"an even number of models >= 2 is needed, got {n}")
    everything = list(range(n))
    if mode == "contiguous":
        return everything[:n // 2], everything[n // 2:]
    if mode != "balanced":
        raise ValueError(f"mode must be 'balanced' or 'contiguous', got {mode!r}")
    total = sum(weights)
    best: tuple[float, list[int]] | None = None
    for rest in itertools.combinations(everything[1:], n // 2 - 1):
        first = [0, *rest]
        share = sum(weights[i] for i in first)
        worst = max(share, total - share)
        if best is None or worst < best[0] - 1e-12:
            best = (worst, first)
    assert best is not None
    first = best[1]
    return first, [i for i in everything if i not in first]


def schedule(rounds: int, names: Sequence[str]) -> list[tuple[int, str]]:
    """(round, deployment) in running order: each round rotates the order by one, so no
    deployment always runs first (after the machine idled) or last."""
    out = []
    for r in range(rounds):
        shift = r % len(names)
        out += [(r, name) for name in [*names[shift:], *names[:shift]]]
    return out


# --- popularity that moves -------------------------------------------------------------------


@dataclass(frozen=True)
class Rotation:
    """The ranking rotates every `every` s from `first` s on (offsets from the run's
    start): after j rotations, rank r's traffic goes to the model that was rank
    r + j * `step` at first (wrapping around)."""

    first: float
    every: float
    step: int

    def __post_init__(self) -> None:
        if not self.every > 0:
            raise ValueError(f"every must be > 0, got {self.every}")

    def count(self, offset: float) -> int:
        """How many rotations happened by `offset` s."""
        return 0 if offset < self.first else 1 + int((offset - self.first) // self.every)

    def model(self, rank: int, offset: float, n: int) -> int:
        """The model (0-based index into the first ranking) that rank `rank` means at
        `offset` s."""
        return (rank - 1 + self.count(offset) * self.step) % n

    def times(self, until: float) -> list[float]:
        """The offsets of the rotations before `until`."""
        out, at = [], self.first
        while at < until:
            out.append(at)
            at += self.every
        return out


@dataclass(frozen=True)
class Burst:
    """Extra Poisson arrivals at `rate` per second for the model of rank `rank`, from
    `start` s for `seconds` s (offsets from the run's start)."""

    rank: int
    rate: float
    start: float
    seconds: float

    @property
    def end(self) -> float:
        return self.start + self.seconds

    def during(self, offset: float) -> bool:
        return self.start <= offset < self.end


def middle_burst(rank: int, rate: float, seconds: float, warmup: float,
                 duration: float) -> Burst:
    """A burst of `seconds` centred in the window [warmup, warmup + duration)."""
    if not 0 < seconds < duration:
        raise ValueError(f"the burst ({seconds} s) must fit in the window ({duration} s)")
    return Burst(rank, rate, warmup + (duration - seconds) / 2, seconds)


@dataclass
class Plan:
    """One round's arrivals: offsets from the start (s), popularity ranks, the models
    (0-based indices into the first ranking) they mean, texts, and which are a burst's."""

    offsets: list[float]
    ranks: list[int]
    texts: list[list[str]]
    models: list[int] | None = None
    burst: list[bool] | None = None

    def model(self, i: int) -> int:
        return self.ranks[i] - 1 if self.models is None else self.models[i]

    def is_burst(self, i: int) -> bool:
        return bool(self.burst and self.burst[i])


def _poisson(rng: random.Random, rate: float, start: float, end: float) -> list[float]:
    offsets, at = [], start
    while (at := at + rng.expovariate(rate)) < end:
        offsets.append(at)
    return offsets


def make_plan(rate: float, seconds: float, weights: Sequence[float], seed: int,
              items: str = "uniform:1:4", words: str = "uniform:5:15",
              rotation: Rotation | None = None, burst: Burst | None = None) -> Plan:
    """Poisson arrivals at `rate` per second over `seconds`, each for a model drawn by
    `weights` (rank = index + 1), with its texts; with `rotation`, a rank's model moves at
    each rotation; with `burst`, its arrivals are merged in (the steady ones are the same
    as without). The same seed gives the same plan."""
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate must be > 0, got {rate}")
    arrivals = random.Random(f"{seed}/arrivals")
    picks = random.Random(f"{seed}/models")
    offsets = _poisson(arrivals, rate, 0.0, seconds)
    ranks = [r + 1 for r in picks.choices(range(len(weights)), weights, k=len(offsets))]
    flags = [False] * len(offsets)
    if burst is not None:
        extra = _poisson(random.Random(f"{seed}/burst"), burst.rate, burst.start,
                         min(burst.end, seconds))
        merged = sorted([(o, r, False) for o, r in zip(offsets, ranks, strict=True)]
                        + [(o, burst.rank, True) for o in extra])
        offsets = [m[0] for m in merged]
        ranks = [m[1] for m in merged]
        flags = [m[2] for m in merged]
    pool = make_requests(max(1, min(len(offsets), 4000)), items, words, seed=seed)
    n = len(weights)
    models = None if rotation is None else [rotation.model(r, o, n)
                                            for r, o in zip(ranks, offsets, strict=True)]
    return Plan(offsets, ranks, [pool[i % len(pool)] for i in range(len(offsets))], models,
                flags if burst is not None else None)
