"""`shoal embed` and `shoal run-job`: run a JSONL file as a bulk job on a gateway.

Upload the file (streamed, never read whole), follow the job's progress with a
progress bar, download the result. Ctrl-C while it runs asks whether to cancel
the job (DELETE /v1/jobs/{id}); otherwise the job goes on and the command
carries on waiting.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8080"
CHUNK = 1024 * 1024
POLL_S = 0.5


class JobFailed(RuntimeError):
    pass


def add_parser(sub: argparse._SubParsersAction) -> None:
    embed = sub.add_parser("embed", help="embed a JSONL file (one text per line) into a .npy "
                           "file, as a bulk job on a gateway")
    _common(embed)
    embed.set_defaults(run=_run, operation="encode")

    run_job = sub.add_parser("run-job", help="run any bulk job (encode, score, extract, "
                             "classify) over a JSONL file on a gateway")
    run_job.add_argument("--operation", required=True,
                         choices=["encode", "score", "extract", "classify"])
    run_job.add_argument("--query", help="score: the query the items are scored against")
    _common(run_job)
    run_job.set_defaults(run=_run)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", type=Path, help='JSONL: {"text": ...} or a JSON string per '
                        "line")
    parser.add_argument("-o", "--output", type=Path, required=True,
                        help="where the result goes (.npy for dense embeddings, else JSONL)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--options", type=json.loads, default=None,
                        help='the operation\'s options as JSON, e.g. \'{"dimensions": 128}\'')
    parser.add_argument("--url", default=os.environ.get("SHOAL_URL", DEFAULT_URL),
                        help=f"the gateway (default: $SHOAL_URL or {DEFAULT_URL})")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _run(args: argparse.Namespace) -> int:
    try:
        job = run_job(args.url, args.operation, args.model, args.input, args.output,
                      options=args.options, query=getattr(args, "query", None),
                      progress=not args.quiet)
    except JobFailed as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return 1
    print(f"{job['progress']['items_done']} items -> {args.output} (job {job['id']})",
          file=sys.stderr)
    return 0


def run_job(url: str, operation: str, model: str, input_path: Path, output: Path,
            options: dict[str, Any] | None = None, query: str | None = None,
            progress: bool = True) -> dict[str, Any]:
    """Upload, wait, download; the finished job's view. JobFailed if it did not succeed."""
    import httpx

    with httpx.Client(base_url=url, timeout=httpx.Timeout(60, read=600)) as client:
        job = upload(client, operation, model, input_path, options, query, progress)
        job = follow(client, job, progress)
        if job["state"] != "succeeded":
            error = job.get("error") or {}
            raise JobFailed(f"job {job['id']} {job['state']}"
                            + (f": {error.get('code')}: {error.get('message')}" if error else ""))
        download(client, job, output)
        return job


def upload(client: Any, operation: str, model: str, input_path: Path,
           options: dict[str, Any] | None, query: str | None, progress: bool) -> dict[str, Any]:
    params: dict[str, str] = {"operation": operation, "model": model}
    if options is not None:
        params["options"] = json.dumps(options)
    if query is not None:
        params["query"] = query
    size = input_path.stat().st_size
    bar = _bar(size, "upload", progress, unit="B", unit_scale=True)

    def chunks() -> Iterator[bytes]:
        with input_path.open("rb") as f:
            while chunk := f.read(CHUNK):
                bar.update(len(chunk))
                yield chunk

    try:
        r = client.post("/v1/jobs", params=params, content=chunks(),
                        headers={"content-type": "application/x-ndjson",
                                 "content-length": str(size)})
    finally:
        bar.close()
    if r.status_code != 202:
        raise JobFailed(f"the gateway refused the job ({r.status_code}): {_error(r)}")
    return r.json()


def follow(client: Any, job: dict[str, Any], progress: bool) -> dict[str, Any]:
    """Poll the job until it is final, with a bar of items done; Ctrl-C asks to cancel."""
    bar = _bar(job["progress"]["items_total"], "items", progress)
    try:
        while job["state"] in ("queued", "running"):
            try:
                time.sleep(POLL_S)
                r = client.get(f"/v1/jobs/{job['id']}")
                r.raise_for_status()
                job = r.json()
                bar.update(job["progress"]["items_done"] - bar.n)
            except KeyboardInterrupt:
                bar.clear()
                if _confirm(f"\ncancel job {job['id']}? [y/N] "):
                    job = client.delete(f"/v1/jobs/{job['id']}").json()
    finally:
        bar.close()
    return job


def download(client: Any, job: dict[str, Any], output: Path) -> None:
    """Stream the result into `output`, which appears whole or not at all."""
    temp = output.with_name(output.name + ".part")
    with client.stream("GET", job.get("result_url") or f"/v1/jobs/{job['id']}/result") as r:
        if r.status_code != 200:
            r.read()
            raise JobFailed(f"cannot download the result ({r.status_code}): {_error(r)}")
        with temp.open("wb") as f:
            for chunk in r.iter_bytes(CHUNK):
                f.write(chunk)
    temp.replace(output)


def _confirm(prompt: str) -> bool:
    try:
        return input(prompt).strip().lower() in ("y", "yes")
    except (EOFError, KeyboardInterrupt):
        return True  # a second Ctrl-C, or no terminal to ask: the caller means it


def _bar(total: int, what: str, enabled: bool, **kwargs: Any) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=what, disable=not enabled, **kwargs)


def _error(r: Any) -> str:
    try:
        error = r.json()["error"]
        return f"{error['code']}: {error['message']}"
    except Exception:
        return r.text[:500]
