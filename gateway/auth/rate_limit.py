"""Per-key rate limits, requests and tokens per minute, shared by every gateway via Redis.

Each limit is a token bucket that holds a minute's worth (a key may burst up to
its per-minute limit, then goes at limit/60 per second). A request is admitted
while its key has a request left and, if the request carries tokens, while the
token bucket is above zero; its tokens are then taken in full, so one large
request (a bulk job) may take the bucket below zero and the key waits until it
has refilled: it is never refused forever for being larger than a minute's
budget, and it never gets more than its budget over time.

The buckets live in Redis (SHOAL_REDIS_URL), updated by one Lua script, so all
gateways of a fleet count together. While Redis cannot be reached each gateway
process counts alone (the limit then holds per process: N gateways admit up
to N times it); that is logged once, and Redis is tried again every
`RETRY_REDIS_S`.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter

from gateway.auth.key_file import ApiKey

log = logging.getLogger(__name__)

RETRY_REDIS_S = 5.0
REDIS_TIMEOUT_S = 0.5
REQUESTS, TOKENS = "requests", "tokens"
LOCAL_DECISIONS = Counter(
    "shoal_gateway_rate_limit_local_total", "rate-limit decisions this gateway process made "
    "alone because Redis (SHOAL_REDIS_URL) was not reachable (limits then hold per process)")

# KEYS[1]: the key's bucket hash. ARGV: requests/min (0: none), tokens/min (0: none),
# this request's tokens, 1 to charge without admission (tokens counted after the fact).
# Returns {admitted 0|1, ms to wait, 1 = requests | 2 = tokens}.
_ADMIT = """
local rpm, tpm, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local s = redis.call('HMGET', KEYS[1], 'r', 't', 'at')
local elapsed = 0
if s[3] then elapsed = math.max(0, now - tonumber(s[3])) end
local r, tk = rpm, tpm
if s[1] then r = math.min(rpm, tonumber(s[1]) + elapsed * rpm / 60) end
if s[2] then tk = math.min(tpm, tonumber(s[2]) + elapsed * tpm / 60) end
local wait, which = 0, 0
if ARGV[4] ~= '1' then
  if rpm > 0 and r < 1 then
    wait, which = (1 - r) * 60000 / rpm, 1
  elseif tpm > 0 and cost > 0 and tk <= 0 then
    wait, which = (1 - tk) * 60000 / tpm, 2
  end
  if wait == 0 then r = r - 1 end
end
if wait == 0 and tpm > 0 then tk = tk - cost end
redis.call('HSET', KEYS[1], 'r', r, 't', tk, 'at', now)
local debt = 0
if tpm > 0 and tk < 0 then debt = -tk / tpm end
redis.call('PEXPIRE', KEYS[1], math.ceil(60000 * (1 + debt)) + 1000)
if wait > 0 then return {0, math.ceil(wait), which} end
return {1, 0, 0}
"""


@dataclass(frozen=True, slots=True)
class Verdict:
    admitted: bool
    retry_after_s: float = 0.0
    limit: str = ""  # REQUESTS or TOKENS: which one refused


ADMITTED = Verdict(True)


class LocalBuckets:
    """The same buckets in this process only: the fallback while Redis is away."""

    def __init__(self) -> None:
        self._state: dict[str, tuple[float, float, float]] = {}

    def admit(self, key: ApiKey, tokens: int, charge_only: bool = False) -> Verdict:
        rpm = key.requests_per_minute or 0
        tpm = key.tokens_per_minute or 0
        now = time.monotonic()
        r, tk, at = self._state.get(key.bucket, (rpm, tpm, now))
        elapsed = max(0.0, now - at)
        r = min(rpm, r + elapsed * rpm / 60)
        tk = min(tpm, tk + elapsed * tpm / 60)
        verdict = ADMITTED
        if not charge_only:
            if rpm and r < 1:
                verdict = Verdict(False, (1 - r) * 60 / rpm, REQUESTS)
            elif tpm and tokens > 0 and tk <= 0:
                verdict = Verdict(False, (1 - tk) * 60 / tpm, TOKENS)
            else:
                r -= 1
        if verdict.admitted and tpm:
            tk -= tokens
        self._state[key.bucket] = (r, tk, now)
        return verdict


class RateLimiter:
    """Admit or refuse a key's request against its limits; keys without limits cost nothing."""

    def __init__(self, redis_url: str, prefix: str) -> None:
        self.redis_url = redis_url
        self.prefix = prefix
        self.local = LocalBuckets()
        self._redis: Any = None
        self._script: Any = None
        self._redis_down_until = 0.0  # monotonic; until then, count locally

    def _client(self) -> Any:
        if self._redis is None:
            import redis.asyncio  # imported on first use, as gateway.jobs.store does

            self._redis = redis.asyncio.from_url(
                self.redis_url, socket_timeout=REDIS_TIMEOUT_S,
                socket_connect_timeout=REDIS_TIMEOUT_S)
            self._script = self._redis.register_script(_ADMIT)
        return self._script

    async def admit(self, key: ApiKey, tokens: int) -> Verdict:
        """Whether `key` may make a request carrying `tokens` now (and count it if so)."""
        if not key.limited:
            return ADMITTED
        return await self._run(key, tokens, charge_only=False)

    async def charge(self, key: ApiKey, tokens: int) -> None:
        """Count `tokens` a request turned out to carry (a body without Content-Length)."""
        if key.tokens_per_minute is not None and tokens > 0:
            await self._run(key, tokens, charge_only=True)

    async def _run(self, key: ApiKey, tokens: int, charge_only: bool) -> Verdict:
        if time.monotonic() >= self._redis_down_until:
            try:
                admitted, wait_ms, which = await self._client()(
                    keys=[f"{self.prefix}:ratelimit:{key.bucket}"],
                    args=[key.requests_per_minute or 0, key.tokens_per_minute or 0, tokens,
                          1 if charge_only else 0])
            except Exception as exc:  # a Redis failure (any of its types): count locally
                if not _redis_error(exc):
                    raise
                self._redis_down(exc)
            else:
                if self._redis_down_until:
                    log.warning("rate limits: Redis is back; limits are shared by every "
                                "gateway again")
                    self._redis_down_until = 0.0
                if admitted:
                    return ADMITTED
                return Verdict(False, wait_ms / 1000, REQUESTS if which == 1 else TOKENS)
        LOCAL_DECISIONS.inc()
        return self.local.admit(key, tokens, charge_only)

    def _redis_down(self, exc: Exception) -> None:
        if not self._redis_down_until:  # once per outage, not once per request
            log.warning("rate limits: Redis (SHOAL_REDIS_URL) is not reachable (%s); each "
                        "gateway process counts its keys' requests alone until it is back",
                        exc)
        self._redis_down_until = time.monotonic() + RETRY_REDIS_S

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()


def _redis_error(exc: Exception) -> bool:
    # By module, not class: redis is imported only once a limited key is used.
    return type(exc).__module__.startswith("redis") or isinstance(exc, OSError)


def retry_after_header(seconds: float) -> int:
    """Whole seconds for Retry-After, at least 1."""
    return max(1, math.ceil(seconds))
