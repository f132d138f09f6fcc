"""A worker's child processes (the PyTorch runtime, SGLang servers): their output and how
they ended."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections import deque
from typing import IO


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


class OutputTail:
    """Forwards a child's output to the worker's stderr on a thread of its own, keeping its
    last `lines` to explain a failed start or a death."""

    def __init__(self, stream: IO[bytes], name: str, lines: int) -> None:
        self._stream = stream
        self._lines: deque[str] = deque(maxlen=lines)
        self._thread = threading.Thread(target=self._forward, daemon=True, name=name)
        self._thread.start()

    def _forward(self) -> None:
        for line in iter(self._stream.readline, b""):
            self._lines.append(line.decode(errors="replace").rstrip())
            with contextlib.suppress(OSError):
                os.write(2, line)
        self._stream.close()

    def join(self, timeout: float = 2.0) -> None:
        self._thread.join(timeout)

    def text(self) -> str:
        """The last lines (waiting a little for the rest of an exited child's output)."""
        self.join()
        return "\n".join(self._lines)
