"""An API key's jobs together: its limits (jobs at once, texts queued) and its fair share
of parts in flight.

Every job is a member of its key's set in Redis (`JobStore.owner_key`; all callers share
one when API keys are off). Counting reads the members' hashes in a Lua script, so the
counts are never a second copy that could drift from the jobs: a member that finished or
vanished is dropped from the set as it is met.

- **Limits.** A job is created by `KeyJobs.create` in one script that counts the key's
  active jobs and their texts not yet done and refuses past SHOAL_JOBS_PER_KEY or
  SHOAL_JOB_TEXTS_PER_KEY (a key's `concurrent_jobs` / `queued_job_texts` in the keys
  file override them): two gateways cannot both admit the last place. A refusal is a 429
  TOO_MANY_JOBS whose Retry-After is estimated from the rate the key's jobs run at
  (`retry_after`). `check` is the same count without creating, run before an upload is
  read, so a key at its limit is refused before it sends gigabytes. A job with more texts
  than the whole limit would wait for ever: 413, split it.
- **Fair share.** `in_flight` is the parts a key has published and not yet had answered
  on one model, over all its jobs; the part publisher (`gateway.jobs.part_publisher`)
  publishes a job's next part only while that is under SHOAL_JOB_PARTS_IN_FLIGHT. A key's
  bulk work therefore takes as much of a model's queue with twenty jobs as with one, and
  two keys' jobs progress at the same rate whatever their numbers of jobs: a worker runs
  the bulk parts it holds oldest first, and each key has as many there.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.edge.api_errors import ApiError
from tasks.errors import ErrorCode

if TYPE_CHECKING:
    from gateway.auth.key_file import ApiKey
    from gateway.jobs.store import Job, JobStore
    from tasks.settings import Settings

# Count a key's active jobs (KEYS[1]: its set) and their texts not done; with ARGV[4] = 1
# create the job too (KEYS[2]: its hash, KEYS[3]: the active set) unless that goes past a
# limit. ARGV: [1] the jobs' hash prefix, [2] most jobs (0: none), [3] most texts (0:
# none), [4] 1 to create, [5] the new job's texts, [6] its id, [7..] its fields.
# Returns {0 admitted | 1 over the jobs | 2 over the texts, jobs, texts}.
_COUNT_AND_CREATE = """
local jobs, texts = 0, 0
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local f = redis.call('HMGET', ARGV[1] .. id, 'state', 'items_total', 'items_done')
  if f[1] == 'queued' or f[1] == 'running' then
    jobs = jobs + 1
    texts = texts + math.max(0, (tonumber(f[2]) or 0) - (tonumber(f[3]) or 0))
  else
    redis.call('SREM', KEYS[1], id)
  end
end
local most_jobs, most_texts, new = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[5])
if most_jobs > 0 and jobs >= most_jobs then return {1, jobs, texts} end
if most_texts > 0 and texts + new > most_texts then return {2, jobs, texts} end
if ARGV[4] == '1' then
  for i = 7, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
  redis.call('SADD', KEYS[3], ARGV[6])
  redis.call('SADD', KEYS[1], ARGV[6])
end
return {0, jobs, texts}
"""
# Parts a key has out on one model: published and not answered, over its active jobs
# (KEYS[1]: its set). ARGV: [1] the jobs' hash prefix, [2] the model, [3] an OpenAI
# batch's lines to a part (its `published` counts lines; whole parts only, so that a
# batch alone keeps the lines in flight it had before there was a share).
_IN_FLIGHT = """
local out = 0
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local f = redis.call('HMGET', ARGV[1] .. id, 'state', 'model', 'published', 'parts_done',
                       'batch')
  if (f[1] == 'queued' or f[1] == 'running') and f[2] == ARGV[2] then
    local n = math.max(0, (tonumber(f[3]) or 0) - (tonumber(f[4]) or 0))
    if f[5] and f[5] ~= '' then n = math.floor(n / tonumber(ARGV[3])) end
    out = out + n
  end
end
return out
"""
JOBS, TEXTS = 1, 2
RETRY_UNKNOWN_S = 10  # Retry-After while none of the key's jobs has a rate yet
RETRY_MOST_S = 300


@dataclass(frozen=True, slots=True)
class Limits:
    """A key's job limits (0: none) and how a message names the key."""

    jobs: int
    texts: int
    owner: str | None  # the key's name; None: keys are off, every caller is one key
    who: str

    @classmethod
    def of(cls, settings: Settings, key: ApiKey | None) -> Limits:
        if key is None:
            return cls(settings.jobs_per_key, settings.job_texts_per_key, None,
                       "all callers together (API keys are off)")
        jobs = settings.jobs_per_key if key.concurrent_jobs is None else key.concurrent_jobs
        texts = settings.job_texts_per_key if key.queued_job_texts is None \
            else key.queued_job_texts
        return cls(jobs, texts, key.name, f"the API key {key.name!r}")


class KeyJobs:
    """The Redis side of a key's jobs (see the module doc)."""

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self._scripts: tuple[Any, Any] | None = None

    def _script(self, which: int) -> Any:
        if self._scripts is None:
            redis = self.store.redis
            self._scripts = (redis.register_script(_COUNT_AND_CREATE),
                             redis.register_script(_IN_FLIGHT))
        return self._scripts[which]

    @property
    def _prefix(self) -> str:
        return self.store.key("")

    async def check(self, limits: Limits, cancel_hint: str) -> None:
        """Refuse (429) a key already at its jobs limit, or with its texts limit full."""
        await self._count(limits, None, 1, cancel_hint)

    async def create(self, job: Job, limits: Limits, cancel_hint: str) -> None:
        """Create `job` (as `JobStore.create`) unless its key is past a limit: 429 then,
        or 413 for a job with more texts than the key may ever queue."""
        if limits.texts and job.items_total > limits.texts:
            raise ApiError(ErrorCode.PAYLOAD_TOO_LARGE, f"the job has {job.items_total} "
                           f"items, more than {limits.who} may have queued at once "
                           f"({limits.texts}, SHOAL_JOB_TEXTS_PER_KEY or the key's "
                           "queued_job_texts): split it into smaller jobs")
        job.created_at = job.created_at or time.time()
        await self._count(limits, job, job.items_total, cancel_hint)

    async def _count(self, limits: Limits, job: Job | None, texts: int,
                     cancel_hint: str) -> None:
        keys = [self.store.owner_key(limits.owner)]
        args: list[Any] = [self._prefix, limits.jobs, limits.texts, 0, texts, ""]
        if job is not None:
            keys += [self.store.key(job.id), self.store.active_key]
            args[3], args[5] = 1, job.id
            args += [v for item in job.to_redis().items() for v in item]
        verdict, jobs, queued = await self._script(0)(keys=keys, args=args)
        if verdict == 0:
            return
        wait = await self.retry_after(limits.owner, verdict, queued + texts - limits.texts)
        if verdict == JOBS:
            what = (f"{limits.who} has {jobs} jobs queued or running, its limit "
                    f"(SHOAL_JOBS_PER_KEY, or the key's concurrent_jobs)")
        else:
            what = (f"{limits.who} has {queued} items queued in its jobs; {texts} more "
                    f"would pass its limit of {limits.texts} (SHOAL_JOB_TEXTS_PER_KEY, or "
                    "the key's queued_job_texts)")
        error = ApiError(ErrorCode.TOO_MANY_JOBS, f"{what}: send it again after "
                         f"Retry-After ({wait} s), when some have finished, or {cancel_hint}",
                         retry_after=wait)
        error.openai_type = "requests" if verdict == JOBS else "tokens"  # type: ignore[attr-defined]
        raise error

    async def retry_after(self, owner: str | None, verdict: int, over: int) -> int:
        """Seconds until the key's jobs have made room, from the rate each runs at: the
        soonest to finish for the jobs limit, `over` texts done for the texts limit."""
        redis = self.store.redis
        ids = [m.decode() for m in await redis.smembers(self.store.owner_key(owner))]
        now, rates, left = time.time(), [], []
        for job_id in ids:
            total, done, started = await redis.hmget(self.store.key(job_id), "items_total",
                                                     "items_done", "started_at")
            if not (total and done and started) or now - float(started) <= 0:
                continue
            rate = int(done) / (now - float(started))
            if rate > 0:
                rates.append(rate)
                left.append(max(0, int(total) - int(done)) / rate)
        if not rates:
            return RETRY_UNKNOWN_S
        wait = min(left) if verdict == JOBS else max(over, 1) / sum(rates)
        return max(1, min(RETRY_MOST_S, math.ceil(wait)))

    async def in_flight(self, owner: str | None, model: str, lines_per_part: int) -> int:
        """Parts the key has published and not had answered on `model`, over its jobs."""
        return int(await self._script(1)(keys=[self.store.owner_key(owner)],
                                         args=[self._prefix, model, lines_per_part]))
