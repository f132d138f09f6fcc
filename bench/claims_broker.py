"""RabbitMQ's memory while bench.claims runs: the broker's RSS (from /proc) and the
management API's figures for the bench's queues, sampled on a thread."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from bench.claims_report import Sample


def _rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class BrokerMemory:
    """Samples the broker's memory on a thread of its own: the management API's calls block,
    and the load generator's event loop must not wait on them."""

    def __init__(self, management_url: str, prefix: str, broker_pids: Sequence[int],
                 rss_interval: float = 0.2, api_interval: float = 1.0) -> None:
        self.management_url = management_url
        self.prefix = prefix
        self.broker_pids = list(broker_pids)
        self.rss_interval = rss_interval
        self.api_interval = api_interval
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self, api: bool = True) -> Sample:
        """The figures now: RSS always, the management API's when `api`."""
        from app.tuning.bench_stack import management_get

        rss = [r for pid in self.broker_pids if (r := _rss(pid)) is not None]
        mem_used = queue_memory = message_bytes = None
        if api:
            try:
                nodes = management_get(self.management_url, "nodes?columns=name,mem_used", 5)
                queues = management_get(self.management_url,
                                        "queues?columns=name,memory,message_bytes", 5)
            except (OSError, ValueError) as exc:
                print(f"warning: RabbitMQ's management API: {exc}", file=sys.stderr)
            else:
                mem_used = sum(n.get("mem_used") or 0 for n in nodes)
                mine = [q for q in queues if q["name"].startswith(f"{self.prefix}.")]
                queue_memory = sum(q.get("memory") or 0 for q in mine)
                message_bytes = sum(q.get("message_bytes") or 0 for q in mine)
        return Sample(time.perf_counter(), sum(rss) if rss else None, mem_used, queue_memory,
                      message_bytes)

    def _run(self) -> None:
        next_api = 0.0
        while not self._stop.is_set():
            now = time.perf_counter()
            api = now >= next_api
            if api:
                next_api = now + self.api_interval
            self.samples.append(self.sample(api))
            self._stop.wait(self.rss_interval)

    def __enter__(self) -> BrokerMemory:
        self.samples = []
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="broker-memory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
