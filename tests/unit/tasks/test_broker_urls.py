"""Several broker URLs (`;`-separated), the bounded reconnect back-off, the link metrics."""

from __future__ import annotations

import asyncio
import uuid
from itertools import islice

import pytest
from kombu import Connection
from prometheus_client import REGISTRY
from yarl import URL

from app.worker.reconnect import ReconnectingConsumer, reconnect_intervals
from gateway.broker.failover import FailoverConnection
from tasks.broker_metrics import BrokerLink
from tasks.broker_urls import celery_broker_url, endpoint, split_urls
from tasks.settings import Settings

A = "amqp://guest:guest@127.0.0.1:5681//"
B = "amqp://guest:guest@127.0.0.1:5682//"
C = "amqp://user:s3cret@broker-3.example:5672/shoal"


def test_one_url_is_taken_unchanged():
    assert split_urls(A) == [A]
    assert celery_broker_url(A) == A


def test_several_urls_keep_their_order_and_lose_blanks_and_empty_entries():
    assert split_urls(f" {A} ;{B};; {C} ;") == [A, B, C]
    assert celery_broker_url(f"{A} ; {B}") == f"{A};{B}"


@pytest.mark.parametrize("value", ["", " ; ;", "127.0.0.1:5672", f"{A};not a url"])
def test_no_url_or_a_malformed_entry_is_refused(value):
    with pytest.raises(ValueError):
        split_urls(value)


def test_the_refusal_does_not_repeat_the_entry_which_may_hold_a_password():
    with pytest.raises(ValueError) as refused:
        split_urls(f"{A};guest:hunter2@nowhere")
    assert "hunter2" not in str(refused.value)
    assert "entry 2 of 2" in str(refused.value)


def test_endpoint_names_host_and_port_only():
    assert endpoint(C) == "broker-3.example:5672"
    assert endpoint("amqp://guest:**@127.0.0.1:5683//") == "127.0.0.1:5683"
    assert endpoint("amqp://localhost") == "localhost"


def test_kombu_fails_over_across_the_same_list_celery_gets():
    """Celery hands the string to kombu, which must see every node as an alternate."""
    conn = Connection(celery_broker_url(f"{A}; {B} ;{C}"), failover_strategy="round-robin")
    assert conn.alt == [A, B, C]
    assert conn.as_uri().startswith("amqp://guest:**@127.0.0.1:5681")


def test_the_settings_accept_a_list_in_shoal_broker_url(monkeypatch):
    monkeypatch.setenv("SHOAL_BROKER_URL", f"{A};{B}")
    monkeypatch.setenv("SHOAL_BROKER_RECONNECT_MAX_S", "0.5")
    settings = Settings()
    assert split_urls(settings.broker_url) == [A, B]
    assert settings.broker_reconnect_max_s == 0.5


@pytest.mark.parametrize("bound", [0.1, 1.0, 2.0, 5.0])
def test_the_reconnect_back_off_never_exceeds_its_bound(bound):
    """kombu's retry_over_time sleeps min(value, interval_max) of this range."""
    from kombu.utils.functional import fxrange

    args = reconnect_intervals(bound)
    sleeps = [min(v, args["interval_max"]) for v in islice(fxrange(
        args["interval_start"], args["interval_max"] + args["interval_start"],
        args["interval_step"], repeatlast=True), 50)]
    assert max(sleeps) <= bound
    assert sleeps[-1] == pytest.approx(bound)  # it grows to the bound and stays there
    assert sleeps[0] > 0  # a node that is down is not hammered


def test_the_worker_consumer_drops_celerys_native_delayed_delivery():
    steps = ReconnectingConsumer.Blueprint.default_steps
    assert not any(step.endswith(":DelayedDelivery") for step in steps)
    assert any(step.endswith(":Connection") for step in steps)


def test_the_celery_app_fails_over_and_never_gives_up():
    from app.celery import app

    assert app.conf.broker_connection_max_retries is None
    assert app.conf.broker_failover_strategy == "round-robin"
    assert app.conf.worker_consumer is ReconnectingConsumer


def _sample(name: str) -> float:
    value = REGISTRY.get_sample_value(name)
    assert value is not None, name
    return value


def test_the_link_metrics_show_an_outage_and_its_length():
    prefix = f"test_{uuid.uuid4().hex[:8]}"
    link = BrokerLink(prefix, "test")
    assert _sample(f"{prefix}_broker_connected") == 0
    link.connected("127.0.0.1:5681")  # the first connection is no reconnect
    assert _sample(f"{prefix}_broker_connected") == 1
    assert _sample(f"{prefix}_broker_reconnects_total") == 0
    link.lost("reset")
    link.lost("reset again")  # one outage, however often it is reported
    assert _sample(f"{prefix}_broker_connected") == 0
    assert not link.up
    link.connected("127.0.0.1:5682")
    assert link.up and link.endpoint == "127.0.0.1:5682"
    assert _sample(f"{prefix}_broker_reconnects_total") == 1
    assert _sample(f"{prefix}_broker_disconnected_seconds_total") > 0


def test_the_gateway_connection_goes_round_the_urls():
    async def main() -> list[str]:
        conn = FailoverConnection(URL(A), urls=[A, B, C])
        seen = [conn.endpoint]
        for _ in range(3):
            conn._advance()
            seen.append(conn.endpoint)
        return seen

    assert asyncio.run(main()) == ["127.0.0.1:5681", "127.0.0.1:5682",
                                   "broker-3.example:5672", "127.0.0.1:5681"]


def test_failed_attempts_are_logged_once_in_a_while_not_each_time():
    from app.worker.reconnect import _quieted

    logged: list[float] = []
    quiet = _quieted(lambda exc, interval: logged.append(interval))
    for i in range(30):
        quiet(ConnectionRefusedError(), float(i))
    assert logged == [0.0]  # the first, then nothing within QUIET_LOG_S
    assert _quieted(None) is None
