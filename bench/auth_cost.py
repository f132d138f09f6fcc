"""What an API key costs a request: the gateway's key middleware timed alone, in-process.

    .venv/bin/python -m bench.auth_cost [--keys 1,10,100] [--n 20000]

Times, per request, the key lookup (SHA-256 of the presented key and a constant-time
compare with every stored hash) and the whole middleware around an app that does
nothing: for a key without limits (no I/O) and for a rate-limited key (one Lua call
to the real Redis, SHOAL_REDIS_URL). Prints microseconds per request.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid

from gateway.auth.key_file import ApiKey, KeyEntry, KeyRing, hash_key, new_key
from gateway.auth.key_middleware import ApiKeyMiddleware
from gateway.auth.rate_limit import RateLimiter


def _ring(count: int, limited: bool) -> tuple[str, KeyRing]:
    secrets_ = [new_key() for _ in range(count)]
    keys = [ApiKey.from_entry(KeyEntry(
        name=f"k{i}", hash=hash_key(s), requests_per_minute=10**9 if limited else None,
        tokens_per_minute=10**12 if limited else None)) for i, s in enumerate(secrets_)]
    return secrets_[-1], KeyRing(keys)


class _Source:
    def __init__(self, ring: KeyRing) -> None:
        self.ring = ring

    def current(self) -> KeyRing:
        return self.ring


async def _noop_app(scope, receive, send) -> None:
    return None


def _lookup_us(count: int, n: int) -> float:
    presented, ring = _ring(count, limited=False)
    started = time.perf_counter()
    for _ in range(n):
        ring.find(presented)
    return (time.perf_counter() - started) / n * 1e6


async def _middleware_us(count: int, n: int, limited: bool) -> float:
    presented, ring = _ring(count, limited)
    limiter = RateLimiter(os.environ.get("SHOAL_REDIS_URL", "redis://127.0.0.1:6379/0"),
                          f"shoal-bench-{uuid.uuid4().hex[:8]}")
    middleware = ApiKeyMiddleware(_noop_app, _Source(ring), limiter)  # type: ignore[arg-type]
    headers = [(b"host", b"x"), (b"authorization", f"Bearer {presented}".encode()),
               (b"content-type", b"application/json"), (b"content-length", b"64")]

    async def one() -> None:
        scope = {"type": "http", "path": "/v1/embeddings", "method": "POST",
                 "headers": headers, "state": {}}
        await middleware(scope, None, None)

    for _ in range(200):  # warm: the Redis connection, the script's SHA
        await one()
    started = time.perf_counter()
    for _ in range(n):
        await one()
    elapsed = time.perf_counter() - started
    if limiter._redis is not None:
        async for name in limiter._redis.scan_iter(f"{limiter.prefix}:*"):
            await limiter._redis.delete(name)
    await limiter.close()
    return elapsed / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", default="1,10,100")
    parser.add_argument("--n", type=int, default=20_000)
    args = parser.parse_args()
    print("keys  lookup_us  middleware_us(no limits)  middleware_us(limits, Redis)")
    for count in (int(k) for k in args.keys.split(",")):
        lookup = _lookup_us(count, args.n)
        open_ = asyncio.run(_middleware_us(count, args.n, limited=False))
        limited = asyncio.run(_middleware_us(count, max(1, args.n // 10), limited=True))
        print(f"{count:>4}  {lookup:9.2f}  {open_:24.2f}  {limited:28.1f}")


if __name__ == "__main__":
    main()
