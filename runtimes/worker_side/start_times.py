"""How long a runtime child takes to become ready, as measured at its last starts: what a
refusal during a restart tells its callers (the 503's Retry-After).

Two kinds of start, timed apart because they differ by the model loads: a fresh child
listens once it has imported torch and transformers and loaded the resident models; a
spare listens once it has imported (no model), and loads the resident models only when it
is promoted. Each figure is the last one measured (the host's load changes: the latest
start is the best guess of the next); before any spare was timed, a spare is expected to
take what a fresh child took (an upper bound: a spare imports the same, loads later).
"""

from __future__ import annotations

import time

from runtimes.worker_side.runtime_child import RuntimeChild


class StartTimes:
    """The latest measured starts (seconds); read and written under the supervisor's
    `_starting` lock or from one thread at a time (plain floats: a torn read is
    impossible, a stale one harmless)."""

    def __init__(self) -> None:
        self.fresh_s: float | None = None  # a fresh child: spawn -> listening (imports, loads)
        self.spare_s: float | None = None  # a spare: spawn -> listening (imports only)
        self.promotion_s: float | None = None  # a promoted spare's loads of the resident models

    def listened(self, child: RuntimeChild) -> None:
        """`child` was just connected to: keep how long it took to listen."""
        if child.listened_after_s is None:
            return
        if child.spare:
            self.spare_s = child.listened_after_s
        else:
            self.fresh_s = child.listened_after_s

    def promoted(self, seconds: float) -> None:
        """A promoted spare loaded the resident models in `seconds`."""
        self.promotion_s = seconds

    def ready_in(self, child: RuntimeChild, now: float | None = None) -> float | None:
        """Seconds until `child` (started, not yet listening) should be ready to serve:
        its kind's start as last measured, less the time it has run; 0 when that time has
        passed (it is late: any moment now); None when no start was measured yet."""
        if child.spare and self.spare_s is not None:
            expected = self.spare_s + (self.promotion_s or 0.0)
        else:
            expected = self.fresh_s
        if expected is None:
            return None
        elapsed = (time.monotonic() if now is None else now) - child.started
        return max(0.0, expected - elapsed)
