"""The faulty adapter's slow batches (`@@slow@@`, runtimes.doubles.faulty) as a test sees
them: how many have started sleeping in the model, and holding them there until the test
has done what it must do while they run."""

from __future__ import annotations

from pathlib import Path

from runtimes.doubles.faulty import SLOW_HOLD_ENV, SLOW_LOG_ENV
from tests.stack import wait_for


class SlowBatches:
    """`env` goes to the runtime's (or worker's) environment; the files live in `folder`."""

    def __init__(self, folder: Path, slow_s: float) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.log = folder / "slow-batches.log"
        self.hold_file = folder / "slow-batches.hold"
        self.env = {"SHOAL_ALLOW_TEST_ADAPTERS": "1", "SHOAL_FAULTY_SLOW_S": str(slow_s),
                    SLOW_LOG_ENV: str(self.log), SLOW_HOLD_ENV: str(self.hold_file)}

    def pids(self) -> list[int]:
        """The runtime process of each slow batch that started sleeping, in order."""
        try:
            return [int(pid) for pid in self.log.read_text().split()]
        except FileNotFoundError:
            return []

    def started(self) -> int:
        return len(self.pids())

    def wait_started(self, count: int, timeout: float = 60.0) -> None:
        """Until `count` slow batches (since the first) have started sleeping."""
        wait_for(lambda: self.started() >= count, timeout,
                 f"{count} slow batch(es) to be sleeping in the model")

    def hold(self) -> None:
        """Slow batches sleep on until `release` (past their usual time)."""
        self.hold_file.touch()

    def release(self) -> None:
        self.hold_file.unlink(missing_ok=True)
