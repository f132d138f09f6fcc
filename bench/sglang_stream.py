"""bench.sglang's pure logic: what is compared (the systems, the model, the targets), the
server-sent events of a stream read and timed (TTFT, ITL, tokens per chunk), and the order
of the rounds."""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from app.tuning.stats import percentile

MODEL_ID = "bench/sglang-llama"
HIDDEN_SIZE = 128
SYSTEMS = ("shoal", "bare")  # measured by default; "native" with --native
NAMES = {"shoal": "shoal + SGLang", "bare": "bare SGLang", "native": "SGLang native API"}
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}
TTFT_TARGET_MS = 5.0
RATIO_TARGET = 0.9


class SSEParser:
    """Server-sent events from the bytes of a response, as they come: `feed` returns the
    `data` of every event completed so far (several `data:` lines joined by newlines)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data.replace(b"\r\n", b"\n")
        *events, self._buffer = self._buffer.split(b"\n\n")
        out = []
        for event in events:
            lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n")
                     if line.startswith(b"data:")]
            if lines:
                out.append(b"\n".join(lines))
        return out


@dataclass(frozen=True, slots=True)
class Event:
    """What one streaming event says (text and counts of choice 0)."""

    text: str = ""
    finish: str | None = None
    tokens: int | None = None  # completion tokens so far, when the event says
    error: str | None = None
    done: bool = False
    whole: bool = False  # `text` is all the text so far (SGLang's native API), not a delta


def read_event(data: bytes) -> Event:
    """One event's data: an OpenAI completion or chat chunk, a chunk of SGLang's native
    /generate (whole text and ids so far, `meta_info`), an error, or [DONE]. Several
    entries for choice 0 in one chunk (deltas that travelled together) are joined."""
    if data.strip() == b"[DONE]":
        return Event(done=True)
    try:
        payload = orjson.loads(data)
    except orjson.JSONDecodeError:
        return Event(error="malformed event")
    if not isinstance(payload, dict):
        return Event(error="malformed event")
    if "error" in payload:
        error = payload["error"]
        code = error.get("code") or error.get("type") or error.get("message") \
            if isinstance(error, dict) else error
        return Event(error=str(code))
    meta = payload.get("meta_info")
    if isinstance(meta, dict):
        finish = meta.get("finish_reason")
        return Event(str(payload.get("text") or ""),
                     finish.get("type") if isinstance(finish, dict) else finish,
                     meta.get("completion_tokens"), whole=True)
    text, finish = [], None
    for choice in payload.get("choices") or ():
        if choice.get("index", 0) != 0:
            continue
        piece = choice.get("text")
        if piece is None:
            piece = (choice.get("delta") or {}).get("content")
        if piece:
            text.append(piece)
        finish = choice.get("finish_reason") or finish
    usage = payload.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return Event("".join(text), finish, tokens)


def prefix_lengths(pieces: Sequence[str]) -> list[int]:
    """Lengths of the text after 0, 1, ... n tokens, given those texts (`pieces[k]`: the
    decoding of the first k+1 tokens)."""
    return [0, *(len(p) for p in pieces)]


def lengths_seen(chunks: Sequence[tuple[float, int, int | None]], tokens: int) -> list[int]:
    """`prefix_lengths` from a stream whose chunks said their tokens: a chunk of several
    tokens gives its length to the last of them (the others keep the previous length, so
    `tokens_at` counts them with it)."""
    lengths = [0] * (tokens + 1)
    done, chars = 0, 0
    for _, now_chars, said in chunks:
        if said is None or said <= done:
            continue
        said = min(said, tokens)
        for k in range(done + 1, said):
            lengths[k] = chars
        lengths[said] = chars = now_chars
        done = said
    for k in range(done + 1, tokens + 1):
        lengths[k] = chars
    return lengths


def tokens_at(lengths: Sequence[int], chars: int) -> int:
    """The tokens a stream has sent once its text is `chars` long: the fewest k whose text
    is that long (a token that adds no text is counted with the next one that does)."""
    return min(bisect.bisect_left(lengths, chars), len(lengths) - 1)


@dataclass
class Stream:
    """One streamed request as the client saw it (times: `time.perf_counter()`)."""

    prompt: int
    sent: float
    # Content chunks: (received at, text length so far, tokens so far if the chunk said).
    chunks: list[tuple[float, int, int | None]] = field(default_factory=list)
    text: str = ""
    completion_tokens: int | None = None  # from the usage chunk
    finish: str | None = None
    error: str | None = None
    ended: float | None = None


def token_counts(stream: Stream, lengths: Sequence[int] | None) -> list[int]:
    """Tokens so far at each content chunk: what the chunk said, else read off the text
    with `lengths` (`prefix_lengths` of the stream's prompt), else one token a chunk."""
    counts = []
    for i, (_, chars, said) in enumerate(stream.chunks):
        if said is not None:
            counts.append(said)
        elif lengths is not None:
            counts.append(tokens_at(lengths, chars))
        else:
            counts.append(i + 1)
    return counts


def timings(stream: Stream, counts: Sequence[int]) -> tuple[float | None, list[float]]:
    """(TTFT ms, inter-token latencies ms): each chunk after the first gives its gap to
    the previous one divided by its tokens, once per token; a chunk of no new tokens
    gives none (its gap counts towards the next chunk that has some)."""
    if not stream.chunks:
        return None, []
    ttft = (stream.chunks[0][0] - stream.sent) * 1000
    itl: list[float] = []
    last_time, last_count = stream.chunks[0][0], counts[0]
    for (at, _, _), count in zip(stream.chunks[1:], counts[1:], strict=True):
        new = count - last_count
        if new > 0:
            itl.extend([(at - last_time) * 1000 / new] * new)
            last_time, last_count = at, count
    return ttft, itl


def check(stream: Stream, expected_tokens: int) -> str | None:
    """Why a stream that ended without an error is not of the expected length, or None."""
    if stream.completion_tokens != expected_tokens:
        return f"{stream.completion_tokens} tokens, not {expected_tokens}"
    return None


def phase_stats(streams: Sequence[Stream], start: float, end: float,
                counts: Sequence[Sequence[int]]) -> dict[str, Any]:
    """One phase's numbers over the window [start, end) (see the module doc); `counts[i]`
    are `token_counts` of `streams[i]`. A stream whose `error` is set failed."""
    tokens = 0
    ttfts: list[float] = []
    itls: list[float] = []
    errors: Counter[str] = Counter()
    started = 0
    for stream, count in zip(streams, counts, strict=True):
        if stream.error is None:
            previous = 0
            for (at, _, _), now in zip(stream.chunks, count, strict=True):
                if start <= at < end:
                    tokens += max(0, now - previous)
                previous = max(previous, now)
        if not start <= stream.sent < end:
            continue
        started += 1
        if stream.error is not None:
            errors[stream.error] += 1
            continue
        ttft, itl = timings(stream, count)
        if ttft is not None:
            ttfts.append(ttft)
        itls.extend(itl)
    duration = end - start
    return {"tokens": tokens, "tokens_per_s": tokens / duration, "streams": started,
            "ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99),
            "itl_p50_ms": percentile(itls, 50), "itl_p99_ms": percentile(itls, 99),
            "errors": sum(errors.values()), "error_kinds": dict(errors)}


def schedule(rounds: int, levels: Sequence[int],
             systems: Sequence[str] = SYSTEMS) -> list[tuple[int, int, str]]:
    """(round, clients, system) in run order: every system at each level in turn, in
    `systems` order in even rounds and in reverse in odd ones."""
    return [(r, clients, system)
            for r in range(rounds) for clients in levels
            for system in (systems if r % 2 == 0 else systems[::-1])]
