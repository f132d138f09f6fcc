"""A redis-server of a test's own, which the test kills and starts again: empty, as a Redis
restarted without persistence comes back, or (`persist`) with what it held, as one with
`appendonly yes` does. The session's Redis (127.0.0.1:6379) is never touched."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from tests.stack import free_port, wait_for


class PrivateRedis:
    def __init__(self, folder: Path, persist: bool = False) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.port = free_port()
        self.persist = persist
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start it on its port (the same one each time) once it answers PING. Without
        `persist` it keeps nothing, so a start after `kill` is an empty Redis."""
        import redis

        # appendfsync always: a SIGKILL loses nothing written, as a clean restart would not.
        keep = ["--appendonly", "yes", "--appendfsync", "always"] if self.persist else \
            ["--appendonly", "no"]
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--dir", str(self.folder), *keep],
            stdout=(self.folder / "redis.log").open("ab"), stderr=subprocess.STDOUT)
        process = self.process

        def answers() -> bool:
            client = redis.Redis.from_url(self.url, socket_timeout=2)
            try:
                return bool(client.ping())
            except redis.exceptions.ConnectionError:
                return False
            finally:
                client.close()

        wait_for(answers, 30, f"redis-server on port {self.port} to answer",
                 give_up=lambda: None if process.poll() is None else
                 f"redis-server exited: {(self.folder / 'redis.log').read_text()[-2000:]}")

    def kill(self) -> None:
        """SIGKILL, as a crashed or evicted Redis goes: nothing is saved on the way out."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self) -> None:
        self.kill()
        self.process = None
