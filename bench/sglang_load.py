"""bench.sglang's load: the tiny Llama and its catalog, prompts whose greedy output fills
the token budget, the request bodies per system, the closed-loop streams of one phase and
their scoring."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bench.sglang_processes import cores_over
from bench.sglang_stream import (
    HIDDEN_SIZE,
    MODEL_ID,
    SSEParser,
    Stream,
    check,
    lengths_seen,
    phase_stats,
    prefix_lengths,
    read_event,
    token_counts,
)


@dataclass
class Prompt:
    text: str
    ids: list[int]  # what shoal's runtime sends SGLang for `text`
    output_ids: list[int] = field(default_factory=list)  # greedy SGLang's
    shoal_text: str = ""  # the tokenizer's decoding of output_ids: shoal's completion
    lengths: list[int] = field(default_factory=list)  # prefix_lengths of the decodings
    bare_text: str | None = None  # bare SGLang's streamed text, once seen
    bare_lengths: list[int] | None = None  # the same for its text (`lengths_seen`)


def build_model(directory: Path) -> Path:
    from tests.tiny_lm import build_tiny_llama

    return build_tiny_llama(directory / "llama", hidden_size=HIDDEN_SIZE)


def write_catalog(directory: Path, model_dir: Path) -> Path:
    import yaml

    catalog = directory / "catalog"
    catalog.mkdir()
    entry = {"id": MODEL_ID, "adapter": "causal-lm", "runtime": "sglang",
             "source": {"path": str(model_dir)}}
    (catalog / "llama.yaml").write_text(yaml.safe_dump(entry, sort_keys=False))
    return catalog


def candidate_prompts(model_dir: Path, count: int) -> tuple[Any, list[Prompt]]:
    """(the tokenizer, `count` prompts with the ids shoal's runtime would send)."""
    from transformers import AutoTokenizer

    from app.tuning.mix import make_texts
    from runtimes.families.prompts import bos_id, prompt_ids
    from tasks.schema import Item

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    bos = bos_id(tokenizer)
    return tokenizer, [Prompt(text, prompt_ids(tokenizer, bos, Item(text=text), 0, MODEL_ID))
                       for text in make_texts(count, seed=1)]


def usable(prompt: Prompt, tokenizer: Any, max_tokens: int, finish: str | None) -> bool:
    """Fill in what greedy SGLang made; whether both systems will stream exactly
    `max_tokens` tokens, each adding text (no EOS, no special token, and each decoding a
    prefix of the next, as shoal streams text only while it grows)."""
    ids = prompt.output_ids
    if finish != "length" or len(ids) != max_tokens:
        return False
    if set(ids) & set(tokenizer.all_special_ids):
        return False
    pieces = [tokenizer.decode(ids[:k], skip_special_tokens=True)
              for k in range(1, len(ids) + 1)]
    if any(not b.startswith(a) or len(b) <= len(a) for a, b in zip(["", *pieces], pieces,
                                                                    strict=False)):
        return False
    prompt.shoal_text = pieces[-1]
    prompt.lengths = prefix_lengths(pieces)
    return True


def greedy_outputs(url: str, prompts: Sequence[Prompt], max_tokens: int) -> list[str | None]:
    """Ask SGLang's native /generate (greedy) for each prompt's output ids; fill them in.
    The finish reasons."""
    import httpx

    finishes: list[str | None] = []
    with httpx.Client(timeout=300) as client:
        for start in range(0, len(prompts), 32):
            batch = prompts[start:start + 32]
            response = client.post(f"{url}/generate", json={
                "input_ids": [p.ids for p in batch],
                "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0,
                                    "skip_special_tokens": True}})
            response.raise_for_status()
            for prompt, out in zip(batch, response.json(), strict=True):
                prompt.output_ids = list(out.get("output_ids") or [])
                finishes.append(((out.get("meta_info") or {}).get("finish_reason")
                                 or {}).get("type"))
    return finishes


@dataclass(frozen=True)
class Target:
    """Where one system's streams go: URL, and each prompt's request body, serialised once."""

    system: str
    url: str
    bodies: list[bytes]


def bodies(system: str, prompts: Sequence[Prompt], max_tokens: int,
           counted: bool = False) -> list[bytes]:
    """Each prompt's request: shoal's OpenAI route with the prompt's text; bare SGLang's
    with its token ids (`counted`: with each chunk's token count, which costs SGLang a
    little, so only the output check asks for it); SGLang's native /generate with the ids,
    as shoal's runtime sends them. Greedy, `max_tokens`, streamed."""
    if system == "native":
        return [orjson.dumps({"input_ids": p.ids, "stream": True, "sampling_params": {
            "max_new_tokens": max_tokens, "temperature": 0.0, "top_p": 1.0,
            "skip_special_tokens": True}}) for p in prompts]
    base: dict[str, Any] = {"model": MODEL_ID, "max_tokens": max_tokens, "temperature": 0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if system == "shoal":
        return [orjson.dumps({**base, "prompt": p.text}) for p in prompts]
    if counted:
        base["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return [orjson.dumps({**base, "prompt": p.ids}) for p in prompts]


HEADERS = {"content-type": "application/json", "accept": "text/event-stream"}


async def one_stream(client: Any, target: Target, prompt: int, timeout: float) -> Stream:
    """Send one request and read its events (the client's hot path: no JSON is built)."""
    import httpx

    stream = Stream(prompt, time.perf_counter())
    parser = SSEParser()
    try:
        async with asyncio.timeout(timeout), client.stream(
                "POST", target.url, content=target.bodies[prompt], headers=HEADERS) as r:
            if r.status_code != 200:
                await r.aread()
                stream.error = f"HTTP {r.status_code}"
                return stream
            async for data in r.aiter_raw():
                now = time.perf_counter()
                for payload in parser.feed(data):
                    event = read_event(payload)
                    if event.error is not None:
                        stream.error = f"error event: {event.error}"
                        return stream
                    if event.whole:
                        if len(event.text) > len(stream.text):
                            stream.text = event.text
                            stream.chunks.append((now, len(stream.text), event.tokens))
                    elif event.text:
                        stream.text += event.text
                        stream.chunks.append((now, len(stream.text), event.tokens))
                    if event.finish is not None:
                        stream.finish = event.finish
                    if event.tokens is not None:
                        stream.completion_tokens = event.tokens
    except (httpx.HTTPError, TimeoutError, OSError) as exc:
        stream.error = type(exc).__name__
    finally:
        stream.ended = time.perf_counter()
    return stream


def prefill_share(before: Mapping[str, Any], after: Mapping[str, Any],
                  seconds: float) -> dict[str, float]:
    """From two reads of SGLang's /v1/loads: the share of the time its scheduler spent in
    prefill (extend) batches, and the prompt tokens it prefilled per second."""
    busy = after.get("total_prefill_busy_us", 0) - before.get("total_prefill_busy_us", 0)
    tokens = (after.get("total_prefill_uncached_tokens", 0)
              - before.get("total_prefill_uncached_tokens", 0))
    return {"prefill_busy_share": busy / 1e6 / seconds,
            "prefill_tokens_per_s": tokens / seconds}


async def sglang_counters(url: str | None, start: float, end: float) -> dict[str, float]:
    """`prefill_share` over [start, end) of the SGLang server at `url` ({} without one)."""
    if url is None:
        return {}
    import httpx

    async with httpx.AsyncClient(timeout=10.0) as client:
        async def read() -> dict[str, Any]:
            return (await client.get(f"{url}/v1/loads")).json()["loads"][0]

        await asyncio.sleep(max(0.0, start - time.perf_counter()))
        before = await read()
        await asyncio.sleep(max(0.0, end - time.perf_counter()))
        return prefill_share(before, await read(), end - start)


@dataclass
class Phase:
    streams: list[Stream]
    start: float
    end: float
    cores: dict[str, float]  # per CPU group
    client_cores: float
    server: dict[str, float]  # `prefill_share`


async def closed_loop(target: Target, clients: int, warmup: float, duration: float,
                      cpu_groups: Mapping[str, Sequence[int]], timeout: float = 120.0,
                      server_url: str | None = None) -> Phase:
    """`clients` streams, each sending its next request when its stream ends, until the
    window ends; the streams, the window, each CPU group's cores over it, the client's,
    and the SGLang server's prefill counters over it."""
    import httpx

    now = time.perf_counter()
    start, end = now + warmup, now + warmup + duration
    streams: list[Stream] = []
    meter = asyncio.create_task(cores_over(start, end, cpu_groups))
    counters = asyncio.create_task(sglang_counters(server_url, start, end))
    client_cpu: list[float] = []

    async def client_meter() -> None:
        await asyncio.sleep(max(0.0, start - time.perf_counter()))
        before = time.process_time()
        await asyncio.sleep(max(0.0, end - time.perf_counter()))
        client_cpu.append((time.process_time() - before) / duration)

    client_task = asyncio.create_task(client_meter())
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout)) as client:
        async def loop(first: int) -> None:
            index = first
            while time.perf_counter() < end:
                streams.append(await one_stream(client, target, index % len(target.bodies),
                                                timeout))
                index += clients

        await asyncio.gather(*(loop(k) for k in range(clients)))
    cores = await meter
    await client_task
    return Phase(streams, start, end, cores, client_cpu[0], await counters)


async def each_once(target: Target, concurrency: int, timeout: float = 300.0) -> list[Stream]:
    """Every prompt streamed once, `concurrency` at a time."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout)) as client:
        async def one(prompt: int) -> Stream:
            async with gate:
                return await one_stream(client, target, prompt, timeout)

        return list(await asyncio.gather(*(one(i) for i in range(len(target.bodies)))))


def score(system: str, streams: Sequence[Stream], prompts: Sequence[Prompt],
          max_tokens: int) -> tuple[list[list[int]], int]:
    """Check each stream's length (a wrong one becomes an error), count its tokens per
    chunk, and count the streams whose text is not the prompt's usual one: shoal's must be
    the decoding of greedy SGLang's ids, bare SGLang's the first it streamed for the prompt
    (which also gives `bare_lengths` when its chunks said their tokens). Greedy decoding
    on CPU can flip a near-tie with the batch it runs in: such a stream is only counted,
    and its chunks are taken for one token each (they are, but for rare merged ones)."""
    counts, differ = [], 0
    for stream in streams:
        prompt = prompts[stream.prompt]
        if stream.error is None:
            stream.error = check(stream, max_tokens)
        lengths = {"shoal": prompt.lengths, "bare": prompt.bare_lengths}.get(system)
        if stream.error is None and system != "native":
            if system == "bare" and prompt.bare_text is None:
                prompt.bare_text = stream.text
                if stream.chunks and stream.chunks[-1][2] is not None:
                    lengths = prompt.bare_lengths = lengths_seen(stream.chunks, max_tokens)
            expected = prompt.shoal_text if system == "shoal" else prompt.bare_text
            if stream.text != expected:
                differ += 1
                lengths = None  # not the text the table is of: one token a chunk
        counts.append(token_counts(stream, lengths))
    return counts, differ


async def measure(target: Target, prompts: Sequence[Prompt], clients: int, warmup: float,
                  duration: float, max_tokens: int, cpu_groups: Mapping[str, Sequence[int]],
                  server_url: str | None = None) -> dict[str, Any]:
    phase = await closed_loop(target, clients, warmup, duration, cpu_groups,
                              server_url=server_url)
    streams, start, cores, client = phase.streams, phase.start, phase.cores, phase.client_cores
    counts, differ = score(target.system, streams, prompts, max_tokens)
    stats = phase_stats(streams, start, phase.end, counts)
    tokens_seen = Counter(s.completion_tokens for s in streams if s.error is None)
    chunk_tokens = Counter(b - a for c in counts for a, b in zip([0, *c], c, strict=False))
    return {**stats, "cpu_cores": cores, "client_cores": client,
            "client_cpu_ms_per_token": client * duration * 1000 / stats["tokens"]
            if stats["tokens"] else None,
            "completion_tokens": {str(k): v for k, v in tokens_seen.items()},
            "tokens_per_chunk": {str(k): v for k, v in sorted(chunk_tokens.items())},
            "warmup_errors": sum(1 for s in streams if s.error and s.sent < start),
            "other_text": differ, "sglang": phase.server}
