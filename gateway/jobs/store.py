"""Jobs' state in Redis, so that any gateway answers for any job and a job outlives the
gateway that accepted it.

Keys (under the queue prefix, so stacks on other prefixes never meet):

- `{prefix}:job:{id}` hash: the job (state, operation, model, options, where its files
  are, counts, timestamps as epoch seconds, the error or inline result);
- `{prefix}:job:{id}:parts` hash: part index -> its recorded result (msgpack). HSETNX
  makes a duplicate result (a redelivery, a part published twice across a takeover)
  count once;
- `{prefix}:job:{id}:lease`: the gateway that drives the job (publishes its parts,
  gathers its result), with a TTL its owner renews;
- `{prefix}:jobs:active`: ids of jobs not yet finished, which every gateway scans for
  leases to take over;
- `{prefix}:jobs:key:{name}` (`{prefix}:jobs:open` with API keys off): the ids of a key's
  jobs, for its limits and fair share (`gateway.jobs.key_jobs`).

Counting and state changes are Lua scripts: a gateway that dies between two commands
must not leave a part recorded but not counted.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import orjson

log = logging.getLogger(__name__)

QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = (
    "queued", "running", "succeeded", "failed", "cancelled")
ACTIVE_STATES = frozenset({QUEUED, RUNNING})

# Record a part's result once; returns parts_done after it, -1 if the job is no longer
# active (a late result of a cancelled or failed job), -2 for a duplicate.
_RECORD = """
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'queued' and state ~= 'running' then return -1 end
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 0 then return -2 end
redis.call('HINCRBY', KEYS[1], 'items_done', ARGV[3])
return redis.call('HINCRBY', KEYS[1], 'parts_done', 1)
"""
# Move active job ARGV[3] to a final state (ARGV[1]) with extra fields (ARGV[4..], name
# value pairs), start the TTL (ARGV[2]) of its keys; 0 if it was already final.
_FINISH = """
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'queued' and state ~= 'running' then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[1])
for i = 4, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[2])
redis.call('EXPIRE', KEYS[4], ARGV[2])
redis.call('SREM', KEYS[3], ARGV[3])
return 1
"""
# Set fields (ARGV: name value pairs) of a job that is still active; 0 (nothing written)
# when its hash is gone (expired, or lost with a Redis that does not persist) or final: a
# write must never make a vanished job's hash again, with no state and no TTL.
_UPDATE = """
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'queued' and state ~= 'running' then return 0 end
for i = 1, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""
# The same for the splitter's resume point, with the items of the part just published
# (ARGV[1] its index, ARGV[2] "first-last") in the ranges hash (KEYS[2]), in one step.
_PUBLISHED = """
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'queued' and state ~= 'running' then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""
# Renew a lease only if we still hold it.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""


@dataclass(slots=True)
class Job:
    """A job as stored. `published`/`offset`: parts published so far and where the next
    one starts in the input file (the splitter's resume point)."""

    id: str
    operation: str
    model: str
    state: str = QUEUED
    options: dict[str, Any] = field(default_factory=dict)
    query: str | None = None
    bulk: bool = False
    folder: str = ""  # blob store folder of its files (bulk)
    input: str = ""  # blob key of its input (bulk)
    owns_input: bool = True  # uploaded with the job (deleted with it) or the caller's
    part_items: int = 0
    parts_total: int = 0
    items_total: int = 0
    parts_done: int = 0
    items_done: int = 0
    published: int = 0
    offset: int = 0
    next_item: int = 0  # the first item of the next part to publish (0-based)
    created_at: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    error: dict[str, Any] | None = None
    result: Any = None  # inline jobs: the response payload
    result_file: str = ""  # bulk: blob key of the gathered result
    result_type: str = ""  # bulk: "npy" or "jsonl"
    owner: str | None = None  # the name of the API key that created it (None: keys off)
    # The OpenAI batch whose lines it runs, one part per line (`gateway.jobs.batch_output`)
    batch: str = ""

    def to_redis(self) -> dict[str, bytes | str | int | float]:
        out: dict[str, Any] = {}
        for name in self.__slots__:  # type: ignore[attr-defined]
            value = getattr(self, name)
            if value is None:
                continue
            if name in ("options", "error", "result"):
                value = msgpack.packb(value, use_bin_type=True)
            elif isinstance(value, bool):
                value = int(value)
            out[name] = value
        return out

    @classmethod
    def from_redis(cls, raw: dict[bytes, bytes]) -> Job:
        fields: dict[str, Any] = {}
        for key, value in raw.items():
            name = key.decode()
            if name in ("options", "error", "result"):
                fields[name] = msgpack.unpackb(value, raw=False)
            elif name in _INTS:
                fields[name] = int(value)
            elif name in _FLOATS:
                fields[name] = float(value)
            elif name == "bulk" or name == "owns_input":
                fields[name] = value == b"1"
            elif name in _STRS:
                fields[name] = value.decode()
        return cls(**fields)

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES


_INTS = {"part_items", "parts_total", "items_total", "parts_done", "items_done", "published",
         "offset", "next_item"}
_FLOATS = {"created_at", "started_at", "finished_at"}
_STRS = {"id", "operation", "model", "state", "query", "folder", "input", "result_file",
         "result_type", "owner", "batch"}


class JobStore:
    def __init__(self, redis_url: str, prefix: str, ttl_s: float) -> None:
        self.redis_url = redis_url
        self.prefix = prefix
        self.ttl_s = max(1, int(ttl_s))
        self._redis: Any = None

    @property
    def redis(self) -> Any:
        if self._redis is None:
            # Imported on first use: redis.asyncio takes ~0.1 s to import, and a gateway
            # that never sees a job need not pay it at start.
            import redis.asyncio

            self._redis = redis.asyncio.from_url(self.redis_url)
            self._record = self._redis.register_script(_RECORD)
            self._finish = self._redis.register_script(_FINISH)
            self._update = self._redis.register_script(_UPDATE)
            self._published = self._redis.register_script(_PUBLISHED)
            self._renew = self._redis.register_script(_RENEW)
        return self._redis

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()

    # --- keys -----------------------------------------------------------------------------

    def key(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    def parts_key(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}:parts"

    def ranges_key(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}:ranges"

    def lease_key(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}:lease"

    @property
    def active_key(self) -> str:
        return f"{self.prefix}:jobs:active"

    def owner_key(self, owner: str | None) -> str:
        """The set of a key's jobs (`gateway.jobs.key_jobs`); None: API keys are off."""
        return f"{self.prefix}:jobs:open" if owner is None else f"{self.prefix}:jobs:key:{owner}"

    # --- jobs -----------------------------------------------------------------------------

    async def create(self, job: Job) -> None:
        job.created_at = job.created_at or time.time()
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.key(job.id), mapping=job.to_redis())
            pipe.sadd(self.active_key, job.id)
            pipe.sadd(self.owner_key(job.owner), job.id)
            await pipe.execute()

    async def get(self, job_id: str) -> Job | None:
        raw = await self.redis.hgetall(self.key(job_id))
        return Job.from_redis(raw) if raw else None

    async def active_ids(self) -> list[str]:
        return [m.decode() for m in await self.redis.smembers(self.active_key)]

    async def forget(self, job_id: str) -> None:
        """Drop an active-set entry whose job hash is gone (expired or never written)."""
        await self.redis.srem(self.active_key, job_id)

    async def set_fields(self, job_id: str, **fields: Any) -> None:
        await self.redis.hset(self.key(job_id), mapping=fields)

    async def update(self, job_id: str, **fields: Any) -> bool:
        """Set `fields` of an active job; False (nothing written) if it is gone or final."""
        self.redis  # noqa: B018  # registers the scripts
        args = [v for item in fields.items() for v in item]
        return bool(await self._update(keys=[self.key(job_id)], args=args))

    async def mark_running(self, job_id: str) -> bool:
        """queued -> running, once (a takeover keeps the first start time); False if the
        job is gone or final."""
        job = await self.get(job_id)
        if job is None or not job.active:
            return False
        if job.started_at is not None:
            return True
        return await self.update(job_id, started_at=time.time(), state=RUNNING)

    async def published(self, job_id: str, parts: int, offset: int, first_item: int,
                        items: int) -> bool:
        """The splitter's resume point: `parts` published, the next starts at `offset`;
        the last one holds items `first_item`.. (0-based) `items` of them. False if the
        job is gone or final (nothing written)."""
        self.redis  # noqa: B018
        return bool(await self._published(
            keys=[self.key(job_id), self.ranges_key(job_id)],
            args=[parts - 1, f"{first_item + 1}-{first_item + items}", "published", parts,
                  "offset", offset, "next_item", first_item + items]))

    async def part_range(self, job_id: str, index: int) -> tuple[str, str]:
        """The items (counted from 1) part `index` holds, as published."""
        raw = await self.redis.hget(self.ranges_key(job_id), str(index))
        first, _, last = (raw or b"?-?").decode().partition("-")
        return first, last

    async def record(self, job_id: str, index: int, value: bytes, items: int) -> int:
        """Record part `index` (see _RECORD for the answer)."""
        self.redis  # noqa: B018  # registers the scripts
        return int(await self._record(keys=[self.key(job_id), self.parts_key(job_id)],
                                      args=[index, value, items]))

    async def parts(self, job_id: str) -> dict[int, bytes]:
        raw = await self.redis.hgetall(self.parts_key(job_id))
        return {int(k): v for k, v in raw.items()}

    async def recorded(self, job_id: str) -> set[int]:
        return {int(k) for k in await self.redis.hkeys(self.parts_key(job_id))}

    async def finish(self, job_id: str, state: str, **fields: Any) -> bool:
        """Move an active job to `state` (succeeded, failed, cancelled); False if it was
        already final (cancelled meanwhile, or failed by another gateway)."""
        self.redis  # noqa: B018
        args: list[Any] = [state, self.ttl_s, job_id]
        for name, value in {"finished_at": time.time(), **fields}.items():
            if name in ("error", "result"):
                value = msgpack.packb(value, use_bin_type=True)
            args += [name, value]
        return bool(await self._finish(
            keys=[self.key(job_id), self.parts_key(job_id), self.active_key,
                  self.ranges_key(job_id)], args=args))

    async def persistence(self) -> list[str]:
        """How Redis keeps the jobs over its restart: "aof" (appendonly yes) and/or "rdb"
        (a `save` schedule); empty when it does not. Raises when Redis will not say (a
        managed Redis may refuse CONFIG)."""
        appendonly = await self.redis.config_get("appendonly")
        save = await self.redis.config_get("save")
        kept = []
        if str(appendonly.get("appendonly", "")).lower() == "yes":
            kept.append("aof")
        if str(save.get("save", "")).strip():
            kept.append("rdb")
        return kept

    # --- leases ---------------------------------------------------------------------------

    async def acquire(self, job_id: str, owner: str, ttl_s: float) -> bool:
        return bool(await self.redis.set(self.lease_key(job_id), owner, nx=True,
                                         px=int(ttl_s * 1000)))

    async def renew(self, job_id: str, owner: str, ttl_s: float) -> bool:
        self.redis  # noqa: B018
        return bool(await self._renew(keys=[self.lease_key(job_id)],
                                      args=[owner, int(ttl_s * 1000)]))

    async def release(self, job_id: str, owner: str) -> None:
        if await self.redis.get(self.lease_key(job_id)) == owner.encode():
            await self.redis.delete(self.lease_key(job_id))


async def warn_if_jobs_are_volatile(store: JobStore) -> list[str] | None:
    """At a gateway's start: a warning when Redis would lose every job with a restart
    (what it keeps, or None when it will not say, is returned for tests)."""
    from tasks.redact import mask_url

    where = mask_url(store.redis_url)
    try:
        kept = await store.persistence()
    except Exception as exc:  # away, or CONFIG refused: the first job will say more
        log.info("could not read the persistence settings of Redis at %s: %s", where, exc)
        return None
    if not kept:
        log.warning("Redis at %s keeps nothing over a restart (appendonly no, no save "
                    "schedule): a restart loses every job, queued or running, and their "
                    "callers get 404. Turn on `appendonly yes` in its redis.conf "
                    "(docs/operations.md, \"Jobs and Redis\").", where)
    return kept


def transient(exc: BaseException) -> bool:
    """Redis, the broker or the blob store away (worth another try), not a bug."""
    if isinstance(exc, ConnectionError | TimeoutError | OSError):
        return True
    code = getattr(exc, "code", None)
    if code in ("QUEUE_FULL", "BROKER_UNAVAILABLE", "MODEL_UNAVAILABLE",
                "BLOB_STORE_UNAVAILABLE"):
        return True
    name = type(exc).__name__
    return type(exc).__module__.startswith("redis") and ("Connection" in name or "Timeout" in name)


def error_body(code: str, message: str) -> dict[str, str]:
    return {"code": code, "message": message}


def iso(epoch: float | None) -> str | None:
    if epoch is None:
        return None
    from datetime import UTC, datetime

    return datetime.fromtimestamp(epoch, tz=UTC).isoformat(timespec="milliseconds")


def view(job: Job) -> dict[str, Any]:
    """The job as `GET /v1/jobs/{id}` shows it."""
    out: dict[str, Any] = {
        "id": job.id, "state": job.state, "operation": job.operation, "model": job.model,
        "progress": {"parts_done": job.parts_done, "parts_total": job.parts_total,
                     "items_done": job.items_done, "items_total": job.items_total,
                     "parts_published": job.published},
        "created_at": iso(job.created_at), "started_at": iso(job.started_at),
        "finished_at": iso(job.finished_at),
    }
    if job.state == SUCCEEDED:
        if job.bulk:
            out["result_url"] = f"/v1/jobs/{job.id}/result"
            out["result_type"] = job.result_type
        else:
            out["result"] = job.result
    if job.error is not None:
        out["error"] = job.error
    return out


def dumps(value: Any) -> bytes:
    return orjson.dumps(value)
