"""Unique ids for requests, cheap enough to make one per request.

`uuid.uuid4()` reads 16 bytes from the OS and builds a `UUID` for every request: 2-3%
of the gateway's CPU under single-text load (py-spy). An id here is a random prefix,
drawn once per process (and again in a forked child), and a counter: still the UUID
version-4 text form a Celery task id has, unique across processes by the prefix's 76
random bits, and within one by the counter. They are not secrets: nothing in shoal
grants access by knowing a task or request id.
"""

from __future__ import annotations

import itertools
import os
import uuid

_COUNTER_MASK = (1 << 48) - 1  # the last 12 hex digits count


def _reseed() -> None:
    global _prefix, _hex_prefix, _counter
    drawn = str(uuid.uuid4())
    _prefix = drawn[:24]  # "xxxxxxxx-xxxx-4xxx-yxxx-": version and variant as uuid4's
    _hex_prefix = _prefix.replace("-", "")
    _counter = itertools.count(int(drawn[24:], 16))


_prefix = _hex_prefix = ""
_counter = itertools.count()
_reseed()
os.register_at_fork(after_in_child=_reseed)


def task_id() -> str:
    """A new id in the form of `str(uuid.uuid4())`."""
    return f"{_prefix}{next(_counter) & _COUNTER_MASK:012x}"


def hex_id() -> str:
    """A new id in the form of `uuid.uuid4().hex`."""
    return f"{_hex_prefix}{next(_counter) & _COUNTER_MASK:012x}"
