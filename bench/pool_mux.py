"""The client-side router of bench.pool's `mux` deployments, pure: what a user would put
in front of model-multiplexing replicas (like Ray Serve's model multiplexing).

Each replica serves every model, loads what it is sent and evicts its least recently used
model once `slots` are held. The router keeps a mirror of that: per replica, an LRU of at
most `slots` models it has routed there. A request goes to a replica that holds its model
(the one with the fewest outstanding requests among them); when none does, to the replica
with the fewest outstanding requests, which will load it (and the mirror evicts that
replica's least recently used model). Ties go to the lowest index.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class MuxRouter:
    def __init__(self, replicas: int, slots: int) -> None:
        if replicas < 1 or slots < 1:
            raise ValueError(f"replicas and slots must be >= 1, got {replicas}, {slots}")
        self.slots = slots
        self.held: list[OrderedDict[Hashable, None]] = [OrderedDict() for _ in range(replicas)]
        self.outstanding = [0] * replicas

    def holders(self, model: Hashable) -> list[int]:
        return [i for i, held in enumerate(self.held) if model in held]

    def choose(self, model: Hashable) -> int:
        """The replica for one request of `model`; counts it outstanding there."""
        replicas = self.holders(model) or range(len(self.held))
        index = min(replicas, key=lambda i: (self.outstanding[i], i))
        held = self.held[index]
        if model in held:
            held.move_to_end(model)
        else:
            held[model] = None
            while len(held) > self.slots:
                held.popitem(last=False)
        self.outstanding[index] += 1
        return index

    def done(self, replica: int) -> None:
        """A request routed to `replica` was answered (or failed)."""
        if self.outstanding[replica] <= 0:
            raise ValueError(f"replica {replica} has no outstanding request")
        self.outstanding[replica] -= 1
