"""shoal + SGLang against bare SGLang, streamed: the same tiny Llama, prompts and client.

    make sglang    # once: SGLang's own venv, .venv-sglang
    .venv/bin/python -m bench.sglang [--clients 1,8,32] [--duration 8] [--warmup 2]
        [--rounds 3] [--max-tokens 64] [--prompts 64] [--native] [--json out.json]
        [--plot docs/bench/sglang.png] [--py-spy DIR]

The model: a random Llama built in a temporary folder by `tests.tiny_lm.build_tiny_llama`
with hidden size 128 (4 heads of 32, 2 KV heads, 2 layers, the MiniLM tokenizer's 30522
words: 8.1 M parameters, 7.8 M of them the embedding and output matrices). The tests use
hidden 64 (head_dim 16, the smallest SGLang's CPU attention takes); 128 gives a head_dim
less of an edge case and is still far too small for the forward pass to matter next to
SGLang's per-step scheduling, so what is measured is per-token overhead, which is the point.

shoal: a private stack (`app.tuning.bench_stack.bench_stack`: gateway -> RabbitMQ -> one
worker, on a queue prefix of its own) whose catalog has one entry, `runtime: sglang`; the
worker starts the model's SGLang server (`runtimes.sglang`). Requests go to the gateway's
`/v1/completions` with the prompt's text.

bare SGLang: that very server, asked directly on its OpenAI `/v1/completions`, with the
prompt's token ids (the ids shoal's runtime sends SGLang for that text:
`runtimes.families.prompts.prompt_ids`, [CLS] + words, no [SEP]), so both systems run the same
process, flags (`runtimes.sglang.server.ServerConfig`) and warm caches. A second server
started with the same flags would spin: an idle SGLang scheduler polls its sockets
without sleeping (SGLang's `--sleep-on-idle` is off; shoal does not pass it), so an idle
server takes a whole core of this 2-core machine (measured at start: "idle_cores") and
would slow whichever system is measured beside it. While bare SGLang is measured,
shoal's gateway, worker and RabbitMQ sit idle (their CPU is measured too).
`--native` also measures SGLang's native `/generate` (the API shoal's runtime calls, with
the same body), for reference.

Both get the same prompts (`app.tuning.mix.make_texts`, kept when greedy SGLang makes exactly
`--max-tokens` tokens, none of them special, each adding text), greedy (temperature 0),
`stream: true` with `stream_options.include_usage`, and every stream's length is checked
(usage.completion_tokens must be `--max-tokens`, else it is an error). Every prompt is
first streamed once through each system; its text is then what later streams should
repeat: shoal's must be the tokenizer's decoding of the ids greedy SGLang made (bare
SGLang's incremental detokenizer spells it with leading spaces). Greedy decoding on this
CPU path can flip a near-tie with the batch a request runs in, so a differing text is
counted ("other_text"), not an error.

Each level is N closed-loop streams (each sends its next request when its stream ends)
from one `httpx.AsyncClient` on uvloop in this process; the client's CPU is reported. The
systems alternate: each round measures every level on each, in order in even rounds and in
reverse in odd ones, and ratios are taken within a round (adjacent phases), then their
median over rounds. Per phase, over the window [warm-up end, end):
- output tokens/s: tokens of content chunks received in the window, of streams that ended
  without an error;
- TTFT p50/p99: from sending the request to its first content chunk, of streams started
  in the window;
- ITL p50/p99: each content chunk after the first gives (gap to the previous chunk) /
  (tokens in the chunk) for each of its tokens (as SGLang's bench_serving does), of
  streams started in the window. Tokens in a chunk are read off the text: shoal streams
  the decoding of the first k tokens, so they are the k whose decoding is as long as the
  text so far; for bare SGLang the same table comes from the first pass, whose requests
  ask for `continuous_usage_stats` (the measured ones do not: it costs SGLang a little);
  the native API says them;
- CPU: seconds per second (cores) of shoal's gateway, worker, RabbitMQ and the SGLang
  server (its HTTP, scheduler and detokenizer processes), and of the client.

`--py-spy DIR`: after the rounds, one more shoal phase at the largest level with
`py-spy record --gil --threads` on the gateway, the worker and the SGLang server's HTTP
process (raw collapsed stacks, and per thread its top functions, in DIR); it is not
counted in the results.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from app.tuning import markdown
from app.tuning.markdown import dash as _num
from app.tuning.stats import median, percentile
from bench.lib import profiles
from bench.lib.args import parse_levels

MODEL_ID = "bench/sglang-llama"
HIDDEN_SIZE = 128
SYSTEMS = ("shoal", "bare")  # measured by default; "native" with --native
NAMES = {"shoal": "shoal + SGLang", "bare": "bare SGLang", "native": "SGLang native API"}
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}
TTFT_TARGET_MS = 5.0
RATIO_TARGET = 0.9


# --------------------------------------------------------------------------- pure logic


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


METRICS = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
           "client_cores", "cores", "prefill_busy_share")
SHOAL_SIDE = ("gateway", "worker", "rabbitmq")  # what shoal adds to SGLang's processes


def _read(run: Mapping[str, Any], key: str) -> float | None:
    if key == "cores":  # every measured process of the system, the client excluded
        return sum(run["cpu_cores"].values()) if run.get("cpu_cores") else None
    if key == "prefill_busy_share":
        return (run.get("sglang") or {}).get(key)
    return run.get(key)


def summarise(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per level: each metric's median over rounds per system; per round, shoal/bare
    throughput and shoal's TTFT p50 minus bare's, and their medians; errors summed."""
    systems = [s for s in NAMES if any(run["system"] == s for run in runs)]
    summary = []
    for clients in sorted({run["clients"] for run in runs}):
        row: dict[str, Any] = {"clients": clients}
        at = [run for run in runs if run["clients"] == clients]
        for system in systems:
            mine = [run for run in at if run["system"] == system]
            for key in METRICS:
                row[f"{system}_{key}"] = median([_read(run, key) for run in mine])
            for group in sorted({g for run in mine for g in run.get("cpu_cores", {})}):
                row[f"{system}_cpu_{group}"] = median(
                    [run["cpu_cores"].get(group) for run in mine])
        # CPU ms that shoal's own processes spend per streamed token.
        row["shoal_cpu_ms_per_token"] = median(
            [sum(run["cpu_cores"].get(g, 0.0) for g in SHOAL_SIDE) * 1000 / run["tokens_per_s"]
             for run in at if run["system"] == "shoal" and run.get("tokens_per_s")])
        ratios, added, added_p99 = [], [], []
        for r in sorted({run["round"] for run in at}):
            pair = {run["system"]: run for run in at if run["round"] == r}
            if not set(SYSTEMS) <= set(pair):
                continue
            shoal, bare = pair["shoal"], pair["bare"]
            if bare["tokens_per_s"]:
                ratios.append(shoal["tokens_per_s"] / bare["tokens_per_s"])
            if shoal["ttft_p50_ms"] is not None and bare["ttft_p50_ms"] is not None:
                added.append(shoal["ttft_p50_ms"] - bare["ttft_p50_ms"])
            if shoal["ttft_p99_ms"] is not None and bare["ttft_p99_ms"] is not None:
                added_p99.append(shoal["ttft_p99_ms"] - bare["ttft_p99_ms"])
        row["ratio_tokens_per_s"] = median(ratios)
        row["ratios"] = ratios
        row["added_ttft_p50_ms"] = median(added)
        row["added_ttft_p50_ms_rounds"] = added
        row["added_ttft_p99_ms"] = median(added_p99)
        for system in systems:
            row[f"{system}_errors"] = sum(run["errors"] for run in at
                                          if run["system"] == system)
        summary.append(row)
    return summary


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f}%"


def table(summary: Sequence[Mapping[str, Any]]) -> str:
    """The summary as markdown: the comparison, CPU, and the native API when measured."""
    header = ["streams", "tokens/s shoal", "tokens/s bare", "shoal/bare",
              "TTFT p50 ms shoal", "TTFT p50 ms bare", "shoal's added TTFT p50 ms",
              "TTFT p99 ms shoal", "TTFT p99 ms bare", "ITL p50 ms shoal", "ITL p50 ms bare",
              "ITL p99 ms shoal", "ITL p99 ms bare", "errors (shoal, bare)"]
    rows = []
    for row in summary:
        cells = [str(row["clients"]),
                 _num(row["shoal_tokens_per_s"], ".0f"), _num(row["bare_tokens_per_s"], ".0f"),
                 _num(row["ratio_tokens_per_s"], ".2f"),
                 _num(row["shoal_ttft_p50_ms"], ".1f"), _num(row["bare_ttft_p50_ms"], ".1f"),
                 _num(row["added_ttft_p50_ms"], "+.1f"),
                 _num(row["shoal_ttft_p99_ms"], ".0f"), _num(row["bare_ttft_p99_ms"], ".0f"),
                 _num(row["shoal_itl_p50_ms"], ".1f"), _num(row["bare_itl_p50_ms"], ".1f"),
                 _num(row["shoal_itl_p99_ms"], ".0f"), _num(row["bare_itl_p99_ms"], ".0f"),
                 f"{row['shoal_errors']}, {row['bare_errors']}"]
        rows.append(cells)
    lines = markdown.table(header, rows)
    cpu = ["streams", "shoal: gateway", "worker", "RabbitMQ", "SGLang",
           "bare: SGLang", "shoal's processes, idle", "client (shoal, bare)",
           "shoal's CPU ms per token", "SGLang in prefill (shoal, bare)"]
    lines += ["", "CPU, cores (CPU seconds per second; SGLang = its HTTP, scheduler and "
              "detokenizer processes):", "",
              *markdown.table(cpu)]
    for row in summary:
        lines.append(markdown.row([
            str(row["clients"]), _num(row.get("shoal_cpu_gateway"), ".2f"),
            _num(row.get("shoal_cpu_worker"), ".2f"), _num(row.get("shoal_cpu_rabbitmq"), ".2f"),
            _num(row.get("shoal_cpu_sglang"), ".2f"), _num(row.get("bare_cpu_sglang"), ".2f"),
            _num(row.get("bare_cpu_shoal idle"), ".2f"),
            f"{_num(row['shoal_client_cores'], '.2f')}, {_num(row['bare_client_cores'], '.2f')}",
            _num(row.get("shoal_cpu_ms_per_token"), ".2f"),
            f"{_pct(row.get('shoal_prefill_busy_share'))}, "
            f"{_pct(row.get('bare_prefill_busy_share'))}"]))
    if any("native_tokens_per_s" in row for row in summary):
        lines += ["", "SGLang's native API (/generate, streamed, as shoal's runtime calls it), "
                  "for reference:", "",
                  *markdown.table(
                      ["streams", "tokens/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "errors"],
                      [[row["clients"], _num(row.get("native_tokens_per_s"), ".0f"),
                        _num(row.get("native_ttft_p50_ms"), ".1f"),
                        _num(row.get("native_ttft_p99_ms"), ".0f"),
                        _num(row.get("native_itl_p50_ms"), ".1f"), row.get("native_errors", 0)]
                       for row in summary])]
    return "\n".join(lines)


def verdicts(summary: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per level: the two targets (ratio >= 0.9, added TTFT p50 <= 5 ms)."""
    lines = []
    for row in summary:
        ratio, added = row["ratio_tokens_per_s"], row["added_ttft_p50_ms"]
        ok_ratio = ratio is not None and ratio >= RATIO_TARGET
        ok_ttft = added is not None and added <= TTFT_TARGET_MS
        lines.append(f"{row['clients']} streams: throughput {_num(ratio, '.2f')}x bare "
                     f"({'meets' if ok_ratio else 'misses'} >= {RATIO_TARGET}), added TTFT "
                     f"p50 {_num(added, '+.1f')} ms ({'meets' if ok_ttft else 'misses'} "
                     f"<= {TTFT_TARGET_MS:g} ms)")
    return lines


# --------------------------------------------------------------------------- processes


def _stat(pid: int) -> list[str]:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return raw[raw.rindex(")") + 2:].split()


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def group_of(leader: int) -> list[int]:
    """The processes of a process group (SGLang's launcher and the processes it spawned)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                if int(_stat(int(entry.name))[2]) == leader:
                    pids.append(int(entry.name))
    return sorted(pids)


def sglang_server_of(worker: int) -> tuple[int, int]:
    """(pid, port) of the SGLang server a shoal worker started (its child running
    runtimes/sglang/launch.py)."""
    from app.tuning.bench_stack import _children

    for child in _children(worker):
        argv = _cmdline(child).split(b"\0")
        if any(a.endswith(b"runtimes/sglang/launch.py") for a in argv):
            return child, int(argv[argv.index(b"--port") + 1])
    raise RuntimeError(f"worker {worker} runs no SGLang server")


def process_name(pid: int) -> str:
    """SGLang's process titles (sglang::scheduler), else the executable's name."""
    with contextlib.suppress(OSError):
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        if comm.startswith("sglang::"):
            return comm
    argv = _cmdline(pid).split(b"\0")
    if any(a.endswith(b"launch.py") for a in argv):
        return "sglang::http"
    if any(b"resource_tracker" in a for a in argv):
        return "resource_tracker"
    return Path(argv[0].decode(errors="replace")).name if argv and argv[0] else str(pid)


def group_cpu_seconds(pids: Sequence[int]) -> float:
    """CPU seconds of a group of processes (app.tuning.cpu.cpu_seconds of each; one gone
    counts nothing)."""
    from app.tuning.cpu import cpu_seconds

    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += cpu_seconds(pid)
    return total


async def cores_over(start: float, end: float,
                     groups: Mapping[str, Sequence[int]]) -> dict[str, float]:
    """CPU seconds per second of each group of processes between two perf_counter times."""
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    before = {name: group_cpu_seconds(pids) for name, pids in groups.items()}
    await asyncio.sleep(max(0.0, end - time.perf_counter()))
    return {name: (group_cpu_seconds(pids) - before[name]) / (end - start)
            for name, pids in groups.items()}


# --------------------------------------------------------------------------- model, prompts


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


# --------------------------------------------------------------------------- load


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


# --------------------------------------------------------------------------- run


def idle_cores(groups: Mapping[str, Sequence[int]], seconds: float = 5.0) -> dict[str, float]:
    before = {name: group_cpu_seconds(pids) for name, pids in groups.items()}
    time.sleep(seconds)
    return {name: (group_cpu_seconds(pids) - before[name]) / seconds
            for name, pids in groups.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import uvloop
    from tqdm import tqdm

    from app.tuning.bench_stack import bench_stack
    from app.tuning.inproc import machine_info
    from runtimes.sglang.server import missing_python_message, sglang_python

    if not sglang_python().exists():
        raise SystemExit(missing_python_message(sglang_python()))
    os.environ.update({k: v for k, v in OFFLINE_ENV.items() if k not in os.environ})
    systems = (*SYSTEMS, "native") if args.native else SYSTEMS
    plan = schedule(args.rounds, args.clients, systems)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="shoal-bench-sglang-") as tmp, \
            tqdm(total=len(plan) + 4 + bool(args.py_spy), unit="step", file=sys.stderr) as bar:
        bar.set_description("building the model")
        model_dir = build_model(Path(tmp))
        catalog = write_catalog(Path(tmp), model_dir)
        tokenizer, candidates = candidate_prompts(model_dir, 4 * args.prompts)
        bar.update()
        bar.set_description("starting shoal + SGLang (30-90 s)")
        probe = json.dumps({"model": MODEL_ID, "prompt": "warm up", "max_tokens": 2}).encode()
        env = {"SHOAL_CATALOG_DIR": str(catalog), **OFFLINE_ENV}
        with bench_stack(MODEL_ID, extra_env=env, probe=("/v1/completions", probe)) as stack:
            gateway, worker = stack.pids[0], stack.pids[1]
            server, port = sglang_server_of(worker)
            server_url = f"http://127.0.0.1:{port}"
            sglang = group_of(server)
            server_argv = _cmdline(server).decode(errors="replace").split("\0")[1:]
            broker = [int(p) for p in subprocess.run(["pgrep", "-x", "beam.smp"], text=True,
                                                     capture_output=True).stdout.split()]
            worker_side = [worker, *(p for p in stack.pids[2:]
                                     if p not in sglang and p not in broker
                                     and p != gateway)]
            bar.update()
            bar.set_description("idle CPU, greedy outputs")
            idle = idle_cores({**{f"{process_name(p)} ({p})": [p] for p in sglang},
                               "shoal gateway": [gateway], "shoal worker": worker_side,
                               "rabbitmq": broker})
            finishes = greedy_outputs(server_url, candidates, args.max_tokens)
            prompts = [p for p, f in zip(candidates, finishes, strict=True)
                       if usable(p, tokenizer, args.max_tokens, f)][:args.prompts]
            if len(prompts) < min(8, args.prompts):
                raise SystemExit(f"only {len(prompts)} of {len(candidates)} prompts make "
                                 f"{args.max_tokens} tokens greedily; lower --max-tokens")
            targets = {"shoal": Target("shoal", f"{stack.url}/v1/completions",
                                       bodies("shoal", prompts, args.max_tokens)),
                       "bare": Target("bare", f"{server_url}/v1/completions",
                                      bodies("bare", prompts, args.max_tokens)),
                       "native": Target("native", f"{server_url}/generate",
                                        bodies("native", prompts, args.max_tokens))}
            idle_shoal = [gateway, *worker_side, *broker]
            groups = {"shoal": {"gateway": [gateway], "worker": worker_side,
                                "sglang": sglang, "rabbitmq": broker},
                      "bare": {"sglang": sglang, "shoal idle": idle_shoal},
                      "native": {"sglang": sglang, "shoal idle": idle_shoal}}
            bar.update()
            # Every prompt once through each system: warms them and checks the outputs
            # (bare SGLang's chunks say their tokens here, for counting them later).
            verify = {}
            for system in systems:
                bar.set_description(f"checking outputs: {NAMES[system]}")
                once = Target(system, targets[system].url,
                              bodies(system, prompts, args.max_tokens, counted=True))
                streams = uvloop.run(each_once(once, 16))
                _, differ = score(system, streams, prompts, args.max_tokens)
                verify[system] = {"streams": len(streams), "other_text": differ,
                                  "errors": Counter(s.error for s in streams if s.error)}
            bar.update()
            for r, clients, system in plan:
                bar.set_description(f"round {r + 1}: {NAMES[system]}, {clients} streams")
                result = uvloop.run(measure(targets[system], prompts, clients, args.warmup,
                                            args.duration, args.max_tokens, groups[system],
                                            server_url))
                runs.append({"system": system, "round": r, "clients": clients, **result})
                bar.update()
            profile = None
            if args.py_spy:
                bar.set_description("py-spy: shoal at the largest level")
                spied = profiles.record(
                    {"gateway": gateway, "worker": worker, "sglang-http": server},
                    args.duration, args.py_spy)
                extra = uvloop.run(measure(targets["shoal"], prompts, max(args.clients), 0.5,
                                           args.duration + 1.0, args.max_tokens,
                                           groups["shoal"]))
                for process in spied:
                    process.wait(60)
                profile = {"run": extra, "processes": profiles.report(args.py_spy,
                                                                      int(args.duration))}
                bar.update()
    return {"machine": machine_info(), "model": {
                "id": MODEL_ID, "hidden_size": HIDDEN_SIZE, "layers": 2, "heads": 4,
                "kv_heads": 2, "vocab": tokenizer.vocab_size},
            "server_argv": [a for a in server_argv if a],
            "sglang_version": sglang_version(),
            "duration": args.duration, "warmup": args.warmup, "rounds": args.rounds,
            "max_tokens": args.max_tokens, "systems": list(systems),
            "prompts": {"used": len(prompts), "candidates": len(candidates),
                        "prompt_tokens": [len(p.ids) for p in prompts]},
            "idle_cores": idle, "verify": {s: {**v, "errors": dict(v["errors"])}
                                           for s, v in verify.items()},
            "runs": runs, "summary": summarise(runs), "profile": profile}


def sglang_version() -> str | None:
    from runtimes.sglang.server import sglang_python

    found = sorted(sglang_python().parent.parent.glob(
        "lib/python*/site-packages/sglang-*.dist-info"))
    return found[0].name.removesuffix(".dist-info").split("-", 1)[1] if found else None


def plot(path: Path, summary: Sequence[Mapping[str, Any]], title_text: str) -> Path:
    """Output tokens/s and TTFT p50 (p99 dotted) per level, both systems."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    levels = [row["clients"] for row in summary]
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    colors = {"shoal": "tab:blue", "bare": "tab:orange", "native": "tab:gray"}
    for system in [s for s in NAMES if f"{s}_tokens_per_s" in summary[0]]:
        left.plot(levels, [row[f"{system}_tokens_per_s"] or 0 for row in summary], "o-",
                  color=colors[system], label=NAMES[system])
        right.plot(levels, [row[f"{system}_ttft_p50_ms"] for row in summary], "o-",
                   color=colors[system], label=f"{NAMES[system]} p50")
        right.plot(levels, [row[f"{system}_ttft_p99_ms"] for row in summary], "s:",
                   color=colors[system], label=f"{NAMES[system]} p99")
    left.set_title("output tokens/s (higher is better)")
    right.set_title("time to first token, ms (lower is better)")
    right.set_yscale("log")
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xticks(levels, [str(n) for n in levels])
        axis.minorticks_off()
        axis.set_xlabel("concurrent streams")
        axis.grid(True, alpha=0.3)
        axis.legend()
    left.set_ylim(bottom=0)
    fig.suptitle(title_text)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.sglang", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=parse_levels, default=[1, 8, 32],
                        help="concurrent streams per level, comma-separated (default 1,8,32)")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per level")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before each")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="tokens every stream generates (greedy, checked)")
    parser.add_argument("--prompts", type=int, default=64, help="distinct prompts")
    parser.add_argument("--json", type=Path, help="write runs and summary here")
    parser.add_argument("--plot", type=Path, help="plot throughput and TTFT per level here")
    parser.add_argument("--native", action="store_true",
                        help="also measure SGLang's native /generate (what shoal's runtime "
                             "calls), for reference")
    parser.add_argument("--py-spy", type=Path, metavar="DIR",
                        help="after the rounds, profile one shoal phase into DIR")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.duration <= 0 or args.warmup < 0:
        parser.error("--rounds must be >= 1, --duration > 0 and --warmup >= 0")
    if not 1 <= args.max_tokens <= 200 or args.prompts < 1:
        parser.error("--max-tokens must be 1..200 (the model's context is 256) and "
                     "--prompts >= 1")
    return args


def command(args: argparse.Namespace) -> str:
    return (f"python -m bench.sglang --clients {','.join(map(str, args.clients))} "
            f"--duration {args.duration:g} --warmup {args.warmup:g} --rounds {args.rounds} "
            f"--max-tokens {args.max_tokens}" + (" --native" if args.native else ""))


def main(argv: list[str] | None = None) -> int:
    from bench.lib.output import emit

    args = parse_args(argv)
    data = run(args)
    idle = ", ".join(f"{name} {cores:.2f}" for name, cores in data["idle_cores"].items())
    print(f"`{command(args)}` (SGLang {data['sglang_version']}, {args.max_tokens} tokens "
          f"per stream, {data['prompts']['used']} prompts; medians over rounds; ratios and "
          f"added TTFT per round, then their median)\n")
    print(f"idle CPU cores before the run: {idle}\n")
    if args.plot:
        plot(args.plot, data["summary"],
             f"shoal + SGLang vs bare SGLang {data['sglang_version']}, streamed, tiny Llama "
             f"on {data['machine'].get('nproc')} CPU cores, {args.max_tokens} tokens/stream")
    code = emit(table(data["summary"]), data, args.json)
    print("\n" + "\n".join(verdicts(data["summary"])))
    if data["profile"]:
        for name, entry in data["profile"]["processes"].items():
            print(f"\npy-spy, {name}: {entry['cores']:.2f} cores holding the GIL")
            for thread, info in list(entry["threads"].items())[:3]:
                print(f"  thread {thread} ({100 * info['share']:.0f}%), % on stack, "
                      "% innermost:")
                for function, inclusive, own in sorted(info["top"], key=lambda t: -t[2])[:12]:
                    print(f"    {inclusive:5.1f} {own:5.1f}  {function}")
    errors = sum(row["shoal_errors"] + row["bare_errors"] for row in data["summary"])
    if errors:
        print(f"\nwarning: {errors} failed or unexpected streams (error_kinds in the runs)",
              file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
