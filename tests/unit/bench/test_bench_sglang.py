"""bench.sglang's pure parts (bench.sglang_stream, _load and _report): SSE parsing, token
counts, TTFT/ITL, the summary."""

from __future__ import annotations

import orjson
import pytest

from bench import sglang as b
from bench import sglang_load as load
from bench import sglang_report as report
from bench import sglang_stream as sse


def event(text: str | None = None, *, finish: str | None = None, usage: int | None = None,
          choices: list[dict] | None = None) -> bytes:
    if choices is None:
        choices = [] if text is None else [{"index": 0, "text": text, "finish_reason": finish}]
    payload: dict = {"object": "text_completion", "choices": choices}
    if usage is not None:
        payload["usage"] = {"completion_tokens": usage}
    return orjson.dumps(payload)


# --------------------------------------------------------------------------- SSE


def test_sse_events_split_anywhere_are_put_back_together() -> None:
    raw = b"data: " + event("a") + b"\n\ndata: " + event("b") + b"\n\ndata: [DONE]\n\n"
    for cut in range(1, len(raw)):
        parser = sse.SSEParser()
        assert parser.feed(raw[:cut]) + parser.feed(raw[cut:]) == [event("a"), event("b"),
                                                                   b"[DONE]"]


def test_sse_crlf_multiline_data_and_comments() -> None:
    parser = sse.SSEParser()
    assert parser.feed(b": ping\r\n\r\ndata:one\r\ndata: two\r\n\r\nevent: x\n") == [b"one\ntwo"]
    assert parser.feed(b"\n") == []  # an event without data gives nothing


def test_read_event_completion_and_chat_chunks() -> None:
    assert sse.read_event(event(" hi", finish="length", usage=5)) == sse.Event(" hi", "length",
                                                                                5)
    chat = orjson.dumps({"choices": [{"index": 0, "delta": {"content": "yo"},
                                      "finish_reason": None}], "usage": None})
    assert sse.read_event(chat) == sse.Event("yo")
    role = orjson.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    assert sse.read_event(role) == sse.Event("")


def test_read_event_joins_entries_of_choice_zero_and_ignores_others() -> None:
    data = event(choices=[{"index": 0, "text": "a"}, {"index": 1, "text": "x"},
                          {"index": 0, "text": "b", "finish_reason": "stop"}])
    assert sse.read_event(data) == sse.Event("ab", "stop")


def test_read_event_native_chunks_carry_the_whole_text_and_their_tokens() -> None:
    data = orjson.dumps({"text": " a b", "output_ids": [5, 6], "meta_info": {
        "completion_tokens": 2, "finish_reason": {"type": "length", "length": 2}}})
    assert sse.read_event(data) == sse.Event(" a b", "length", 2, whole=True)
    data = orjson.dumps({"text": " a", "meta_info": {"completion_tokens": 1,
                                                     "finish_reason": None}})
    assert sse.read_event(data) == sse.Event(" a", None, 1, whole=True)


def test_read_event_usage_only_done_errors_and_garbage() -> None:
    assert sse.read_event(event(choices=[], usage=64)) == sse.Event(tokens=64)
    assert sse.read_event(b" [DONE]") == sse.Event(done=True)
    shoal = orjson.dumps({"error": {"code": "STREAM_INTERRUPTED", "message": "gone"}})
    assert sse.read_event(shoal).error == "STREAM_INTERRUPTED"
    sglang = orjson.dumps({"error": {"message": "bad", "type": "BadRequest"}})
    assert sse.read_event(sglang).error == "BadRequest"
    assert sse.read_event(b"{not json").error == "malformed event"
    assert sse.read_event(b"[1, 2]").error == "malformed event"


# --------------------------------------------------------------------------- tokens, timings


def test_tokens_at_counts_a_token_without_text_with_the_next_one() -> None:
    lengths = sse.prefix_lengths(["a", "a b", "a b", "a b c"])
    assert lengths == [0, 1, 3, 3, 5]
    assert [sse.tokens_at(lengths, n) for n in (1, 3, 5)] == [1, 2, 4]
    assert sse.tokens_at(lengths, 99) == 4  # never more than the tokens there are


def test_lengths_seen_from_chunks_that_said_their_tokens() -> None:
    chunks = [(1.0, 2, 1), (2.0, 4, 2), (3.0, 9, 5), (4.0, 9, 5), (5.0, 11, 6)]
    lengths = sse.lengths_seen(chunks, 7)
    assert lengths == [0, 2, 4, 4, 4, 9, 11, 11]
    # Read back, each chunk gets the count it said.
    assert [sse.tokens_at(lengths, chars) for _, chars, _ in chunks] == [1, 2, 5, 5, 6]
    assert sse.lengths_seen([], 2) == [0, 0, 0]


def stream(sent: float, chunks: list[tuple[float, int, int | None]], tokens: int | None = None,
           error: str | None = None, prompt: int = 0) -> sse.Stream:
    return sse.Stream(prompt, sent, chunks=chunks, completion_tokens=tokens, error=error)


def test_token_counts_prefer_what_the_chunk_says_then_the_text_then_one_each() -> None:
    said = stream(0.0, [(1.0, 1, 1), (2.0, 5, 3)])
    assert sse.token_counts(said, [0, 9, 9, 9]) == [1, 3]
    read = stream(0.0, [(1.0, 1, None), (2.0, 5, None)])
    assert sse.token_counts(read, [0, 1, 3, 5]) == [1, 3]
    assert sse.token_counts(read, None) == [1, 2]


def test_timings_divide_a_chunks_gap_among_its_tokens() -> None:
    s = stream(10.0, [(10.020, 1, None), (10.030, 2, None), (10.060, 5, None),
                      (10.061, 5, None), (10.071, 6, None)])
    ttft, itl = sse.timings(s, [1, 2, 5, 5, 6])
    assert ttft == pytest.approx(20.0)
    # 10 ms for one token, 30 ms for three (10 each), nothing for a chunk of no new
    # token, then 11 ms since the last chunk that had one.
    assert itl == pytest.approx([10.0, 10.0, 10.0, 10.0, 11.0])
    assert sse.timings(stream(0.0, []), []) == (None, [])


def test_check_wants_exactly_the_expected_tokens() -> None:
    assert sse.check(stream(0.0, [], tokens=64), 64) is None
    assert sse.check(stream(0.0, [], tokens=63), 64) == "63 tokens, not 64"
    assert sse.check(stream(0.0, [], tokens=None), 64) == "None tokens, not 64"


def test_score_checks_lengths_and_counts_other_texts() -> None:
    prompt = load.Prompt("x", [101], shoal_text="a bc", lengths=[0, 1, 4])
    same = stream(0.0, [(1.0, 1, None), (2.0, 4, None)], tokens=2)
    same.text = "a bc"
    other = stream(0.0, [(1.0, 2, None), (2.0, 3, None)], tokens=2)
    other.text = "xyz"
    short = stream(0.0, [(1.0, 1, None)], tokens=1)
    counts, differ = load.score("shoal", [same, other, short], [prompt], 2)
    assert counts == [[1, 2], [1, 2], [1]]  # the other text: one token a chunk
    assert differ == 1
    assert short.error == "1 tokens, not 2" and same.error is None and other.error is None


def test_score_learns_bare_sglangs_text_and_token_table_from_its_first_stream() -> None:
    prompt = load.Prompt("x", [101])
    first = stream(0.0, [(1.0, 2, 1), (2.0, 8, 3)], tokens=3)
    first.text = " a bb cc"
    counts, differ = load.score("bare", [first], [prompt], 3)
    assert prompt.bare_text == first.text and prompt.bare_lengths == [0, 2, 2, 8]
    assert counts == [[1, 3]] and differ == 0
    later = stream(0.0, [(1.0, 2, None), (2.0, 8, None)], tokens=3)
    later.text = first.text
    assert load.score("bare", [later], [prompt], 3) == ([[1, 3]], 0)


def test_prefill_share_from_two_reads_of_sglangs_loads() -> None:
    before = {"total_prefill_busy_us": 1_000_000, "total_prefill_uncached_tokens": 100}
    after = {"total_prefill_busy_us": 3_000_000, "total_prefill_uncached_tokens": 900}
    assert load.prefill_share(before, after, 8.0) == {"prefill_busy_share": 0.25,
                                                   "prefill_tokens_per_s": 100.0}
    assert load.prefill_share({}, {}, 1.0)["prefill_busy_share"] == 0.0


def test_percentile_matches_numpy_linear() -> None:
    import numpy as np

    values = [5.0, 1.0, 9.0, 3.0, 7.5, 2.0]
    for q in (0, 25, 50, 90, 99, 100):
        assert sse.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert sse.percentile([], 50) is None


def test_phase_stats_counts_tokens_in_the_window_and_latency_of_streams_started_in_it() -> None:
    inside = stream(10.5, [(10.6, 1, None), (10.7, 2, None), (11.2, 4, None)], tokens=4)
    early = stream(9.0, [(9.9, 1, None), (10.1, 3, None)], tokens=3)  # started before
    failed = stream(10.2, [(10.3, 1, None)], error="HTTP 503")
    late = stream(10.9, [(11.5, 1, None)], tokens=1)  # first token after the end
    streams = [inside, early, failed, late]
    counts = [sse.token_counts(s, None) for s in streams]
    counts[0] = [1, 2, 4]
    counts[1] = [1, 3]
    stats = sse.phase_stats(streams, 10.0, 11.0, counts)
    # Window [10, 11): inside's first two tokens, early's second chunk (2 tokens); not
    # the failed stream's, nor anything at or after 11.
    assert stats["tokens"] == 4
    assert stats["tokens_per_s"] == pytest.approx(4.0)
    assert stats["streams"] == 3  # inside, failed, late
    assert stats["errors"] == 1 and stats["error_kinds"] == {"HTTP 503": 1}
    assert stats["ttft_p50_ms"] == pytest.approx(350.0)  # 100 and 600 ms
    # inside: 100 ms, then 500 ms for two tokens (250, 250).
    assert stats["itl_p50_ms"] == pytest.approx(250.0)


# --------------------------------------------------------------------------- plan, summary


def test_schedule_alternates_which_system_goes_first() -> None:
    assert sse.schedule(2, [1, 8]) == [
        (0, 1, "shoal"), (0, 1, "bare"), (0, 8, "shoal"), (0, 8, "bare"),
        (1, 1, "bare"), (1, 1, "shoal"), (1, 8, "bare"), (1, 8, "shoal")]
    assert [s for _, _, s in sse.schedule(2, [1], ("shoal", "bare", "native"))] == [
        "shoal", "bare", "native", "native", "bare", "shoal"]


def run(system: str, r: int, clients: int, tps: float, ttft: float, errors: int = 0) -> dict:
    cpu = {"gateway": 0.25, "worker": 0.5, "rabbitmq": 0.25, "sglang": 1.0} \
        if system == "shoal" else {"sglang": 1.0, "shoal idle": 0.01}
    return {"system": system, "round": r, "clients": clients, "tokens_per_s": tps,
            "ttft_p50_ms": ttft, "ttft_p99_ms": ttft * 2, "itl_p50_ms": 5.0,
            "itl_p99_ms": 50.0, "client_cores": 0.1, "cpu_cores": cpu, "errors": errors,
            "sglang": {"prefill_busy_share": 0.25 if system == "shoal" else 0.5}}


def test_summarise_pairs_systems_within_a_round() -> None:
    runs = [run("shoal", 0, 8, 90, 30), run("bare", 0, 8, 100, 20),
            run("shoal", 1, 8, 50, 60, errors=2), run("bare", 1, 8, 50, 20),
            run("shoal", 2, 8, 120, 24), run("bare", 2, 8, 200, 22)]
    (row,) = report.summarise(runs)
    assert row["clients"] == 8
    assert row["shoal_tokens_per_s"] == 90 and row["bare_tokens_per_s"] == 100
    # Per round 0.9, 1.0, 0.6 -> 0.9 (not 90/100 of the medians by chance: see round 2).
    assert row["ratios"] == pytest.approx([0.9, 1.0, 0.6])
    assert row["ratio_tokens_per_s"] == pytest.approx(0.9)
    assert row["added_ttft_p50_ms_rounds"] == pytest.approx([10, 40, 2])
    assert row["added_ttft_p50_ms"] == pytest.approx(10)
    assert row["added_ttft_p99_ms"] == pytest.approx(20)
    assert row["shoal_cores"] == pytest.approx(2.0)
    assert row["shoal_cpu_worker"] == pytest.approx(0.5)
    assert row["bare_cpu_sglang"] == pytest.approx(1.0)
    # gateway + worker + RabbitMQ = 1 core: 1000 ms / (90, 50, 120 tokens) -> median
    assert row["shoal_cpu_ms_per_token"] == pytest.approx(1000 / 90)
    assert (row["shoal_errors"], row["bare_errors"]) == (2, 0)


def test_summarise_skips_rounds_missing_a_system_and_empty_values() -> None:
    runs = [run("shoal", 0, 1, 10, 5), {**run("bare", 1, 1, 0, 5), "ttft_p50_ms": None}]
    (row,) = report.summarise(runs)
    assert row["ratio_tokens_per_s"] is None and row["added_ttft_p50_ms"] is None
    assert row["bare_ttft_p50_ms"] is None


def test_table_and_verdicts() -> None:
    summary = report.summarise([run("shoal", 0, 1, 95, 24), run("bare", 0, 1, 100, 20),
                           run("shoal", 0, 32, 50, 300), run("bare", 0, 32, 100, 60)])
    lines = report.table(summary).splitlines()
    assert lines[0].startswith("| streams |") and len(lines) == 11
    assert "| 1 | 95 | 100 | 0.95 | 24.0 | 20.0 | +4.0 |" in lines[2]
    assert lines[10] == ("| 32 | 0.25 | 0.50 | 0.25 | 1.00 | 1.00 | 0.01 | 0.10, 0.10 | 20.00 "
                         "| 25%, 50% |")
    verdicts = report.verdicts(summary)
    assert "0.95x bare (meets" in verdicts[0] and "+4.0 ms (meets" in verdicts[0]
    assert "0.50x bare (misses" in verdicts[1] and "+240.0 ms (misses" in verdicts[1]


def test_native_reference_gets_its_own_columns_and_rows() -> None:
    runs = [run("shoal", 0, 1, 95, 24), run("bare", 0, 1, 100, 20),
            run("native", 0, 1, 110, 18, errors=1)]
    (row,) = report.summarise(runs)
    assert row["native_tokens_per_s"] == 110 and row["native_errors"] == 1
    assert row["ratio_tokens_per_s"] == pytest.approx(0.95)  # shoal/bare, still
    text = report.table([row])
    assert "| 1 | 110 | 18.0 | 36 | 5.0 | 1 |" in text
    assert "native" not in report.table(report.summarise(runs[:2]))


# --------------------------------------------------------------------------- requests, CLI


def test_bodies_same_prompt_greedy_and_length_for_both_systems() -> None:
    prompts = [load.Prompt("a cat", [101, 1037, 4937])]
    shoal = orjson.loads(load.bodies("shoal", prompts, 64)[0])
    bare = orjson.loads(load.bodies("bare", prompts, 64)[0])
    for body in (shoal, bare):
        assert body["max_tokens"] == 64 and body["temperature"] == 0 and body["stream"]
        assert body["model"] == sse.MODEL_ID
        assert body["stream_options"]["include_usage"] is True
    assert shoal["prompt"] == "a cat"
    assert bare["prompt"] == [101, 1037, 4937]  # the ids shoal's runtime sends for it
    assert bare["stream_options"] == shoal["stream_options"] == {"include_usage": True}
    counted = orjson.loads(load.bodies("bare", prompts, 64, counted=True)[0])
    assert counted["stream_options"]["continuous_usage_stats"] is True
    native = orjson.loads(load.bodies("native", prompts, 64)[0])
    assert native["input_ids"] == [101, 1037, 4937] and native["stream"] is True
    assert native["sampling_params"]["max_new_tokens"] == 64
    assert native["sampling_params"]["temperature"] == 0


class FakeTokenizer:
    all_special_ids = [0, 101, 102]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        words = {5: "a", 6: "b", 7: ".", 8: ""}
        return " ".join(words[i] for i in ids if words[i]).replace(" .", ".")


def test_usable_prompts_stream_every_token_as_new_text() -> None:
    tokenizer = FakeTokenizer()
    good = load.Prompt("x", [101], output_ids=[5, 6, 7])
    assert load.usable(good, tokenizer, 3, "length")
    assert good.shoal_text == "a b." and good.lengths == [0, 1, 3, 4]
    assert not load.usable(load.Prompt("x", [101], output_ids=[5, 6]), tokenizer, 3, "length")
    assert not load.usable(load.Prompt("x", [101], output_ids=[5, 6, 7]), tokenizer, 3, "stop")
    assert not load.usable(load.Prompt("x", [101], output_ids=[5, 102, 6]), tokenizer, 3, "length")
    assert not load.usable(load.Prompt("x", [101], output_ids=[5, 8, 6]), tokenizer, 3, "length")


def test_parse_args_defaults_and_checks() -> None:
    args = b.parse_args([])
    assert args.clients == [1, 8, 32] and args.rounds == 3 and args.max_tokens == 64
    assert b.command(args).startswith("python -m bench.sglang --clients 1,8,32 ")
    for bad in (["--rounds", "0"], ["--duration", "0"], ["--max-tokens", "300"],
                ["--clients", "0,2"]):
        with pytest.raises(SystemExit):
            b.parse_args(bad)
