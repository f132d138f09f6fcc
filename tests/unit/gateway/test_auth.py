"""API keys: hashing, the keys file, constant-time lookup, the rate limiter (on the real
Redis), secrets masked in output, guest kept on loopback, Flower's password file."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import stat
import uuid
from pathlib import Path

import pytest
import yaml

from app.cli.flower import flower_env, flower_password
from gateway.auth import key_file as api_keys
from gateway.auth.key_file import (
    ApiKey,
    KeyEntry,
    KeyFileError,
    KeyRing,
    hash_key,
    load_key_ring,
    new_key,
    parse_key_file,
)
from gateway.auth.key_middleware import KeySource, bearer_key
from gateway.auth.rate_limit import LOCAL_DECISIONS, REQUESTS, TOKENS, RateLimiter
from tasks.redact import guest_off_loopback, mask_url, masked_settings
from tasks.settings import Settings
from tests.stack import free_port

REDIS_URL = os.environ.get("SHOAL_REDIS_URL", "redis://127.0.0.1:6379/0")


def _key(name: str = "k", models: tuple[str, ...] = ("*",), rpm: int | None = None,
         tpm: int | None = None, secret: str | None = None) -> tuple[str, ApiKey]:
    secret = secret or new_key()
    entry = KeyEntry(name=name, hash=hash_key(secret), models=list(models),
                     requests_per_minute=rpm, tokens_per_minute=tpm)
    return secret, ApiKey.from_entry(entry)


# --- keys and the keys file -------------------------------------------------------------

def test_a_new_key_is_random_and_stored_as_its_sha256():
    a, b = new_key(), new_key()
    assert a != b and a.startswith("shoal-") and len(a) >= 6 + 43  # 256 bits, base64url
    assert hash_key(a) == "sha256:" + hashlib.sha256(a.encode()).hexdigest()
    assert a not in hash_key(a)


def test_the_ring_finds_a_key_by_its_hash_and_nothing_for_a_wrong_one():
    alice, alice_key = _key("alice")
    bob, bob_key = _key("bob")
    ring = KeyRing([alice_key, bob_key])
    assert ring.find(alice) is alice_key
    assert ring.find(bob) is bob_key
    assert ring.find(alice + "x") is None
    assert ring.find("") is None
    assert ring.find(alice_key.digest.hex()) is None  # the hash is not a key


def test_the_lookup_compares_with_every_stored_hash_in_constant_time(monkeypatch):
    keys = [_key(f"k{i}")[1] for i in range(5)]
    secret = new_key()
    keys[1] = _key("target", secret=secret)[1]
    compared: list[bytes] = []
    real = api_keys.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append(a)
        return real(a, b)

    monkeypatch.setattr(api_keys.hmac, "compare_digest", spy)
    assert KeyRing(keys).find(secret) is keys[1]
    # No early exit: the match at index 1 is compared with all five, through compare_digest.
    assert compared == [k.digest for k in keys]


def test_a_key_allows_the_models_its_globs_name():
    _, key = _key(models=("BAAI/*", "sentence-transformers/all-MiniLM-L6-v2"))
    assert key.allows("BAAI/bge-small-en-v1.5")
    assert key.allows("sentence-transformers/all-MiniLM-L6-v2")
    assert not key.allows("sentence-transformers/all-mpnet-base-v2")
    assert not key.allows("baai/bge-small-en-v1.5")  # case matters, as ids do
    assert _key()[1].allows("anything/at-all")  # the default: every model


def test_a_key_owns_its_own_jobs_and_reads_the_inputs_it_is_granted():
    plain = ApiKey.from_entry(KeyEntry(name="team-a", hash=hash_key(new_key()),
                                       inputs=["team-a/*"]))
    admin = ApiKey.from_entry(KeyEntry(name="ops", hash=hash_key(new_key()), admin=True))
    assert plain.owns("team-a") and not plain.owns("team-b")
    assert not plain.owns(None)  # a job made while keys were off is nobody's key's
    assert admin.owns("team-b") and admin.owns(None)
    assert plain.may_read_input("team-a/2026/in.jsonl")
    assert not plain.may_read_input("team-b/in.jsonl")
    assert not plain.may_read_input("jobs/1-abc/input.jsonl")  # not by a grant
    assert admin.may_read_input("team-b/in.jsonl")
    assert not ApiKey.from_entry(KeyEntry(name="b", hash=hash_key(new_key()))).admin


def test_a_key_file_in_yaml_or_json_is_read_with_its_defaults(tmp_path):
    secret, _ = _key()
    entries = [{"name": "a", "hash": hash_key(secret), "models": ["test/*"],
                "requests_per_minute": 10, "tokens_per_minute": 1000},
               {"name": "b", "hash": hash_key(new_key())}]
    for name, text in (("keys.yaml", yaml.safe_dump({"keys": entries})),
                       ("keys.json", json.dumps({"keys": entries}))):
        path = tmp_path / name
        path.write_text(text)
        ring = load_key_ring(path)
        key = ring.find(secret)
        assert key is not None and key.name == "a" and key.models == ("test/*",)
        assert (key.requests_per_minute, key.tokens_per_minute) == (10, 1000)
        b = ring.keys[1]
        assert b.models == ("*",) and b.requests_per_minute is None and not b.limited


X, Y = hash_key("x"), hash_key("y")


@pytest.mark.parametrize(("text", "says"), [
    ("keys: [{name: a, hash: 'sha256:abc'}]", "keys.0.hash"),
    (f"keys: [{{name: a, hash: '{X}', rpm: 3}}]", "keys.0.rpm: Extra inputs"),
    (f"keys: [{{name: a, hash: '{X}', requests_per_minute: 0}}]",
     "keys.0.requests_per_minute"),
    (f"keys: [{{name: a, hash: '{X}'}}, {{name: a, hash: '{Y}'}}]",
     "two keys have the name 'a'"),
    (f"keys: [{{name: a, hash: '{X}'}}, {{name: b, hash: '{X}'}}]", "two keys have the hash"),
    ("- name: a", "expected a mapping with 'keys: [...]'"),
    ("keys: [unclosed", "not valid YAML or JSON"),
    ("{}", "keys: Field required"),
])
def test_a_bad_key_file_is_refused_saying_where_and_what(text, says):
    with pytest.raises(KeyFileError) as caught:
        parse_key_file(text, "/etc/shoal/keys.yaml")
    assert str(caught.value).startswith("/etc/shoal/keys.yaml: ")
    assert says in str(caught.value)


def test_a_missing_key_file_is_named(tmp_path):
    with pytest.raises(KeyFileError, match="cannot read the keys file"):
        load_key_ring(tmp_path / "nope.yaml")


def test_a_changed_key_file_is_read_again_and_a_broken_one_keeps_the_keys_before(
        tmp_path, caplog):
    path = tmp_path / "keys.yaml"
    old, new = new_key(), new_key()
    path.write_text(yaml.safe_dump({"keys": [{"name": "old", "hash": hash_key(old)}]}))
    source = KeySource(path, reload_s=0.001)
    assert source.current().find(old) is not None
    # Rotation: the new key in, the old one out (a new inode, as a Secret's swap makes).
    tmp = tmp_path / "keys.new"
    tmp.write_text(yaml.safe_dump({"keys": [{"name": "new", "hash": hash_key(new)}]}))
    os.replace(tmp, path)
    source._checked = 0.0
    assert source.current().find(new) is not None and source.current().find(old) is None
    tmp.write_text("keys: [{name: broken}]")
    os.replace(tmp, path)
    source._checked = 0.0
    with caplog.at_level(logging.ERROR, logger="gateway.auth.key_middleware"):
        assert source.current().find(new) is not None
    assert "keeping the 1 keys read before" in caplog.text and "keys.0.hash" in caplog.text


@pytest.mark.parametrize(("header", "key"), [
    (b"Bearer abc", "abc"), (b"bearer  abc ", "abc"), (b"Basic abc", None), (b"Bearer ", None),
    (b"abc", None),
])
def test_the_key_comes_from_a_bearer_authorization_header(header, key):
    assert bearer_key([(b"host", b"x"), (b"authorization", header)]) == key
    assert bearer_key([(b"host", b"x")]) is None


# --- shoal keys ---------------------------------------------------------------------------

def test_keys_add_prints_the_key_once_and_writes_its_hash_to_a_0600_file(tmp_path, capsys):
    from app.cli import main

    path = tmp_path / "keys.yaml"
    assert main(["keys", "add", "team-a", "--models", "test/*,BAAI/*", "--rpm", "60",
                 "--tpm", "1000", "--file", str(path)]) == 0
    out = capsys.readouterr().out
    secret = next(line for line in out.splitlines() if line.startswith("shoal-"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert secret not in path.read_text()
    key = load_key_ring(path).find(secret)
    assert key is not None and key.models == ("test/*", "BAAI/*")
    assert (key.requests_per_minute, key.tokens_per_minute) == (60, 1000)
    assert main(["keys", "add", "team-b", "--file", str(path)]) == 0
    assert [k.name for k in load_key_ring(path).keys] == ["team-a", "team-b"]
    assert main(["keys", "add", "team-a", "--file", str(path)]) == 1  # names are unique
    assert "already there" in capsys.readouterr().err
    assert main(["keys", "check", str(path)]) == 0
    assert "2 keys, valid" in capsys.readouterr().out


def test_keys_add_without_a_file_prints_an_entry_the_gateway_reads(tmp_path, capsys):
    from app.cli import main

    assert main(["keys", "add", "solo"]) == 0
    out = capsys.readouterr().out
    secret = next(line for line in out.splitlines() if line.startswith("shoal-"))
    entry_text = "\n".join(line for line in out.splitlines() if not line.startswith(("#",
                                                                                     "shoal-")))
    path = tmp_path / "keys.yaml"
    path.write_text(entry_text)
    assert load_key_ring(path).find(secret).name == "solo"


# --- rate limits on the real Redis --------------------------------------------------------

def _on_redis(body):
    """Run `body(limiter)` with a limiter on the real Redis under a prefix of its own, in one
    event loop (a redis.asyncio client belongs to its loop); its keys are deleted after."""

    async def run():
        limiter = RateLimiter(REDIS_URL, f"shoal-unit-{uuid.uuid4().hex[:8]}")
        try:
            return await body(limiter)
        finally:
            if limiter._redis is not None:
                async for name in limiter._redis.scan_iter(f"{limiter.prefix}:*"):
                    await limiter._redis.delete(name)
            await limiter.close()

    return asyncio.run(run())


def test_requests_per_minute_admit_a_burst_then_refuse_with_the_wait():
    _, key = _key(rpm=3)

    async def body(limiter):
        verdicts = [await limiter.admit(key, 0) for _ in range(4)]
        assert limiter._redis_down_until == 0.0  # counted in Redis, not locally
        return verdicts

    verdicts = _on_redis(body)
    assert [v.admitted for v in verdicts] == [True, True, True, False]
    refused = verdicts[3]
    assert refused.limit == REQUESTS
    assert 15 < refused.retry_after_s <= 20  # one request refills in 60/3 s


def test_two_gateways_share_one_key_s_budget_through_redis():
    _, key = _key(rpm=4)

    async def body(limiter):
        other = RateLimiter(REDIS_URL, limiter.prefix)  # another gateway process
        try:
            return [(await (limiter if i % 2 else other).admit(key, 0)).admitted
                    for i in range(6)]
        finally:
            await other.close()

    assert _on_redis(body) == [True, True, True, True, False, False]


def test_tokens_per_minute_let_one_large_request_through_then_make_the_key_wait():
    _, key = _key(tpm=100)

    async def body(limiter):
        return [await limiter.admit(key, 250), await limiter.admit(key, 1),
                await limiter.admit(key, 0)]

    big, next_one, no_tokens = _on_redis(body)
    assert big.admitted  # larger than a minute's budget: taken, and paid back in time
    assert not next_one.admitted and next_one.limit == TOKENS
    assert 90 < next_one.retry_after_s <= 91  # 150 tokens of debt at 100 a minute: 90 s
    assert no_tokens.admitted  # a request without tokens (a GET) is not held up by them


def test_tokens_counted_after_the_fact_are_charged():
    _, key = _key(tpm=100)

    async def body(limiter):
        await limiter.charge(key, 150)  # more than the bucket holds: the key is in debt
        return (await limiter.admit(key, 1)).admitted

    assert _on_redis(body) is False


def test_without_redis_each_process_counts_alone_and_says_so_once(caplog):
    _, key = _key(rpm=2)

    async def run() -> list[bool]:
        limiter = RateLimiter(f"redis://127.0.0.1:{free_port()}/0", "shoal-unit-down")
        out = [(await limiter.admit(key, 0)).admitted for _ in range(3)]
        limiter._redis_down_until = 1.0  # the retry is due: Redis is tried again, still down
        out.append((await limiter.admit(key, 0)).admitted)
        await limiter.close()
        return out

    before = LOCAL_DECISIONS._value.get()
    with caplog.at_level(logging.WARNING, logger="gateway.auth.rate_limit"):
        assert asyncio.run(run()) == [True, True, False, False]
    assert caplog.text.count("is not reachable") == 1
    assert LOCAL_DECISIONS._value.get() == before + 4  # counted, for an alert


def test_a_key_without_limits_never_touches_redis():
    _, key = _key()

    async def body(limiter):
        assert (await limiter.admit(key, 10**9)).admitted
        return limiter._redis

    assert _on_redis(body) is None


# --- secrets in output, guest off loopback -------------------------------------------------

def test_passwords_in_urls_are_masked_each_of_several_brokers_too():
    assert mask_url("amqp://shoal:s3cret@10.0.0.1:5672//;amqp://shoal:other@10.0.0.2//") == \
        "amqp://shoal:***@10.0.0.1:5672//;amqp://shoal:***@10.0.0.2//"
    assert mask_url("redis://:pw@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert mask_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert mask_url("amqp://u:p@host:notaport//") == "amqp://u:***@host:notaport//"
    assert mask_url("amqp://u:pw@[bad//") == "***"  # unparseable: masked whole


def test_shoal_settings_shows_no_password(capsys, monkeypatch):
    from app.cli import main
    from tasks.settings import get_settings

    monkeypatch.setenv("SHOAL_BROKER_URL", "amqp://shoal:brokerpw@127.0.0.1:5672//")
    monkeypatch.setenv("SHOAL_MANAGEMENT_URL", "http://shoal:mgmtpw@127.0.0.1:15672/api/")
    monkeypatch.setenv("SHOAL_REDIS_URL", "redis://:redispw@127.0.0.1:6379/0")
    monkeypatch.setenv("SHOAL_FLOWER_PASSWORD", "flowerpw")
    get_settings.cache_clear()
    try:
        assert main(["settings"]) == 0
    finally:
        get_settings.cache_clear()
    out = capsys.readouterr().out
    for secret in ("brokerpw", "mgmtpw", "redispw", "flowerpw"):
        assert secret not in out
    shown = json.loads(out)
    assert shown["broker_url"] == "amqp://shoal:***@127.0.0.1:5672//"
    assert shown["flower_password"] == "***"


def test_masking_keeps_unset_secrets_and_paths_visible():
    shown = masked_settings({"flower_password": None, "flower_password_file": "/x",
                             "api_keys_file": "/k", "broker_url": "amqp://a:b@h//"})
    assert shown == {"flower_password": None, "flower_password_file": "/x",
                     "api_keys_file": "/k", "broker_url": "amqp://a:***@h//"}


@pytest.mark.parametrize(("urls", "host"), [
    ("amqp://guest:guest@127.0.0.1:5672//", None),
    ("amqp://guest:guest@localhost//", None),
    ("amqp://guest:guest@[::1]:5672//", None),
    ("amqp://shoal:pw@10.0.0.5//", None),
    ("amqp://guest:guest@10.0.0.5:5672//", "10.0.0.5"),
    ("amqp://guest:guest@127.0.0.1//;amqp://guest:guest@rabbit-2//", "rabbit-2"),
])
def test_guest_is_refused_only_off_loopback(urls, host):
    assert guest_off_loopback(urls) == host


def test_settings_refuse_guest_for_a_remote_broker_saying_what_to_set():
    with pytest.raises(ValueError, match="SHOAL_BROKER_URL uses guest:guest on rabbit") as e:
        Settings(broker_url="amqp://guest:guest@rabbit:5672//")
    assert "rabbitmqctl add_user" in str(e.value)
    with pytest.raises(ValueError, match="SHOAL_MANAGEMENT_URL"):
        Settings(management_url="http://guest:guest@10.1.2.3:15672/api/")
    Settings(broker_url="amqp://shoal:pw@rabbit:5672//")  # a user of its own is fine


def test_settings_errors_do_not_echo_other_settings():
    with pytest.raises(ValueError) as caught:
        Settings(broker_url="amqp://shoal:topsecret@rabbit//", broker_heartbeat="nan-ish")
    assert "topsecret" not in str(caught.value)


# --- Flower --------------------------------------------------------------------------------

def test_flower_s_password_is_made_once_into_a_0600_file(tmp_path):
    path = tmp_path / "conf" / "flower-password"
    password, made = flower_password(path)
    assert made and len(password) >= 24 and "," not in password and ":" not in password
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert flower_password(path) == (password, False)


def test_flower_gets_its_credentials_in_its_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWER_UNAUTHENTICATED_API", "true")
    settings = Settings(flower_password_file=tmp_path / "pw",
                        management_url="http://shoal:mgmtpw@127.0.0.1:15672/api/")
    env = flower_env(settings, "127.0.0.1", 5599)
    password = Path(tmp_path / "pw").read_text().strip()
    assert env["FLOWER_BASIC_AUTH"] == f"shoal:{password}"
    assert env["FLOWER_BROKER_API"] == "http://shoal:mgmtpw@127.0.0.1:15672/api/"
    assert env["FLOWER_PORT"] == "5599" and "FLOWER_UNAUTHENTICATED_API" not in env
    given = Settings(flower_password="given", flower_user="ops")
    assert flower_env(given, "127.0.0.1", 1)["FLOWER_BASIC_AUTH"] == "ops:given"


def test_flower_says_where_its_password_is_never_what_it_is(tmp_path, capsys):
    settings = Settings(flower_password_file=tmp_path / "pw")
    flower_env(settings, "127.0.0.1", 5555)
    said = capsys.readouterr().err
    assert str(tmp_path / "pw") in said and "generated" in said
    assert (tmp_path / "pw").read_text().strip() not in said


def test_the_worker_s_metrics_stay_on_loopback_unless_set(monkeypatch):
    assert Settings().worker_metrics_host == "127.0.0.1"
    monkeypatch.setenv("SHOAL_WORKER_METRICS_HOST", "0.0.0.0")
    assert Settings().worker_metrics_host == "0.0.0.0"
