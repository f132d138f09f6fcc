"""bench.claims' and bench.bulk's pure parts: images, schedules, memory peaks, summaries,
tables, argument parsing. Nothing here is timed."""

from __future__ import annotations

import io

import numpy as np
import pytest

from app.tuning.load import LoadResult
from bench import bulk, claims, claims_report

# --------------------------------------------------------------------------- claims


def load(p50: float | None, p99: float | None, *, requests: int = 100, duration: float = 10.0,
         errors: int = 0, dropped: int = 0, cpu: dict[str, float] | None = None) -> LoadResult:
    return LoadResult(mode="open", offered=10.0, duration=duration, requests=requests,
                      items=requests, req_per_s=requests / duration, items_per_s=0.0,
                      p50_ms=p50, p90_ms=None, p99_ms=p99, errors=errors, error_kinds={},
                      dropped=dropped, attempted=requests + errors + dropped,
                      median_batch_requests=None, simulated=False,
                      cpu_ms_per_request=cpu or {})


def test_png_side_solves_rows_of_a_filter_byte_and_three_bytes_a_pixel() -> None:
    for target in (1000, 4_000_000, 12_345_678):
        side = claims_report.png_side(target)
        assert side * (3 * side + 1) <= target < (side + 1) * (3 * side + 4)
    with pytest.raises(ValueError):
        claims_report.png_side(2)


def test_make_png_is_a_png_of_about_the_size_asked_and_differs_by_seed() -> None:
    from PIL import Image

    data = claims_report.make_png(60_000, seed=1)
    assert abs(len(data) - 60_000) / 60_000 < 0.02
    image = Image.open(io.BytesIO(data))
    assert image.format == "PNG" and image.mode == "RGB"
    assert image.size == (claims_report.png_side(60_000),) * 2
    assert claims_report.make_png(60_000, seed=2) != data


def test_schedule_reverses_the_modes_in_odd_rounds() -> None:
    assert claims_report.schedule(3, ("inline", "claim", "text")) == [
        (0, "inline"), (0, "claim"), (0, "text"),
        (1, "text"), (1, "claim"), (1, "inline"),
        (2, "inline"), (2, "claim"), (2, "text")]


def test_memory_peaks_and_what_the_phase_added() -> None:
    before = claims_report.Sample(0.0, rss=100, mem_used=50)
    samples = [claims_report.Sample(1.0, rss=120),
               claims_report.Sample(2.0, rss=180, mem_used=70, queue_memory=3, message_bytes=4),
               claims_report.Sample(3.0, rss=90, mem_used=40, queue_memory=5, message_bytes=0)]
    assert claims_report.memory_peaks(samples, before) == {
        "rss_peak": 180, "mem_used_peak": 70, "queue_memory_peak": 5,
        "message_bytes_peak": 4, "rss_added": 80, "mem_used_added": 20}
    # Memory the broker freed during the phase is no negative addition; figures never
    # read (the management API down) stay unknown.
    shrunk = claims_report.memory_peaks([claims_report.Sample(1.0, rss=60)], before)
    assert shrunk["rss_added"] == 0
    assert shrunk["mem_used_peak"] is None and shrunk["mem_used_added"] is None
    assert claims_report.memory_peaks([], claims_report.Sample(0.0))["rss_added"] is None


def test_cores_by_process_adds_up_processes_of_one_kind() -> None:
    result = load(10, 20, requests=200, duration=10.0,
                  cpu={"shoal gateway (11)": 1.0, "shoal gateway (12)": 0.5,
                       "runtime (13)": 20.0, "total": 21.5})
    # ms per request x requests / duration = CPU ms per s.
    assert claims_report.cores_by_process(result) == pytest.approx({"shoal gateway": 0.03,
                                                             "runtime": 0.4})


def row(mode: str, round_: int, p50: float, p99: float, rss_added: int,
        image: LoadResult | None = None, errors: int = 0) -> dict:
    memory = {"rss_peak": 300 + rss_added, "rss_added": rss_added, "mem_used_peak": 200,
              "mem_used_added": rss_added // 2, "queue_memory_peak": 1,
              "message_bytes_peak": 0}
    return claims_report.phase_row(mode, round_, load(p50, p99, errors=errors), image, memory)


def test_summary_takes_medians_per_mode_and_compares_within_rounds() -> None:
    image = load(200, 400, requests=5)
    rows = [row("inline", 0, 20, 100, 80_000_000, image),
            row("claim", 0, 10, 50, 2_000_000, image),
            row("text", 0, 10, 40, 0),
            row("text", 1, 12, 60, 0),
            row("claim", 1, 12, 90, 4_000_000, image, errors=2),
            row("inline", 1, 16, 120, 60_000_000, image),
            row("inline", 2, 30, 110, 70_000_000, image)]  # a round without claim
    summary = claims_report.summarise(rows)
    assert list(summary["modes"]) == ["inline", "claim", "text"]
    inline, claim = summary["modes"]["inline"], summary["modes"]["claim"]
    assert inline["text_p50_ms"] == 20 and inline["rounds"] == 3
    assert claim["text_p99_ms"] == 70 and claim["text_errors"] == 2
    assert summary["modes"]["text"]["image_p50_ms"] is None
    rounds = summary["rounds"]
    assert rounds["claim/inline text_p50_ms"] == [0.5, 0.75]
    assert summary["compare"]["claim/inline text_p50_ms"] == 0.625
    assert rounds["claim-inline rss_added"] == [-78_000_000, -56_000_000]
    assert rounds["claim/text text_p99_ms"] == pytest.approx([1.25, 1.5])
    assert rounds["inline/text text_p99_ms"] == pytest.approx([2.5, 2.0])
    text = claims_report.table(summary)
    assert "| images inline | 20.0 | 110.0 |" in text
    assert "| claim-inline rss_added MB | -78.0, -56.0 | **-67.0** |" in text
    assert "| claim/inline text_p50_ms | 0.50, 0.75 | **0.62** |" in text
    assert "runtime" not in claims_report.cores_table(summary)  # no CPU measured in these rows


def test_summary_without_pairs_has_no_comparisons() -> None:
    summary = claims_report.summarise([row("text", 0, 10, 40, 0)])
    assert summary["compare"] == {} and "within a round" not in claims_report.table(summary)


def test_check_modes_refuses_a_setup_where_the_claim_check_is_not_as_asked() -> None:
    claims.check_modes({"inline": 0, "claim": 4}, images=4)
    with pytest.raises(SystemExit, match="inline one made 1"):
        claims.check_modes({"inline": 1, "claim": 4}, images=4)
    with pytest.raises(SystemExit):
        claims.check_modes({"inline": 0, "claim": 3}, images=4)


def test_claims_arguments() -> None:
    args = claims.parse_args([])
    assert (args.rate, args.image_share, args.image_bytes) == (40.0, 0.05, 4_000_000)
    assert args.modes == ("inline", "claim", "text") and args.json == claims_report.DEFAULT_JSON
    args = claims.parse_args(["--modes", "claim,inline", "--rounds", "2"])
    assert args.modes == ("claim", "inline")
    assert "--modes claim,inline" in claims.command(args)
    for bad in (["--modes", "inline,bogus"], ["--modes", "inline,inline"], ["--modes", ""],
                ["--image-share", "1"], ["--rate", "0"], ["--rounds", "0"],
                ["--image-bytes", "10"]):
        with pytest.raises(SystemExit):
            claims.parse_args(bad)


# --------------------------------------------------------------------------- bulk


def test_ndjson_is_one_text_object_a_line() -> None:
    import orjson

    body = bulk.ndjson(["a", 'quote " and \n newline'])
    lines = body.split(b"\n")
    assert lines[-1] == b"" and len(lines) == 3
    assert [orjson.loads(line) for line in lines[:2]] == [{"text": "a"},
                                                          {"text": 'quote " and \n newline'}]


def test_sample_indices_spread_over_the_input() -> None:
    assert bulk.sample_indices(10, 3) == [0, 4, 9]  # 4.5 rounds to even
    picked = bulk.sample_indices(100_000, 4000)
    assert picked[0] == 0 and picked[-1] == 99_999 and len(picked) == 4000
    assert picked == sorted(set(picked))
    assert bulk.sample_indices(5, 50) == [0, 1, 2, 3, 4]
    assert bulk.sample_indices(5, 1) == [0]
    with pytest.raises(ValueError):
        bulk.sample_indices(0, 1)


def test_check_result_wants_float32_rows_in_input_order() -> None:
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(10, 4)).astype(np.float32)
    rows = [0, 5, 9]
    expected = vectors[rows] * 3  # a scale changes no direction
    assert bulk.check_result(vectors, 10, rows, expected) is None
    assert "shape" in bulk.check_result(vectors[:9], 10, rows, expected)
    assert "float64" in bulk.check_result(vectors.astype(np.float64), 10, rows, expected)
    shuffled = vectors[::-1].copy()
    assert "least cosine" in bulk.check_result(shuffled, 10, rows, expected)
    assert bulk.min_cosine(vectors, -vectors) == pytest.approx(-1.0)


def test_job_ratios_use_the_ceiling_passes_on_either_side() -> None:
    assert bulk.job_ratios([90.0, 100.0], [100.0, 80.0, 120.0]) == pytest.approx([1.0, 1.0])
    with pytest.raises(ValueError):
        bulk.job_ratios([90.0], [100.0])


def test_server_times_from_the_jobs_iso_instants() -> None:
    state = {"created_at": "2026-12-03T21:48:11.251+00:00",
             "started_at": "2026-12-03T21:48:11.255+00:00",
             "finished_at": "2026-12-03T21:48:33.247+00:00"}
    assert bulk.server_times(state) == pytest.approx({"queued": 0.004, "running": 21.992})
    assert bulk.server_times({"created_at": state["created_at"]}) == {"queued": None,
                                                                      "running": None}


def test_job_times_add_up_and_the_cli_has_one_part() -> None:
    assert bulk.JobTimes.parts(1.0, 8.0, 0.5) == bulk.JobTimes(9.5, 1.0, 8.0, 0.5)
    assert bulk.JobTimes(12.0).upload is None


def job(upload: float | None, queue_run: float | None, download: float | None,
        runtime_cores: float = 1.0, total: float | None = None) -> dict:
    times = bulk.JobTimes(total) if total else bulk.JobTimes.parts(upload, queue_run, download)
    return {"seconds": {"upload": upload, "queue_run": queue_run, "download": download,
                        "total": times.total}, "cores": {"runtime": runtime_cores},
            "server_seconds": {"queued": 0.01, "running": queue_run}}


def test_bulk_summary_and_table() -> None:
    jobs = [job(1.0, 9.0, 0.0), job(1.0, 18.0, 1.0), job(2.0, 7.0, 1.0)]
    summary = bulk.summarise(1000, jobs, [100.0, 100.0, 200.0, 100.0])
    assert summary["job_rates"] == [100.0, 50.0, 100.0]
    assert summary["ratios"] == pytest.approx([1.0, 1 / 3, 2 / 3])
    assert summary["ratio"] == pytest.approx(2 / 3)
    assert summary["ceiling_texts_per_s"] == 100.0
    assert summary["seconds"] == {"upload": 1.0, "queue_run": 9.0, "download": 1.0,
                                  "total": 10.0}
    text = bulk.table(summary, "http")
    assert "| 1000 | 100.0 | 100.0 | **0.67** | 10.0 | 1.00 | 9.0 | 1.00 |" in text
    assert "NOT met" in text and "queue+run 90.0%" in text
    assert "running 9.0 s" in text and "CPU cores over the job: runtime 1.00" in text
    cli = bulk.summarise(1000, [job(None, None, None, total=5.0)], [100.0, 100.0])
    assert cli["ratio"] == 2.0 and cli["seconds"]["upload"] is None
    text = bulk.table(cli, "cli")
    assert "| 5.0 | - | - | - |" in text
    assert ": met" in text and "wall time split" not in text


def test_bulk_arguments() -> None:
    args = bulk.parse_args([])
    assert (args.texts, args.rounds, args.via, args.ceiling_texts) == (100_000, 1, "http", 4000)
    assert args.batches == [16, 32, 64, 128]
    args = bulk.parse_args(["--texts", "5000", "--via", "cli", "--batches", "32,64"])
    assert "--texts 5000" in bulk.command(args) and "--batches 32,64" in bulk.command(args)
    for bad in (["--texts", "0"], ["--via", "grpc"], ["--batches", "0"], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            bulk.parse_args(bad)


# --------------------------------------------------------------------------- rawhttp


def test_a_connection_idle_near_the_servers_keep_alive_timeout_is_replaced() -> None:
    """bench.claims' open loops keep spare connections that sit idle between bursts;
    uvicorn closes one after 5 s and a request written to it would fail."""
    import asyncio
    import contextlib

    from app.tuning import rawhttp

    async def scenario() -> int:
        connections = 0

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal connections
            connections += 1
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                while await reader.readuntil(b"\r\n\r\n"):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    await writer.drain()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        connection = rawhttp.Connection(f"http://127.0.0.1:{port}")
        request = connection.request_bytes("/", b"", "text/plain")
        assert (await connection.send(request))[0] == 200
        assert (await connection.send(request))[2] == b"ok"  # kept alive
        connection.last_used -= rawhttp.IDLE_RECONNECT_S + 1  # as if idle that long
        assert (await connection.send(request))[0] == 200
        await connection.close()
        server.close()
        return connections

    assert asyncio.run(scenario()) == 2
