"""Paused jobs that outlive their gateway, and revokes sent again until the broker takes
them (issue 53).

A job's driver pauses when Redis goes away; its gateway is then restarted (a new
JobDriver) while Redis is still away. The new gateway finds the paused job in the blob
store (`gateway.jobs.paused_jobs`) and, once Redis answers: revokes its parts and deletes
its folder if Redis came back without it; drives it again if Redis kept it. A revoke that
the broker does not take (it is away) is sent again until it does.

A real Redis of the test's own (tests/private_redis.py), killed and started again; in
place of the gateway's broker link, a recorder of what the driver publishes and revokes
(tests/unit/gateway/test_job_driver_redis_loss.py), which may refuse revokes for a while.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from gateway.jobs.driver import JobDriver
from gateway.jobs.part_replies import part_id
from gateway.jobs.part_revokes import PartRevokes
from gateway.jobs.paused_jobs import RECORD
from gateway.jobs.store import CANCELLED, JobStore
from tasks.blobs import BlobStore
from tests.private_redis import PrivateRedis
from tests.unit.gateway.test_job_driver_redis_loss import (
    IN_FLIGHT,
    Recorder,
    started_job,
    until,
)


class AwayBroker(Recorder):
    """A recorder that does not take revokes while `away` (as `Broker.cancel` answers
    False without a connection)."""

    def __init__(self) -> None:
        super().__init__()
        self.away = False
        self.refused: list[str] = []

    async def cancel(self, task_ids: list[str]) -> bool:
        if self.away:
            self.refused.extend(task_ids)
            return False
        self.cancelled.extend(task_ids)
        return True


def restart_while_redis_is_away(tmp_path: Path, persist: bool) -> dict[str, object]:
    """A job paused for want of Redis; its gateway restarted; Redis back (empty unless
    `persist`). What the new gateway revoked (`revoked`, the job's parts out: `parts`),
    whether the folder is there and the new gateway drives the job, once it has settled."""
    redis = PrivateRedis(tmp_path / "redis", persist=persist)
    redis.start()
    outcome: dict[str, object] = {}

    async def main() -> None:
        first, _, store, folder, job_id = await started_job(redis, tmp_path)
        redis.kill()
        await until(lambda: job_id in first._orphans, "the driver to pause")
        assert (folder / RECORD).exists()  # the pause is recorded in the job's folder
        await first.close()  # the gateway restarts while Redis is away
        blobs = BlobStore(first.settings.blob_url)
        broker = Recorder()
        second = JobDriver(first.settings, JobStore(redis.url, store.prefix, 60), broker,
                           first.served, lambda: blobs)
        second.start()
        try:
            await until(lambda: job_id in second._orphans, "the new gateway to find the job")
            redis.start()
            if persist:
                await until(lambda: job_id in second._driving and not second._orphans,
                            "the job to be driven again")
                await until(lambda: not (folder / RECORD).exists(), "the record to go")
            else:
                await until(lambda: not folder.exists(), "the job's folder to be deleted")
            outcome.update(revoked=list(broker.cancelled), folder=folder.exists(),
                           driven=job_id in second._driving,
                           parts=[part_id(job_id, i) for i in range(IN_FLIGHT)])
        finally:
            await second.close()
            await second.store.close()
            await store.close()

    try:
        asyncio.run(main())
    finally:
        redis.stop()
    return outcome


def test_a_gateway_restarted_while_redis_was_away_stops_a_job_redis_lost(tmp_path):
    found = restart_while_redis_is_away(tmp_path, persist=False)
    assert found["revoked"] == found["parts"]  # every part it had out
    assert not found["folder"] and not found["driven"]


def test_a_gateway_restarted_while_redis_was_away_resumes_a_job_redis_kept(tmp_path):
    found = restart_while_redis_is_away(tmp_path, persist=True)
    assert found["revoked"] == [] and found["folder"] and found["driven"]


def test_a_revoke_the_broker_did_not_take_is_sent_again_until_it_does(tmp_path):
    redis = PrivateRedis(tmp_path / "redis")
    redis.start()

    async def main() -> None:
        driver, _, store, folder, job_id = await started_job(redis, tmp_path)
        broker = AwayBroker()
        driver.broker = driver._parts.broker = broker
        driver.revokes = driver._parts.revokes = PartRevokes(broker, retry_s=0.1)
        try:
            broker.away = True  # RabbitMQ is down when the job is cancelled
            assert await store.finish(job_id, CANCELLED)
            await driver.revoke(job_id, IN_FLIGHT)
            parts = [part_id(job_id, i) for i in range(IN_FLIGHT)]
            await until(lambda: set(parts) <= set(broker.refused), "a revoke refused")
            assert broker.cancelled == []
            await until(lambda: len(broker.refused) >= 3 * IN_FLIGHT, "tries again")
            broker.away = False  # back: the parts are revoked, once taken
            await until(lambda: set(parts) <= set(broker.cancelled), "the revoke taken")
            await until(lambda: not driver.revokes.waiting, "nothing left to send")
            # Its folder went with the cancel, its driver's at once (not the hourly sweep).
            await until(lambda: not folder.exists(), "the cancelled job's folder to go")
        finally:
            await driver.close()
            await store.close()

    try:
        asyncio.run(main())
    finally:
        redis.stop()


def test_a_broker_without_a_connection_does_not_take_a_revoke():
    from gateway.broker.streams import ReplyStreams

    streams = ReplyStreams(None, None, lambda: False, None, lambda: None)  # type: ignore[arg-type]
    assert asyncio.run(streams.cancel(["a.0"])) is False
