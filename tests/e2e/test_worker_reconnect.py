"""A worker whose remote-control (pidbox) queue is still held by another connection waits
it out and comes up, instead of exiting: what a worker meets when it fails over to another
node before the node it lost has let go of its exclusive queue (bench.faults
broker-node-stop found workers exiting there with RESOURCE_LOCKED)."""

from __future__ import annotations

import socket
import uuid

from kombu import Connection

from tests.conftest import TINY_CLS
from tests.stack import BROKER_URL, private_stack, wait_for


def test_a_locked_pidbox_queue_is_waited_out_not_fatal(tmp_path):
    from app.celery import app

    name = f"locked-{uuid.uuid4().hex[:6]}"
    node = f"{name}@{socket.gethostname()}"
    with private_stack(tmp_path, "pidbox", TINY_CLS) as private:
        with Connection(BROKER_URL) as holder:
            holder.default_channel.queue_declare(queue=f"{node}.celery.pidbox",
                                                 exclusive=True, auto_delete=True)
            worker = private.stack.worker(name, [TINY_CLS], SHOAL_QUEUE_PREFIX=private.prefix)
            wait_for(lambda: "RESOURCE_LOCKED" in worker.log(), 180,
                     "the worker to meet its locked pidbox queue",
                     give_up=lambda: None if worker.alive() else "the worker exited")
            assert worker.alive()
        # The holder's connection is closed, and its exclusive queue with it: the worker
        # must now declare it, and answer remote control through it.
        replies = wait_for(lambda: app.control.ping(destination=[node], timeout=1.0), 120,
                           "the worker to answer a ping once its queue is free",
                           give_up=lambda: None if worker.alive() else "the worker exited")
        assert any(node in reply for reply in replies)
        assert worker.alive()
