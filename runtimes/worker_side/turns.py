"""The order of frames on one batch connection to a runtime process.

Batches from several threads share the connection (the child answers them in the order
they came, `runtimes.child_side.pipeline`): each sender takes a ticket, and waits for its turn to
read its reply. A frame that must be alone (a stream's or a probe's conversation, or any
frame of a batch that failed once) waits until nothing else is in flight and keeps the
connection until its replies are read. One failure breaks the connection for every
frame behind it (`Stale`): the replies no longer match the frames.

A frame may also be sent ahead (`Turns.ahead`) by a thread that must never wait (the
worker's loop): only when nothing is in flight, and its reply is read later, in its
turn, by the batch's own thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class Stale(ConnectionError):
    """A frame was not sent, or its reply not read, because one before it on the
    connection failed: the child never ran it alone, so its failure is no evidence."""


class Turn:
    """A frame's place in its connection's order of replies."""

    def __init__(self, turns: Turns, ticket: int) -> None:
        self._turns, self._ticket = turns, ticket

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Wait until the replies before this frame's are read, then read it (the block)."""
        turns = self._turns
        with turns.changed:
            turns.changed.wait_for(lambda: turns.read == self._ticket)
        try:
            if turns.broken:
                raise Stale("an earlier frame on this connection failed")
            yield
        except BaseException:
            # What comes next on the connection may be the reply this one did not read
            # (late after a timeout): nobody reads it; the child is replaced.
            turns.broken = True
            raise
        finally:
            turns.done()


class Turns:
    """The frames in flight on one batch connection, answered in the order sent."""

    def __init__(self) -> None:
        self._sending = threading.Lock()
        self.changed = threading.Condition()
        self.sent = 0
        self.read = 0
        self.broken = False  # a frame failed: the replies no longer match the frames

    @contextlib.contextmanager
    def send(self, alone: bool) -> Iterator[Turn]:
        """Send a frame (the block); `alone`: first wait until nothing is in flight, and
        keep others from sending until the block ends (its replies are read in it)."""
        with self._sending:
            if alone:
                with self.changed:
                    self.changed.wait_for(lambda: self.read == self.sent)
            if self.broken:
                raise Stale("an earlier frame on this connection failed")
            with self._next_turn() as turn:
                yield turn
            if alone:
                self.done()

    @contextlib.contextmanager
    def ahead(self) -> Iterator[Turn | None]:
        """Send a frame now (the block), without waiting: a turn only when nothing is in
        flight and no other frame is being sent, else None (send nothing). Its reply is
        read later, with `Turn.reading`, like any other frame's."""
        if not self._sending.acquire(blocking=False):
            yield None
            return
        try:
            with self.changed:
                idle = self.read == self.sent and not self.broken
            if not idle:
                yield None
                return
            with self._next_turn() as turn:  # nothing before it: its turn to read is now
                yield turn
        finally:
            self._sending.release()

    @contextlib.contextmanager
    def _next_turn(self) -> Iterator[Turn]:
        """The next frame's turn, while the block sends it (the caller holds `_sending`)."""
        ticket = self.sent
        self.sent += 1
        try:
            yield Turn(self, ticket)
        except BaseException:
            # Nothing or part was sent: the connection is broken and the child is
            # replaced; let the frames behind this one read (and fail) in turn.
            self.broken = True
            with self.changed:
                self.changed.wait_for(lambda: self.read == ticket)
            self.done()
            raise

    def done(self) -> None:
        with self.changed:
            self.read += 1
            self.changed.notify_all()
