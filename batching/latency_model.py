"""A batch latency model: how long a runtime will take for a batch of a given shape.

The former uses it to keep batches under a latency target, and the hold
logic uses it to decide how much work a worker should keep (everything else
goes back to the queue for an idler worker).

Model: latency = a + b*T + c*T*L, where T is the tokens the runtime computes
(items x longest when it pads, real tokens when it does not) and L is the
longest item: a fixed per-batch overhead, a per-token cost, and the part of
attention that grows with sequence length.

Fitting (`CostModel.observe`) is an exponentially forgetting weighted least
squares, kept recursively as decayed sufficient statistics (3x3 Gram matrix,
moment vector, sample weight), with three safeguards:

- errors are relative (each sample is divided by the current prediction), so
  a 5 ms batch counts as much as a 2 s one and the fixed overhead `a` is
  learnt as well as the slopes; a sample missing the prediction by more than
  `_HUBER_K` (relative) gets its weight cut so its pull is no larger than
  such a miss (Huber weights), so one stall (a first CUDA call, a GC pause)
  cannot blow the model up. It keeps its true value, only lighter, so when
  the seed itself is far off (a device much slower than tuned for) the early
  samples agree with the later ones and the model converges quickly;
- the catalog's seed is a ridge prior worth `prior_weight` samples; a miss
  is blamed on the terms in proportion to their share of the seed's
  prediction (so one slow big batch scales the model rather than inflating
  the fixed overhead). The prior decays with the data but never below
  `prior_weight * (1 - forgetting)`, which keeps the system well posed when
  every batch has the same shape (the classic RLS "wind-up") while biasing a
  converged fit by a few percent at most;
- the coefficients are constrained to be non-negative (an exact 3-variable
  NNLS), so predictions are never negative and grow with every dimension,
  which the former relies on when it drops a request that does not fit.

A catalog profile is measured on one device; the worker may run on a slower
or faster one (another GPU, a loaded host, a simulated device), and a prior
worth ten samples, fitted through Huber weights, would need dozens of batches
to learn a device 5x slower, all of them predicted far too short (and a
worker that under-predicts keeps work its peers could run). So the prior's
*level* is learnt at once: the seed's terms keep their proportions, scaled by
the median ratio of measured to seeded time over the last `_LEVEL_WINDOW`
batches, from the `_LEVEL_MIN`-th batch on (a median, so one stall among them
moves nothing). After a handful of batches the model predicts the device, and
the least squares then learn where its proportions differ from the seed's.

What the model has not measured it may only guess, and a guess must never turn
a servable request away. A fit over tiny batches can put the noise of their
times on the attention term and extrapolate it a thousandfold (a cold start's
slow first batches once predicted 37 s for a 256-token text that takes 200 ms).
So the model remembers the shapes it measured (`_MEASURED_WINDOW` of them, and
the largest tokens and tokens x longest it ever saw):

- `predict` for a shape beyond what was measured (more than `_REACH` times the
  largest tokens or tokens x longest) is capped at `_EXTRAPOLATION_BOUND` times
  the level-scaled seed, the seed's own proportions being the only evidence;
- `admission` is what a refusal may rely on: the prediction when at least
  `_BACKING_MIN` recent batches of a comparable shape (tokens and tokens x
  longest each within `_REACH`) back it, else the lesser of the prediction and
  the catalog's seed. A request the seed expects to fit is run, and its
  measurement teaches the model.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from itertools import combinations

from batching.shapes import BatchShape

# BatchShape: what `predict` and `observe` take
__all__ = ["Admission", "BatchShape", "CostModel"]

_HUBER_K = 3.0  # relative misses beyond this (a batch 4x slower than predicted) are down-weighted
_SHARE_FLOOR = 0.1  # the least prior variance a term gets, as a share of the total
_MIN_WEIGHT = 1e-6  # samples that would weigh less than this are ignored
_TINY = 1e-12  # seconds: a floor for the prediction a sample is divided by
_LEVEL_WINDOW = 5  # batches whose median (measured / seeded) time sets the prior's level
_LEVEL_MIN = 3  # batches before the level moves: a median of three outvotes one stall
_DISAGREE = math.log(1.3)  # a batch this far from the rescaled seed ...
_DISAGREE_DECAY = 0.5  # ... halves what is left of the prior
_REACH = 2.0  # shapes within this factor (tokens, tokens x longest) of a measured one are known
_EXTRAPOLATION_BOUND = 4.0  # an unmeasured shape: at most this times the level-scaled seed
_MEASURED_WINDOW = 256  # recent batch shapes kept to tell whether a prediction is backed
_BACKING_MIN = 2  # comparable measured batches that back a refusal


@dataclass(frozen=True, slots=True)
class Admission:
    """What refusing a batch unrun may rely on: its predicted seconds, and how many
    recent measured batches of a comparable shape back that (0: the catalog's seed)."""

    seconds: float
    backing: int

    def describe(self) -> str:
        """How the prediction was made, for a refusal's message."""
        if self.backing:
            return f"from {self.backing} measured batches of a comparable shape"
        return "by the model's tuned profile (no comparable batch measured yet)"


class CostModel:
    """Predicted batch latency: a + b*T + c*T*L, T = padded tokens (items*longest)
    if padded else real tokens, L = longest.

    Seeded from the catalog's tuned profile, refined online from measured
    batch times (recursive least squares with exponential forgetting, the
    seed acting as a prior so a few noisy samples can't make it absurd).
    Predictions are never negative.
    """

    __slots__ = ("_catalog", "_decay", "_gram", "_level", "_levels", "_measured", "_moment",
                 "_reach", "_seed", "_theta", "_weight", "forgetting", "padded",
                 "prior_weight", "samples")

    def __init__(
        self,
        a_s: float = 0.005,
        b_s: float = 2e-5,
        c_s: float = 0.0,
        *,
        padded: bool = True,
        forgetting: float = 0.98,
        prior_weight: float = 10.0,
    ) -> None:
        seed = (float(a_s), float(b_s), float(c_s))
        if not all(math.isfinite(v) and v >= 0 for v in seed):
            raise ValueError(f"seed coefficients must be finite and >= 0, got {seed}")
        if not 0 < forgetting <= 1:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        if not prior_weight > 0:
            raise ValueError(f"prior_weight must be > 0, got {prior_weight}")
        self.padded = padded
        self.forgetting = float(forgetting)
        self.prior_weight = float(prior_weight)
        self.samples = 0  # observations so far
        self._catalog = seed  # as given; the prior is this times the learnt level
        self._levels: deque[float] = deque(maxlen=_LEVEL_WINDOW)  # log(measured / seeded)
        self._level = 1.0
        self._seed = seed
        self._theta = seed
        self._gram = [[0.0] * 3 for _ in range(3)]  # decayed sum of z z^T
        self._moment = [0.0] * 3  # decayed sum of z * target
        self._weight = 0.0  # decayed number of samples
        self._decay = 1.0  # forgetting ** samples: how much of the prior is left
        self._measured: deque[tuple[float, float]] = deque(maxlen=_MEASURED_WINDOW)  # (T, T*L)
        self._reach = (0.0, 0.0)  # _REACH times the largest T and T*L ever measured

    @property
    def level(self) -> float:
        """How many times the given seed the device has been measured to take (1 at first)."""
        return self._level

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """The current (a, b, c), in seconds, seconds/token, seconds/token^2."""
        return self._theta

    def features(self, shape: BatchShape) -> tuple[float, float, float]:
        """The regressors (1, T, T*L) of a batch shape."""
        tokens = shape.items * shape.longest if self.padded else shape.tokens
        return 1.0, float(tokens), float(tokens) * shape.longest

    def predict(self, shape: BatchShape) -> float:
        """Predicted seconds for a batch of this shape (never negative); beyond the
        shapes measured, no more than `_EXTRAPOLATION_BOUND` times the scaled seed."""
        a, b, c = self._theta
        longest = shape.longest
        tokens = shape.items * longest if self.padded else shape.tokens
        fitted = a + tokens * (b + c * longest)
        known_t, known_tl = self._reach
        if tokens > known_t or tokens * longest > known_tl:
            sa, sb, sc = self._seed
            bound = _EXTRAPOLATION_BOUND * (sa + tokens * (sb + sc * longest))
            if _TINY < bound < fitted:  # a zero seed bounds nothing
                return bound
        return fitted if fitted > 0.0 else 0.0

    def admission(self, shape: BatchShape) -> Admission:
        """The predicted seconds a refusal may rely on (see the module's docstring)."""
        predicted = self.predict(shape)
        backing = self.comparable(shape)
        if backing >= _BACKING_MIN:
            return Admission(predicted, backing)
        a, b, c = self._catalog
        tokens = shape.items * shape.longest if self.padded else shape.tokens
        return Admission(min(predicted, a + tokens * (b + c * shape.longest)), 0)

    def comparable(self, shape: BatchShape) -> int:
        """How many recently measured batches had a shape comparable to this one."""
        t, tl = self.features(shape)[1:]
        return sum(1 for mt, mtl in self._measured
                   if t <= _REACH * mt and mt <= _REACH * t
                   and tl <= _REACH * mtl and mtl <= _REACH * tl)

    def observe(self, shape: BatchShape, seconds: float) -> None:
        """Learn from one measured batch. Non-finite or negative times, absurd
        ones and empty batches are ignored: they say nothing about the runtime."""
        if not math.isfinite(seconds) or seconds < 0 or shape.items <= 0:
            return
        predicted = self.predict(shape)
        # Relative to the prediction; a model that predicts nothing (a zero seed)
        # has no scale yet, so the measurement itself is used.
        scale = predicted if predicted > _TINY else max(seconds, _TINY)
        target = seconds / scale  # the current prediction is 1 in these units
        miss = abs(target - 1.0)
        weight = min(1.0, _HUBER_K / miss) if miss > 0 else 1.0
        if not math.isfinite(target) or weight < _MIN_WEIGHT:
            return  # millions of times the prediction: a broken clock, not a batch
        self._learn_level(shape, seconds)
        features = self.features(shape)
        self._measured.append(features[1:])
        self._reach = (max(self._reach[0], _REACH * features[1]),
                       max(self._reach[1], _REACH * features[2]))
        z = [v / scale for v in features]
        lam = self.forgetting
        for i in range(3):
            self._moment[i] = lam * self._moment[i] + z[i] * (weight * target)
            for j in range(3):
                self._gram[i][j] = lam * self._gram[i][j] + weight * z[i] * z[j]
        self._weight = lam * self._weight + weight
        self._decay *= lam
        self.samples += 1
        self._theta = self._solve()

    def _learn_level(self, shape: BatchShape, seconds: float) -> None:
        """Rescale the prior to the median measured/seeded ratio of the recent batches."""
        a, b, c = self._catalog
        tokens = shape.items * shape.longest if self.padded else shape.tokens
        seeded = a + tokens * (b + c * shape.longest)
        if seeded <= _TINY or seconds <= _TINY:
            return  # no scale to compare with (a zero seed), or no time measured
        ratio = math.log(seconds / seeded)
        if len(self._levels) >= _LEVEL_MIN and abs(ratio - math.log(self._level)) > _DISAGREE:
            # The seed's proportions are wrong for this device, not only its level:
            # let the measurements outweigh it sooner.
            self._decay *= _DISAGREE_DECAY
        self._levels.append(ratio)
        if len(self._levels) >= _LEVEL_MIN:
            self._level = level = math.exp(statistics.median(self._levels))
            self._seed = (a * level, b * level, c * level)

    def _solve(self) -> tuple[float, float, float]:
        """The non-negative coefficients minimising the decayed squared relative
        error plus the prior, solved in coordinates where every feature has unit
        mean square (so the 3x3 systems stay well conditioned)."""
        norms = [math.sqrt(self._gram[k][k] / self._weight) or 1.0 for k in range(3)]
        seed = [self._seed[k] * norms[k] for k in range(3)]  # each term's typical share
        weight = self.prior_weight * max(self._decay, 1.0 - self.forgetting)
        precision = _prior_precision(seed, weight)
        matrix = [
            [self._gram[i][j] / (norms[i] * norms[j]) + (precision[i] if i == j else 0.0)
             for j in range(3)]
            for i in range(3)
        ]
        vector = [self._moment[k] / norms[k] + precision[k] * seed[k] for k in range(3)]
        phi = _nonnegative_quadratic_min(matrix, vector)
        a, b, c = (phi[k] / norms[k] for k in range(3))
        return a, b, c


def _prior_precision(seed: list[float], weight: float) -> list[float]:
    """How firmly the prior holds each coefficient, in normalised coordinates.

    The prior's variance for a term is proportional to that term's share of
    the seed's prediction (plus a floor, so a term the seed sets to zero can
    still be learnt): when a sample says the runtime is slower than seeded,
    the terms are blamed in proportion to what they contribute, not equally,
    which would make the overhead `a` jump after one large batch.
    """
    total = sum(seed)
    if total <= 0:
        return [weight * len(seed)] * len(seed)
    shares = [s + _SHARE_FLOOR * total for s in seed]
    spread = sum(shares)
    return [weight * spread / s for s in shares]


def _nonnegative_quadratic_min(matrix: list[list[float]], vector: list[float]) -> list[float]:
    """argmin x^T M x - 2 x^T v subject to x >= 0, for a small positive-definite M.

    The optimum is the unconstrained optimum on some face {x_k = 0 for k not in
    F}: the one whose solution is non-negative and where the objective does not
    fall by raising any x_k it holds at zero (the KKT conditions, which single out
    the one minimum of a strictly convex problem). With 3 variables the faces are
    tried largest first, so the usual fit (every term positive, or one held at zero)
    costs one or two 3x3 solves, not seven; if rounding leaves no face passing the
    test, every face is compared by its value.
    """
    n = len(vector)
    faces = [free for size in range(n, 0, -1) for free in combinations(range(n), size)]
    solved: list[tuple[tuple[int, ...], list[float]]] = []
    for free in faces:
        sub = _solve_linear([[matrix[i][j] for j in free] for i in free],
                            [vector[i] for i in free])
        if sub is None or any(v < 0 for v in sub):
            continue
        solved.append((free, sub))
        # Half the objective's gradient at this point, along the coordinates held at 0.
        if all(sum(matrix[k][i] * x for x, i in zip(sub, free, strict=True)) >= vector[k]
               for k in range(n) if k not in free):
            return _placed(n, free, sub)
    if all(v <= 0 for v in vector):
        return [0.0] * n  # the empty face: x = 0
    best, best_value = [0.0] * n, 0.0  # the empty face: x = 0, value 0
    for free, sub in solved:
        value = -sum(x * vector[i] for x, i in zip(sub, free, strict=True))
        if value < best_value:
            best, best_value = _placed(n, free, sub), value
    return best


def _placed(n: int, free: tuple[int, ...], sub: list[float]) -> list[float]:
    """The n-vector with `sub` at the indices `free`, zero elsewhere."""
    x = [0.0] * n
    for value, i in zip(sub, free, strict=True):
        x[i] = value
    return x


def _solve_linear(matrix: list[list[float]], vector: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if singular."""
    n = len(vector)
    rows = [[*matrix[i], vector[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        if rows[pivot][col] == 0:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, n):
            factor = rows[r][col] / rows[col][col]
            for k in range(col, n + 1):
                rows[r][k] -= factor * rows[col][k]
    solution = [0.0] * n
    for r in reversed(range(n)):
        known = sum(rows[r][k] * solution[k] for k in range(r + 1, n))
        solution[r] = (rows[r][n] - known) / rows[r][r]
    return solution
