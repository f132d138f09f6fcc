"""gateway.broker.deadlines: one timer for every awaited request's deadline."""

from __future__ import annotations

import asyncio

import pytest

from gateway.broker.deadlines import Deadlines


async def _await(deadlines: Deadlines, timeout_s: float, done: asyncio.Future,
                 entered: asyncio.Event | None = None) -> str:
    """A request as `Broker.submit` awaits one: its result, "late", or cancelled."""
    deadline = deadlines.add(timeout_s)
    if entered is not None:
        entered.set()
    try:
        return await done
    except asyncio.CancelledError:
        if deadline.expired and deadline.task.uncancel() == 0:
            return "late"
        raise
    finally:
        deadline.finished = True


def test_a_request_past_its_deadline_is_cancelled_for_it_and_the_others_are_not() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        deadlines = Deadlines()
        never = loop.create_future()
        answered = loop.create_future()
        late = asyncio.create_task(_await(deadlines, 0.05, never))
        fine = asyncio.create_task(_await(deadlines, 0.05, answered))
        patient = asyncio.create_task(_await(deadlines, 30.0, loop.create_future()))
        answered.set_result("result")
        assert await asyncio.wait_for(late, 5) == "late"
        assert await fine == "result"
        assert not patient.done()  # another timeout's queue: not due
        patient.cancel()
        with pytest.raises(asyncio.CancelledError):
            await patient

    asyncio.run(main())


def test_a_cancel_from_elsewhere_is_not_taken_for_a_timeout() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        deadlines = Deadlines()
        entered = asyncio.Event()
        task = asyncio.create_task(_await(deadlines, 30.0, loop.create_future(), entered))
        await entered.wait()
        task.cancel()  # the client left
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_requests_that_end_arm_no_timer_and_leave_the_queue() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        deadlines = Deadlines()
        first = loop.create_future()
        first.set_result(0)
        await _await(deadlines, 30.0, first)
        timer = deadlines._timer
        assert timer is not None
        for n in range(1000):
            done = loop.create_future()
            done.set_result(n)
            assert await _await(deadlines, 30.0, done) == n
        # One timer, armed by the first request; finished entries were dropped as later
        # ones came, so the queue holds what is in flight (here: the last one).
        assert deadlines._timer is timer
        assert len(deadlines) == 1

    asyncio.run(main())


def test_the_timer_moves_to_the_next_unfinished_deadline() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        deadlines = Deadlines()
        quick = loop.create_future()
        quick.set_result("quick")
        assert await _await(deadlines, 0.02, quick) == "quick"  # armed the timer at 20 ms
        slow = asyncio.create_task(_await(deadlines, 0.1, loop.create_future()))
        # The 20 ms timer finds only a finished entry, and arms for the 100 ms one.
        assert await asyncio.wait_for(slow, 5) == "late"
        assert len(deadlines) == 0

    asyncio.run(main())
