"""The runtime contract (`runtimes.base.Runtime`: compute, model store, statistics): every
runtime class implements every member, and the wrappers (`ReplicaSet` over replicas,
`RuntimeRouter` over engines) forward each one, capabilities and send-ahead included.

The wrappers run here over `Engine`, a recording runtime that can send ahead (the real
ProcessRuntime's send-ahead through a ReplicaSet: tests/runtime/test_replicas.py).
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Callable
from concurrent.futures import Future

import pytest

from batching.feeder import Load
from runtimes.base import (
    DEVICE_GROUP_ENV,
    BatchesOnly,
    Capabilities,
    Compute,
    ModelStore,
    NotContinuous,
    OnDeltas,
    Outcome,
    Request,
    RuntimeStatistics,
    SentAhead,
)
from runtimes.doubles.sim import SimRuntime
from runtimes.sglang.runtime import SGLangRuntime
from runtimes.worker_side.process import ProcessRuntime
from runtimes.worker_side.replicas import ReplicaSet
from runtimes.worker_side.router import RuntimeRouter

RUNTIMES = [ProcessRuntime, ReplicaSet, RuntimeRouter, SGLangRuntime, SimRuntime]


def members(protocol: type) -> set[str]:
    own = {n for n in vars(protocol) if not n.startswith("_")}
    return own | set(getattr(protocol, "__annotations__", {}))


def provided(cls: type) -> set[str]:
    """What an instance of `cls` has: its class's members and what its `__init__`s set."""
    names = {n for n in dir(cls) if not n.startswith("_")}
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is not None and inspect.isfunction(init):
            names |= set(re.findall(r"self\.([a-z]\w*)\s*(?::[^=\n]*)?=",
                                    inspect.getsource(init)))
    return names


@pytest.mark.parametrize("protocol", [Compute, ModelStore, RuntimeStatistics],
                         ids=lambda p: p.__name__)
@pytest.mark.parametrize("runtime", RUNTIMES, ids=lambda c: c.__name__)
def test_every_runtime_implements_every_member_of_the_contract(runtime, protocol):
    wanted = members(protocol)
    assert wanted, protocol  # (the protocol's members were found at all)
    assert wanted - provided(runtime) == set()


@pytest.mark.parametrize("runtime", RUNTIMES, ids=lambda c: c.__name__)
def test_run_batch_takes_a_frame_sent_ahead(runtime):
    assert "ahead" in inspect.signature(runtime.run_batch).parameters


# --- a recording runtime ----------------------------------------------------------------


class Ahead:
    def __init__(self, engine: Engine, model: str) -> None:
        self.engine, self.model = engine, model
        self.discarded = False

    def discard(self) -> None:
        self.discarded = True


SENDS_AHEAD = Capabilities(send_ahead=True)


class Engine(BatchesOnly):
    """A runtime that records the calls it gets (and may send ahead, or be continuous)."""

    def __init__(self, name: str, capabilities: Capabilities = SENDS_AHEAD,
                 continuous: bool = False) -> None:
        self.name = name
        self.capabilities = capabilities
        self.calls: list[tuple] = []
        self._continuous = continuous
        self.resident = {f"{name}-model": 1}
        self.device_bytes: int | None = 1000
        self.restarts, self.poison_isolated, self.spare_promotions = 1, 2, 3
        self.start_failures, self.pid = 4, 100
        self.ready: float | None = None
        self.watchers: list[Callable[[], None]] = []

    def send_ahead(self, model_id: str, requests: list[Request]) -> SentAhead | None:
        self.calls.append(("send_ahead", model_id))
        return Ahead(self, model_id) if self.capabilities.send_ahead else None

    def run_batch(self, model_id: str, requests: list[Request],
                  on_deltas: OnDeltas | None = None, ahead: SentAhead | None = None
                  ) -> list[Outcome]:
        assert ahead is None or (isinstance(ahead, Ahead) and ahead.engine is self)
        self.calls.append(("run_batch", model_id, ahead))
        return [Outcome(r.id, {"by": self.name}) for r in requests]

    def continuous(self, model_id: str) -> bool:
        return self._continuous

    def submit(self, model_id: str, request: Request,
               on_deltas: OnDeltas | None = None) -> Future[Outcome]:
        if not self._continuous:
            return super().submit(model_id, request, on_deltas)
        self.calls.append(("submit", model_id))
        future: Future[Outcome] = Future()
        future.set_result(Outcome(request.id, {"by": self.name}))
        return future

    def load_of(self, model_id: str) -> Load:
        if not self._continuous:
            return super().load_of(model_id)
        return Load(running=1, waiting=0, max_running=8)

    def cancel(self, request_ids: list[str]) -> None:
        self.calls.append(("cancel", tuple(request_ids)))

    def estimate_bytes(self, model_id: str, lora: str | None = None) -> int:
        return 10

    def load(self, model_id: str, lora: str | None = None) -> int:
        self.calls.append(("load", model_id, lora))
        return 10

    def unload(self, model_id: str, lora: str | None = None) -> None:
        self.calls.append(("unload", model_id, lora))

    def ready_in(self, model_id: str) -> float | None:
        return self.ready

    def watch_availability(self, callback: Callable[[], None]) -> None:
        self.watchers.append(callback)

    def close(self) -> None:
        self.calls.append(("close",))


def requests(*ids: str) -> list[Request]:
    return [Request(i, "encode", {}) for i in ids]


# --- the router ---------------------------------------------------------------------------


@pytest.fixture
def router():
    torch_, sglang = Engine("pytorch", Capabilities(pipeline_depth=2, parallel=3,
                                                    send_ahead=True)), \
        Engine("sglang", Capabilities(), continuous=True)
    return RuntimeRouter({"pytorch": torch_, "sglang": sglang},
                         {"a": "pytorch", "g": "sglang"}), torch_, sglang


def test_the_router_declares_what_its_engines_can_do(router):
    runtime, _, _ = router
    assert runtime.capabilities == Capabilities(pipeline_depth=2, parallel=3, send_ahead=True)
    alone = RuntimeRouter({"sglang": Engine("s", Capabilities())}, {})
    assert alone.capabilities == Capabilities()


def test_the_router_sends_ahead_through_the_models_engine_and_runs_the_batch_there(router):
    runtime, torch_, sglang = router
    ahead = runtime.send_ahead("a", requests("r1"))
    assert isinstance(ahead, Ahead) and ahead.engine is torch_
    assert [o.result for o in runtime.run_batch("a", requests("r1"), ahead=ahead)] == \
        [{"by": "pytorch"}]
    assert torch_.calls == [("send_ahead", "a"), ("run_batch", "a", ahead)]
    assert runtime.send_ahead("g", requests("r2")) is None  # its engine cannot
    assert sglang.calls == [("send_ahead", "g")]


def test_the_router_forwards_compute_and_models_to_the_models_engine(router):
    runtime, torch_, sglang = router
    assert runtime.continuous("g") and not runtime.continuous("a")
    assert runtime.submit("g", requests("r")[0]).result().result == {"by": "sglang"}
    assert runtime.load_of("g") == Load(running=1, waiting=0, max_running=8)
    with pytest.raises(NotContinuous):
        runtime.submit("a", requests("r")[0])
    runtime.load("g", None)
    runtime.unload("a", "lora")
    runtime.cancel(["x"])
    assert ("load", "g", None) in sglang.calls and ("unload", "a", "lora") in torch_.calls
    assert ("cancel", ("x",)) in sglang.calls and ("cancel", ("x",)) in torch_.calls


def test_the_router_sums_the_statistics_and_forwards_availability(router):
    runtime, torch_, sglang = router
    assert (runtime.restarts, runtime.poison_isolated, runtime.spare_promotions,
            runtime.start_failures, runtime.pid) == (2, 4, 6, 8, 100)
    assert runtime.resident == {"pytorch-model": 1, "sglang-model": 1}
    assert runtime.device_bytes == 1000
    sglang.ready = 2.5
    assert runtime.ready_in("g") == 2.5 and runtime.ready_in("a") is None
    runtime.watch_availability(print)
    assert torch_.watchers == [print] and sglang.watchers == [print]


# --- the replica set ----------------------------------------------------------------------


def replica_set(*capabilities: Capabilities) -> tuple[ReplicaSet, list[Engine]]:
    engines = [Engine(f"replica-{i}", c) for i, c in enumerate(capabilities)]
    return ReplicaSet(lambda index, env: engines[index], len(engines)), engines  # type: ignore


def test_a_replica_set_declares_its_replicas_capabilities():
    runtime, _ = replica_set(Capabilities(pipeline_depth=2, send_ahead=True),
                             Capabilities(pipeline_depth=2, send_ahead=True))
    assert runtime.capabilities == Capabilities(pipeline_depth=4, parallel=2, send_ahead=True)
    without, _ = replica_set(Capabilities(send_ahead=True), Capabilities())
    assert without.capabilities.send_ahead is False
    assert without.send_ahead("m", requests("r")) is None
    assert without.batches == [0, 0]  # nothing counted for a frame not sent


def test_a_batch_sent_ahead_runs_on_the_replica_it_went_to_which_is_busy_meanwhile():
    runtime, engines = replica_set(Capabilities(send_ahead=True), Capabilities(send_ahead=True))
    ahead = runtime.send_ahead("m", requests("r1"))
    assert ahead is not None
    sent_to = next(e for e in engines if e.calls == [("send_ahead", "m")])
    other = engines[1 - engines.index(sent_to)]
    # Meanwhile the next batch goes to the other replica: the first one's slot is held.
    assert runtime.run_batch("m", requests("r2"))[0].result == {"by": other.name}
    assert runtime.run_batch("m", requests("r1"), ahead=ahead)[0].result == \
        {"by": sent_to.name}
    assert sent_to.calls[-1][2] is ahead.ahead  # the replica's own handle
    assert sorted(runtime.batches) == [1, 1] and runtime._in_flight == [0, 0]


def test_a_discarded_frame_gives_its_replicas_slot_back():
    runtime, engines = replica_set(Capabilities(send_ahead=True), Capabilities(send_ahead=True))
    ahead = runtime.send_ahead("m", requests("r1"))
    assert ahead is not None
    ahead.discard()
    inner = ahead.ahead  # the replica's own handle, discarded too
    assert isinstance(inner, Ahead) and inner.discarded and inner.engine in engines
    assert runtime._in_flight == [0, 0] and runtime.batches == [0, 0]


def test_a_replica_set_forwards_models_statistics_and_availability():
    runtime, engines = replica_set(Capabilities(), Capabilities())
    assert runtime.load("m", "l") == 20  # both copies
    runtime.cancel(["x"])
    for engine in engines:
        assert ("load", "m", "l") in engine.calls and ("cancel", ("x",)) in engine.calls
    assert not runtime.continuous("m")
    with pytest.raises(NotContinuous):
        runtime.load_of("m")
    assert (runtime.restarts, runtime.poison_isolated, runtime.spare_promotions,
            runtime.start_failures) == (2, 4, 6, 8)
    engines[0].ready, engines[1].ready = 3.0, 1.5
    assert runtime.ready_in("m") == 1.5  # the first to serve again
    runtime.watch_availability(print)
    assert all(e.watchers == [print] for e in engines)
    runtime.close()
    assert all(e.calls[-1] == ("close",) for e in engines)


def test_the_replicas_of_a_set_are_told_the_device_they_share():
    """Each set's replicas get one name for their device in their environment (a stand-in
    device queues their passes as one: `runtimes.doubles.device_queue`); another set,
    another name."""
    envs: list[dict[str, str]] = []

    def start(index: int, env: dict[str, str]) -> Engine:
        envs.append(env)
        return Engine(f"replica-{index}")

    for _ in range(2):
        ReplicaSet(start, 2).close()  # type: ignore[arg-type]
    groups = [env[DEVICE_GROUP_ENV] for env in envs]
    assert groups[0] == groups[1] != groups[2] == groups[3]
    assert all(g.startswith(f"{os.getpid()}-") for g in groups)
