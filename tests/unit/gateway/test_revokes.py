"""gateway.broker.revokes and gateway.edge.caller_left: the requests of callers that hang
up are revoked in batches, and a hang-up reaches only what waits for that request."""

from __future__ import annotations

import asyncio

from gateway.broker.deadlines import Deadlines
from gateway.broker.revokes import REVOKE_MAX_IDS, Revokes
from gateway.edge.caller_left import CALLER_LEFT, caller_left, forget_caller, on_caller_left


async def until(condition) -> None:
    """Let the loop turn until `condition` holds (5 s at most)."""
    async with asyncio.timeout(5):
        while not condition():
            await asyncio.sleep(0)


def test_the_ids_revoked_in_one_loop_turn_go_out_in_one_broadcast() -> None:
    sent: list[list[str]] = []

    async def main() -> None:
        release = asyncio.Event()

        async def broadcast(ids: list[str]) -> None:
            sent.append(ids)
            await release.wait()  # a slow broker: the next ids wait for this one

        revokes = Revokes(broadcast)
        for i in range(5):
            revokes.revoke(f"a{i}")
        await until(lambda: sent)
        assert sent == [[f"a{i}" for i in range(5)]]
        for i in range(3):  # while the first is in flight: together, after it
            revokes.revoke(f"b{i}")
        release.set()
        await until(lambda: len(sent) >= 2)
        assert sent == [[f"a{i}" for i in range(5)], ["b0", "b1", "b2"]]
        # Many at once: at most REVOKE_MAX_IDS per message.
        for i in range(REVOKE_MAX_IDS + 1):
            revokes.revoke(f"c{i}")
        await until(lambda: len(sent) >= 4)
        assert [len(ids) for ids in sent[2:]] == [REVOKE_MAX_IDS, 1]

    asyncio.run(main())


def test_a_hang_up_cancels_the_wait_it_concerns_and_is_told_apart_from_a_deadline() -> None:
    async def wait(deadlines: Deadlines, scope: dict, done: asyncio.Future) -> str:
        # As `Broker.submit` waits: its deadline, and its caller's hang-up registered.
        deadline = deadlines.add(30.0)
        on_caller_left(scope, deadline.hang_up)
        try:
            return await done
        except asyncio.CancelledError:
            if deadline.left and deadline.task.uncancel() == 0:
                return "left"
            raise
        finally:
            deadline.finished = True
            forget_caller(scope)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        deadlines = Deadlines()
        gone, staying = {"state": {}}, {"state": {}}
        left = asyncio.create_task(wait(deadlines, gone, loop.create_future()))
        answer = loop.create_future()
        stays = asyncio.create_task(wait(deadlines, staying, answer))
        await until(lambda: CALLER_LEFT in gone["state"])
        caller_left(gone)
        assert await asyncio.wait_for(left, 5) == "left"
        assert not stays.done()
        answer.set_result("result")
        assert await stays == "result"
        caller_left(staying)  # after its answer: nothing waits, nothing happens
        assert staying["state"] == {}

    asyncio.run(main())
