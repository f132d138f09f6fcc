"""A worker whose runtime's replacement dies while it loads: callers get 503 with the
Retry-After its measured start calls for (not 1), the gateway answers them itself while
the worker says it is restarting (nothing is published for the worker to refuse), and
the next spare is brought up and served as soon as it has imported, with no request
asking for it.

One worker with a spare, on a private prefix, behind a gateway of its own. The spare is
held stopped so that the kill surely lands before it has loaded, and so is the next
spare, so that the refusals surely come while it imports.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.tuning.stack import http_status
from tests.conftest import FAULTY
from tests.stack import MeteredWorker, PrivateStack, private_stack, start_metered_worker, wait_for

pytestmark = pytest.mark.e2e

START_S = 180  # a spare imports torch: seconds on a busy 2-core host


@pytest.fixture
def private(tmp_path: Path) -> Iterator[PrivateStack]:
    with private_stack(tmp_path, "restart-refusals", FAULTY) as stack:
        yield stack


def _runtimes(worker: MeteredWorker) -> dict[int, list[str]]:
    """The worker's runtime processes: pid -> argv."""
    found = {}
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().decode().split("\0")
            if int(stat.rsplit(")", 1)[1].split()[1]) == worker.process.pid \
                    and "runtimes.child_side.server" in argv:
                found[int(entry.name)] = argv
    return found


def _listening(argv: list[str]) -> bool:
    return Path(argv[argv.index("--socket") + 1]).exists()


def _post(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/encode/{FAULTY}", json={"items": [{"text": "a text"}]},
                      timeout=60)


def test_a_replacement_killed_while_it_loads_is_refused_by_the_gateway_for_its_start(private):
    private.stack.gateway("gateway", private.port, [FAULTY], SHOAL_QUEUE_PREFIX=private.prefix)
    worker = start_metered_worker(private.stack, "refusals", FAULTY, private.queue, START_S,
                                  SHOAL_QUEUE_PREFIX=private.prefix, SHOAL_RUNTIME_SPARE="1",
                                  SHOAL_PIN=FAULTY)
    wait_for(lambda: http_status(f"{private.url}/readyz") == 200, 60, "the gateway")
    wait_for(lambda: _post(private.url).status_code == 200, 60, "a first answer")
    # A spare that has imported (it listens), beside the serving runtime.
    spare = wait_for(lambda: next((p for p, argv in _runtimes(worker).items()
                                   if "--spare" in argv and _listening(argv)), None),
                     START_S, "the spare to import")
    (serving,) = set(_runtimes(worker)) - {spare}
    held = [spare]
    try:
        os.kill(spare, signal.SIGSTOP)
        os.kill(serving, signal.SIGKILL)  # idle: the worker's watcher promotes the spare
        nxt = wait_for(lambda: next(iter(set(_runtimes(worker)) - {serving, spare}), None),
                       30, "the next spare", interval=0.01)
        os.kill(nxt, signal.SIGSTOP)
        held.append(nxt)
        os.kill(spare, signal.SIGKILL)  # while it would load: the restart fails

        # Refused while the next spare imports; soon by the gateway itself.
        def refused_by_the_gateway() -> httpx.Response | None:
            response = _post(private.url)
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "MODEL_UNAVAILABLE"
            return response if "every worker that serves it" in response.text else None

        response = wait_for(refused_by_the_gateway, 30, "the gateway's own refusals")
        # The last spare's measured import, not the 1 s it always said.
        assert int(response.headers["retry-after"]) >= 2, response.headers
        answered = worker.metric("shoal_results_total")
        own = 0  # of the next 5, refused by the gateway itself
        shortest = int(response.headers["retry-after"])
        began = time.monotonic()
        for _ in range(5):  # (each held up to a second: clients retrying at once are paced)
            refusal = _post(private.url)
            assert refusal.status_code == 503, refusal.text
            own += "every worker that serves it" in refusal.text
            shortest = min(shortest, int(refusal.headers["retry-after"]))
        took = time.monotonic() - began
        # Each time the Retry-After it gave runs out, the gateway publishes one again to
        # learn whether the model is back, and the worker refuses it: at most one per
        # Retry-After the 5 took, plus the one at the start. Every other one the gateway
        # answers itself; published, all 5 would reach the worker.
        published = 5 - own
        assert own >= 1, own
        assert published <= 1 + took / shortest, (published, took, shortest)
        assert worker.metric("shoal_results_total") - answered <= published
    finally:
        for pid in held:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    # Brought up once it has imported, and the gateway publishes again when told.
    wait_for(lambda: _post(private.url).status_code == 200, START_S,
             "an answer from the next spare", interval=0.2)
    assert worker.metric("shoal_runtime_start_failures") == 1
