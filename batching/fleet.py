"""Where the fleet's models should be: every worker computes the same plan from the same
picture (its peers' pool states and its own), and applies its own row of it.

No central placer: the plan is a pure function of what every worker publishes (which
models it may serve, what it holds, its device budget) and of the fleet's demand per
model (requests per second and device seconds per second, summed over the workers that
received them). Two workers that see the same picture compute the same plan; for the
moments when their pictures differ, the worker that applies it never leaves a model's
queue without a consumer (`app.worker.lifecycle.fleet`).

The plan, in order:

1. pinned models stay where they are pinned;
2. each model wants `copies_wanted(busy)` copies: one, and another for every
   `TARGET_BUSY` of a device its traffic keeps busy, so a second copy starts before the
   first holder saturates;
3. if the copies do not all fit the fleet's budgets, every worker keeps room for one
   model (its *swap room*): the models left out are loaded there on demand, each by one
   worker, so a rare model is never starved by the popular ones and never thrashes them;
4. the copies kept are every model's first copy, then the extra copies, each the most
   asked for first (a model's k-th copy counts its rate / k), while the fleet's room
   lasts (an extra copy held is dropped only once its traffic is clearly below its
   need); a copy already held outranks one that is not by `HELD_BONUS` (hysteresis: two
   models of about the same demand do not trade places every time their rates cross).
   Each is placed on a worker that holds it already if it has room (and would not be
   kept busier than TARGET_BUSY, or well over its fair share of the device time, while
   another has room and would stay under both), else (those fewest
   workers may serve first) on the least busy worker with room, ties broken by a
   rendezvous hash, the same on every worker;
5. each model left out gets one swap worker: the one that holds it already or held it
   last (`warm`: its reload there is likely a copy from host memory), unless that worker
   already swaps more than the least busy one would with this model too; else the one
   with the least swap traffic.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

# A copy whose traffic keeps more than this share of a device busy wants another copy.
TARGET_BUSY = 0.6
# A copy held now outranks one that is not held by this factor of its demand.
HELD_BONUS = 0.25
# What a model nobody has asked for yet counts: below any real rate, above nothing.
UNASKED_RATE = 1e-6


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as the plan sees it."""

    name: str
    budget: int  # device bytes its models may take
    serves: frozenset[str]  # models it may serve (SHOAL_MODELS)
    held: frozenset[str] = frozenset()  # resident or loading there
    pinned: frozenset[str] = frozenset()
    # Evicted there moments ago: a reload there is likely cheap (the host-memory tier),
    # and the next holder of a swapped model should be the last one.
    warm: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Demand:
    """One model's demand over the fleet, and what a copy of it costs."""

    rate: float = 0.0  # requests per second
    busy: float = 0.0  # device seconds per second its batches take
    bytes: int = 1  # what a copy takes on a device
    load_s: float = 1.0  # what a (re)load takes


@dataclass(frozen=True, slots=True)
class Plan:
    keep: Mapping[str, frozenset[str]]  # worker -> models it keeps loaded
    swap: Mapping[str, str]  # model -> the worker that loads it on demand
    copies: Mapping[str, int] = field(default_factory=dict)  # model -> copies wanted

    def serves(self, worker: str) -> frozenset[str]:
        """The models `worker` consumes: those it keeps and those it swaps in."""
        swapped = {model for model, w in self.swap.items() if w == worker}
        return self.keep.get(worker, frozenset()) | swapped

    def holders(self, model: str) -> list[str]:
        return sorted(w for w, models in self.keep.items() if model in models)


def copies_wanted(busy: float, workers: int) -> int:
    """One copy, and one more for every TARGET_BUSY of a device the traffic keeps busy."""
    if workers < 1:
        return 0
    wanted = math.ceil(busy / TARGET_BUSY) if busy > 0 else 1
    return max(1, min(workers, wanted))


def rendezvous(model: str, worker: str) -> int:
    """The same number on every worker (Python's hash() is salted per process)."""
    digest = hashlib.blake2b(f"{model}\0{worker}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def plan_fleet(workers: Sequence[WorkerView], demand: Mapping[str, Demand]) -> Plan:
    """The plan every worker computes alone (see the module)."""
    workers = sorted(workers, key=lambda w: w.name)
    if not workers:
        return Plan({}, {}, {})
    models = sorted(set().union(*(w.serves for w in workers)))
    need = {m: demand.get(m, Demand()) for m in models}
    servers = {m: [w for w in workers if m in w.serves] for m in models}
    keep: dict[str, set[str]] = {w.name: set(w.pinned & w.serves) for w in workers}
    room = {w.name: w.budget - sum(need[m].bytes for m in keep[w.name]) for w in workers}
    busy_of = {w.name: sum(need[m].busy for m in keep[w.name]) for w in workers}
    copies = {m: copies_wanted(need[m].busy, len(servers[m])) for m in models}
    for m in models:  # hysteresis: a copy held goes only once clearly not needed
        held = sum(m in w.held for w in workers)
        if held > copies[m] and need[m].busy > (held - 1) * TARGET_BUSY * (1 - HELD_BONUS):
            copies[m] = min(held, len(servers[m]))

    wanted = [(m, k) for m in models
              for k in range(sum(m in keep[w.name] for w in workers) + 1, copies[m] + 1)]
    # A model's first copy decides whether some must be swapped in: a hot model's
    # extra copies take what room is left, they do not push rare models out.
    first = [m for m, k in wanted if k == 1]
    if sum(need[m].bytes for m in first) > sum(max(0, r) for r in room.values()):
        largest = max(need[m].bytes for m in first)
        for name in room:
            room[name] -= largest  # the swap room (3.)

    def rank(item: tuple[str, int]) -> tuple[float, str, int]:
        model, k = item
        holders = sum(model in w.held and model not in w.pinned for w in workers)
        bonus = 1 + HELD_BONUS if k <= holders else 1.0
        return (-max(need[model].rate, UNASKED_RATE) / k * bonus, model, k)

    # Which copies are kept: every model's first copy before any model's second, each
    # the most asked for first, as long as the fleet's room lasts ...
    chosen, left = [], sum(max(0, r) for r in room.values())
    for model, k in sorted(wanted, key=lambda item: (item[1] > 1, rank(item))):
        if need[model].bytes <= left:
            chosen.append((model, k))
            left -= need[model].bytes

    def place(model: str, fits: list[WorkerView]) -> None:
        best = min(fits, key=lambda w: (model not in w.warm, busy_of[w.name],
                                        len(keep[w.name]), rendezvous(model, w.name)))
        keep[best.name].add(model)
        room[best.name] -= need[model].bytes
        busy_of[best.name] += need[model].busy / copies[model]

    def fits(model: str) -> list[WorkerView]:
        return [w for w in servers[model]
                if model not in keep[w.name] and room[w.name] >= need[model].bytes]

    # A worker's fair share of the kept copies' device time.
    fair = (sum(busy_of.values()) + sum(need[m].busy / copies[m] for m, _ in chosen)) \
        / len(workers)

    def overloads(w: WorkerView, model: str) -> bool:
        after = busy_of[w.name] + need[model].busy / copies[model]
        return after > TARGET_BUSY or after - fair > need[model].busy / copies[model] / 2

    def under(w: WorkerView, model: str) -> bool:
        return busy_of[w.name] + need[model].busy / copies[model] <= min(fair, TARGET_BUSY)

    # ... where: first on the workers that hold them already (unless that would keep a
    # device busier than TARGET_BUSY, or well over its fair share, while another worker
    # with room would stay under both: then it moves), then the models fewest workers
    # may serve first, each on the least busy worker with room.
    rest = []
    for model, k in chosen:
        holders = [w for w in fits(model) if model in w.held]
        spare = any(under(w, model) for w in fits(model) if model not in w.held)
        holders = [w for w in holders if not (overloads(w, model) and spare)]
        if holders:
            place(model, holders)
        else:
            rest.append((model, k))
    for model, _ in sorted(rest, key=lambda item: (len(servers[item[0]]), rank(item))):
        if fits(model):
            place(model, fits(model))

    kept = set().union(*keep.values())
    left_out = sorted((m for m in models if m not in kept),
                      key=lambda m: (-need[m].rate, m))
    swap: dict[str, str] = {}
    swap_rate = {w.name: 0.0 for w in workers}
    for model in left_out:
        if not servers[model]:
            continue
        rate = max(need[model].rate, UNASKED_RATE)
        least = min(swap_rate[w.name] for w in servers[model])

        def stays(w: WorkerView, model: str = model, rate: float = rate,
                  least: float = least) -> bool:
            # where it is (or was moments ago), unless that worker already swaps more
            # than the least busy one would with this model too
            return (model in w.held or model in w.warm) and swap_rate[w.name] <= least + rate

        best = min(servers[model], key=lambda w: (not stays(w), swap_rate[w.name],
                                                  rendezvous(model, w.name)))
        swap[model] = best.name
        swap_rate[best.name] += rate
    return Plan({name: frozenset(ms) for name, ms in keep.items()}, swap, copies)


def eviction_value(demand: Demand) -> float:
    """What a model's absence costs per second: its requests times the reload each would
    wait for (an eviction's price; the cheapest goes first)."""
    return demand.rate * demand.load_s


class DecayingRate:
    """Events (or amounts) per second over an exponentially decaying window of `tau_s`.

    Pure: the caller passes the clock. After a step change of the true rate, the reading
    has moved 63% of the way in `tau_s` and 95% in three."""

    __slots__ = ("_at", "_level", "tau_s")

    def __init__(self, tau_s: float) -> None:
        if not tau_s > 0:
            raise ValueError(f"tau_s must be > 0, got {tau_s}")
        self.tau_s = tau_s
        self._level = 0.0
        self._at: float | None = None

    def add(self, now: float, amount: float = 1.0) -> None:
        self._level = self._decayed(now) + amount
        self._at = now

    def rate(self, now: float) -> float:
        return self._decayed(now) / self.tau_s

    def _decayed(self, now: float) -> float:
        if self._at is None:
            return 0.0
        return self._level * math.exp(-max(0.0, now - self._at) / self.tau_s)


def fleet_demand(reports: Iterable[Mapping[str, Mapping[str, float]]],
                 sizes: Mapping[str, int], load_s: Mapping[str, float]) -> dict[str, Demand]:
    """The fleet's demand per model: each worker's report ({model: {"rate", "busy"}})
    summed (a request reaches one worker only), with each model's size and load time."""
    rate: dict[str, float] = {}
    busy: dict[str, float] = {}
    for report in reports:
        for model, numbers in report.items():
            rate[model] = rate.get(model, 0.0) + float(numbers.get("rate", 0.0))
            busy[model] = busy.get(model, 0.0) + float(numbers.get("busy", 0.0))
    models = set(rate) | set(sizes) | set(load_s)
    unknown = max(sizes.values(), default=1)  # a size nobody reported: the largest known
    return {m: Demand(rate.get(m, 0.0), busy.get(m, 0.0), max(1, sizes.get(m, unknown)),
                      load_s.get(m, 1.0)) for m in models}


class DemandMeter:
    """What one worker is asked for, per model: requests and device seconds per second,
    each a `DecayingRate` (the caller passes the clock)."""

    def __init__(self, models: Iterable[str], tau_s: float) -> None:
        self.arrivals = {m: DecayingRate(tau_s) for m in models}
        self.busy = {m: DecayingRate(tau_s) for m in models}

    def arrived(self, model: str, now: float) -> None:
        if model in self.arrivals:
            self.arrivals[model].add(now)

    def ran(self, model: str, seconds: float, now: float) -> None:
        if model in self.busy:
            self.busy[model].add(now, seconds)

    def report(self, model: str, now: float) -> dict[str, float]:
        """{"rate", "busy"} of a pool-state model entry."""
        return {"rate": round(self.arrivals[model].rate(now), 4),
                "busy": round(self.busy[model].rate(now), 4)}
