"""Text latency while 5% of requests carry 4 MB images: images inline vs claim-checked.

    .venv/bin/python -m bench.claims [--rate 40] [--image-share 0.05]
        [--image-bytes 4000000] [--duration 20] [--warmup 3] [--rounds 3]
        [--modes inline,claim,text] [--json bench/out/claims.json]
        [--plot docs/bench/claims.png]

One stack (`app.tuning.bench_stack.bench_stack`, a queue prefix of its own): one worker serving the
packaged MiniLM and a tiny random CLIP (`tests.tiny_clip`, built into a temporary folder
with a catalog entry), behind two gateways that differ only in SHOAL_CLAIM_CHECK_BYTES:
- claim-checked: the default (256 KiB), so an image goes to the blob store
  (SHOAL_BLOB_URL: a temporary local folder) and its message carries a claim;
- inline: 10^9, so every image travels inside its message (shoal before the claim check;
  the body limits are raised to let a 4 MB image in).
Both feed the same worker, so every phase measures the same processes and warm models;
only the gateway that takes the load changes (the other sits idle).

Load, per phase: open-loop Poisson arrivals (`app.tuning.load.open_loop`) at --rate requests/s
in all, as two independent streams: texts at (1 - share) x rate, one sentence each
(`app.tuning.mix.make_texts`) to MiniLM's /v1/encode as JSON; images at share x rate, one image
each to the CLIP's /v1/encode as a msgpack body carrying the raw bytes. Each image is an
uncompressed PNG of random pixels of about --image-bytes (a real image of that size whose
decoding is cheap: what is measured is the bytes that travel, not a decoder). The
reference phase ("text" in --modes) sends the same text stream (rate, seed: the same
arrival times) and no images, through the claim-checked gateway: the text latency the
images are compared with.

Broker memory, sampled on a thread during each phase (warm-up included) and --tail
seconds after it: the RSS of RabbitMQ's process (beam.smp, /proc, every 0.2 s: the fine
one), and from its management API every second the node's mem_used and this stack's
queues' memory and message bytes (the API refreshes them every 5 s: coarse, and late,
hence the tail and the --settle seconds before each phase). Each is reported as its peak
and as peak minus its value just before the phase (the broker is shared with whatever
else runs on the machine: node-wide figures move with it).

Phases alternate, in --modes order in even rounds and reversed in odd ones, with the same
arrival schedule per round; ratios (claim-checked / inline) are taken within a round
(phases a minute apart), then their median over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import math
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from app.tuning import markdown
from app.tuning.load import LoadResult, Prepared
from app.tuning.stats import median, ratio

MINILM = "sentence-transformers/all-MiniLM-L6-v2"
CLIP_ID = "bench/tiny-clip"
MODES = ("inline", "claim", "text")
NAMES = {"inline": "images inline", "claim": "claim-checked", "text": "no images (reference)"}
INLINE_CLAIM_BYTES = 1_000_000_000  # over any image: the claim check never fires
BODY_LIMIT = 64 * 1024 * 1024  # both gateways take a 4 MB image in one body
DEFAULT_JSON = Path("bench/out/claims.json")
MB = 1_000_000
# (mode key, what) of the per-mode medians in the summary.
METRICS = ("text_p50_ms", "text_p99_ms", "text_req_per_s", "image_p50_ms", "image_p99_ms",
           "image_req_per_s", "rss_peak", "rss_added", "mem_used_peak", "mem_used_added",
           "queue_memory_peak", "message_bytes_peak")
# Compared within a round: latencies as ratios, memory as a difference (a ratio of two
# near-zero additions says nothing).
RATIOS = ("text_p50_ms", "text_p99_ms", "image_p50_ms")
DIFFERENCES = ("rss_peak", "rss_added", "mem_used_peak", "mem_used_added")


# --------------------------------------------------------------------------- pure parts


def png_side(target_bytes: int) -> int:
    """The side of a square RGB PNG of about `target_bytes` when stored uncompressed: a row
    is one filter byte and 3 bytes a pixel, so side * (3 * side + 1) = target."""
    if target_bytes < 4:
        raise ValueError(f"an image needs a few bytes, got {target_bytes}")
    return max(1, int((math.sqrt(1 + 12 * target_bytes) - 1) / 6))


def make_png(target_bytes: int, seed: int) -> bytes:
    """An uncompressed PNG of random pixels, about `target_bytes` long (random pixels so
    that no layer on the way, compressing or deduplicating, makes it smaller)."""
    import numpy as np
    from PIL import Image

    side = png_side(target_bytes)
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG", compress_level=0)
    return out.getvalue()


def schedule(rounds: int, modes: Sequence[str]) -> list[tuple[int, str]]:
    """(round, mode) in run order: `modes` in even rounds, reversed in odd ones, so that
    neither mode always runs on a broker the other has just loaded."""
    return [(r, mode) for r in range(rounds) for mode in (modes if r % 2 == 0 else modes[::-1])]


@dataclass(frozen=True)
class Sample:
    """The broker's memory at one instant; None where it was not read this time."""

    at: float
    rss: int | None = None  # bytes, beam.smp's resident set
    mem_used: int | None = None  # bytes, the node's own count (management API)
    queue_memory: int | None = None  # bytes, this stack's queues (management API)
    message_bytes: int | None = None  # bytes of the messages in this stack's queues


def memory_peaks(samples: Sequence[Sample], before: Sample) -> dict[str, int | None]:
    """Peak of each figure over `samples`, and for RSS and mem_used the peak minus its value
    in `before` (what the phase added, never below 0)."""
    out: dict[str, int | None] = {}
    for name in ("rss", "mem_used", "queue_memory", "message_bytes"):
        values = [v for s in samples if (v := getattr(s, name)) is not None]
        out[f"{name}_peak"] = max(values) if values else None
    for name in ("rss", "mem_used"):
        peak, base = out[f"{name}_peak"], getattr(before, name)
        out[f"{name}_added"] = None if peak is None or base is None else max(0, peak - base)
    return out


def cores_by_process(result: LoadResult) -> dict[str, float]:
    """CPU cores (CPU seconds per second) of each kind of process over the window, from
    app.tuning.load's ms per completed request: labels lose their pid, so both gateways and
    every runtime add up under one name each."""
    from app.tuning.cpu import process_kind

    out: dict[str, float] = {}
    for label, ms in result.cpu_ms_per_request.items():
        if label == "total":
            continue
        name = process_kind(label)
        out[name] = out.get(name, 0.0) + ms * result.requests / 1000 / result.duration
    return out


def phase_row(mode: str, round_: int, text: LoadResult, image: LoadResult | None,
              memory: Mapping[str, int | None]) -> dict[str, Any]:
    """One phase's figures, flat (what `summarise` reads)."""
    return {"mode": mode, "round": round_,
            "text_p50_ms": text.p50_ms, "text_p99_ms": text.p99_ms,
            "text_req_per_s": text.req_per_s, "text_errors": text.errors + text.dropped,
            "text_error_kinds": text.error_kinds,
            "image_p50_ms": image.p50_ms if image else None,
            "image_p99_ms": image.p99_ms if image else None,
            "image_req_per_s": image.req_per_s if image else None,
            "image_requests": image.attempted if image else 0,
            "image_errors": image.errors + image.dropped if image else 0,
            "image_error_kinds": image.error_kinds if image else {},
            "cores": cores_by_process(text), **memory}


def _difference(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def summarise(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per mode: each metric's median over rounds and errors summed. Per round: claim-checked
    / inline of RATIOS, claim-checked - inline of DIFFERENCES, and each image mode's text
    latency over the reference's; then the median of each over rounds."""
    modes = [m for m in MODES if any(row["mode"] == m for row in rows)]
    per_mode: dict[str, dict[str, Any]] = {}
    for mode in modes:
        mine = [row for row in rows if row["mode"] == mode]
        entry: dict[str, Any] = {key: median([row[key] for row in mine]) for key in METRICS}
        entry["text_errors"] = sum(row["text_errors"] for row in mine)
        entry["image_errors"] = sum(row["image_errors"] for row in mine)
        entry["rounds"] = len(mine)
        names = sorted({name for row in mine for name in row["cores"]})
        entry["cores"] = {n: median([row["cores"].get(n) for row in mine]) for n in names}
        per_mode[mode] = entry
    compare: dict[str, list[float | None]] = {}
    for r in sorted({row["round"] for row in rows}):
        pair = {row["mode"]: row for row in rows if row["round"] == r}
        if "inline" in pair and "claim" in pair:
            for key in RATIOS:
                compare.setdefault(f"claim/inline {key}", []).append(
                    ratio(pair["claim"][key], pair["inline"][key]))
            for key in DIFFERENCES:
                compare.setdefault(f"claim-inline {key}", []).append(
                    _difference(pair["claim"][key], pair["inline"][key]))
        for mode in ("inline", "claim"):
            if mode in pair and "text" in pair:
                for key in ("text_p50_ms", "text_p99_ms"):
                    compare.setdefault(f"{mode}/text {key}", []).append(
                        ratio(pair[mode][key], pair["text"][key]))
    return {"modes": per_mode, "rounds": compare,
            "compare": {key: median(values) for key, values in compare.items()}}


def _num(value: float | None, spec: str, scale: float = 1.0) -> str:
    return markdown.dash(None if value is None else value / scale, spec)


def table(summary: Mapping[str, Any]) -> str:
    """The markdown table of the summary, a row per mode, and the ratios under it."""
    lines = markdown.table(
        ["", "text p50 ms", "text p99 ms", "text req/s", "image p50 ms", "image p99 ms",
         "images/s", "errors (text, image)", "broker RSS peak MB (added)",
         "mem_used peak MB (added)", "queues' memory peak MB", "message bytes peak MB"],
        [[NAMES[mode], _num(m["text_p50_ms"], ".1f"), _num(m["text_p99_ms"], ".1f"),
          _num(m["text_req_per_s"], ".1f"), _num(m["image_p50_ms"], ".0f"),
          _num(m["image_p99_ms"], ".0f"), _num(m["image_req_per_s"], ".2f"),
          f"{m['text_errors']}, {m['image_errors']}",
          f"{_num(m['rss_peak'], '.0f', MB)} (+{_num(m['rss_added'], '.0f', MB)})",
          f"{_num(m['mem_used_peak'], '.0f', MB)} (+{_num(m['mem_used_added'], '.0f', MB)})",
          _num(m["queue_memory_peak"], ".1f", MB), _num(m["message_bytes_peak"], ".1f", MB)]
         for mode, m in summary["modes"].items()],
        align="l" + "r" * 11)
    if summary["compare"]:
        rows = []
        for key, value in summary["compare"].items():
            scale, spec = (MB, "+.1f") if key.startswith("claim-inline") else (1.0, ".2f")
            unit = " MB" if scale == MB else ""
            rounds = ", ".join(_num(v, spec, scale) for v in summary["rounds"][key])
            rows.append([f"{key}{unit}", rounds, f"**{_num(value, spec, scale)}**"])
        lines += ["", *markdown.table(["within a round", "per round", "median"], rows,
                                      align="llr")]
    return "\n".join(lines)


def cores_table(summary: Mapping[str, Any]) -> str:
    names = sorted({n for m in summary["modes"].values() for n in m["cores"]})
    return "\n".join(markdown.table(
        ["", *names], [[NAMES[mode], *(_num(m["cores"].get(n), ".2f") for n in names)]
                       for mode, m in summary["modes"].items()], align="l" + "r" * len(names)))


# --------------------------------------------------------------------------- broker memory


def _rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class BrokerMemory:
    """Samples the broker's memory on a thread of its own: the management API's calls block,
    and the load generator's event loop must not wait on them."""

    def __init__(self, management_url: str, prefix: str, broker_pids: Sequence[int],
                 rss_interval: float = 0.2, api_interval: float = 1.0) -> None:
        self.management_url = management_url
        self.prefix = prefix
        self.broker_pids = list(broker_pids)
        self.rss_interval = rss_interval
        self.api_interval = api_interval
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self, api: bool = True) -> Sample:
        """The figures now: RSS always, the management API's when `api`."""
        from app.tuning.bench_stack import management_get

        rss = [r for pid in self.broker_pids if (r := _rss(pid)) is not None]
        mem_used = queue_memory = message_bytes = None
        if api:
            try:
                nodes = management_get(self.management_url, "nodes?columns=name,mem_used", 5)
                queues = management_get(self.management_url,
                                        "queues?columns=name,memory,message_bytes", 5)
            except (OSError, ValueError) as exc:
                print(f"warning: RabbitMQ's management API: {exc}", file=sys.stderr)
            else:
                mem_used = sum(n.get("mem_used") or 0 for n in nodes)
                mine = [q for q in queues if q["name"].startswith(f"{self.prefix}.")]
                queue_memory = sum(q.get("memory") or 0 for q in mine)
                message_bytes = sum(q.get("message_bytes") or 0 for q in mine)
        return Sample(time.perf_counter(), sum(rss) if rss else None, mem_used, queue_memory,
                      message_bytes)

    def _run(self) -> None:
        next_api = 0.0
        while not self._stop.is_set():
            now = time.perf_counter()
            api = now >= next_api
            if api:
                next_api = now + self.api_interval
            self.samples.append(self.sample(api))
            self._stop.wait(self.rss_interval)

    def __enter__(self) -> BrokerMemory:
        self.samples = []
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="broker-memory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)


# --------------------------------------------------------------------------- run


def write_catalog(directory: Path, model_dir: Path) -> Path:
    """A catalog folder with the tiny CLIP's entry (the packaged MiniLM needs none)."""
    import yaml

    from tests.tiny_clip import PROJECTION_DIM

    catalog = directory / "catalog"
    catalog.mkdir()
    # image_tokens: the class token and one per 8-pixel patch of the 32-pixel input (as
    # tests/conftest.py's entry), what the worker's cost model counts for an image.
    entry = {"id": CLIP_ID, "adapter": "clip", "source": {"path": str(model_dir)},
             "dims": PROJECTION_DIM, "image_tokens": 17}
    (catalog / "tiny-clip.yaml").write_text(yaml.safe_dump(entry, sort_keys=False))
    return catalog


def image_requests(url: str, images: Sequence[bytes]) -> list[Prepared]:
    """Raw HTTP requests for the CLIP's /v1/encode, one image each, as msgpack bodies (the
    bytes raw, as a client that cares about 4 MB would send them)."""
    import msgpack

    from app.tuning.rawhttp import Connection

    connection = Connection(url)
    return [Prepared(connection.request_bytes(f"/v1/encode/{CLIP_ID}",
                                              msgpack.packb({"items": [{"image": image}]}),
                                              "application/msgpack"), 1)
            for image in images]


async def load_phase(url: str, texts: Sequence[Prepared], images: Sequence[Prepared],
                     args: argparse.Namespace, seed: int, with_images: bool,
                     cpu_pids: Sequence[int]) -> tuple[LoadResult, LoadResult | None]:
    """The texts' and (when `with_images`) the images' open loops, side by side."""
    from app.tuning.load import open_loop

    # The same text stream (rate and seed) with images or without: the images are the
    # only difference between phases of a round.
    text_rate = args.rate * (1 - args.image_share)
    text = open_loop(f"{url}/v1/encode/{MINILM}", texts, text_rate, warmup=args.warmup,
                     duration=args.duration, timeout=args.timeout, seed=seed,
                     cpu_pids=cpu_pids)
    if not with_images:
        return await text, None
    image = open_loop(f"{url}/v1/encode/{CLIP_ID}", images, args.rate * args.image_share,
                      warmup=args.warmup, duration=args.duration, timeout=args.timeout,
                      seed=seed + 1_000_003)
    text_result, image_result = await asyncio.gather(text, image)
    return text_result, image_result


def _gateway_ready(url: str, stack: Any) -> None:
    from app.tuning.stack import http_status, wait_for

    wait_for(lambda: http_status(f"{url}/readyz") == 200, 120, "the inline gateway",
             interval=0.2, give_up=stack.exited)


def claims_made(url: str) -> float:
    """Images the gateway at `url` has moved to the blob store (its claims counter)."""
    import urllib.request

    from bench.pool import parse_counters

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    counters = parse_counters(text, ["shoal_gateway_claims_total"])
    return sum(v for (_, labels), v in counters.items() if dict(labels).get("outcome")
               == "uploaded")


def check_modes(claims: Mapping[str, float], images: int) -> None:
    """SystemExit unless the claim-checked gateway claimed each of its `images` and the
    inline one none: else the phases would not compare what they say."""
    if claims["inline"] != 0 or claims["claim"] < images:
        raise SystemExit(f"after {images} images through each gateway, the inline one made "
                         f"{claims['inline']:g} claims and the claim-checked one "
                         f"{claims['claim']:g}: the claim check is not set as this "
                         "benchmark needs")


def send_once(url: str, request: Prepared, timeout: float = 60.0) -> None:
    """One prepared request, answered 200 or SystemExit: before measuring, each gateway
    takes an image (the CLIP's first batch, the blob store's first use stay out of the
    phases, and a broken image path stops the run here rather than as errors later)."""
    from app.tuning.rawhttp import Connection

    async def once() -> tuple[int, bytes]:
        connection = Connection(url)
        try:
            status, _, body = await asyncio.wait_for(connection.send(request.data), timeout)
        finally:
            await connection.close()
        return status, body

    status, body = asyncio.run(once())
    if status != 200:
        raise SystemExit(f"an image through {url} answered {status}: {body[:300]!r}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import os

    import uvloop
    from tqdm import tqdm

    from app.tuning.bench_stack import bench_stack
    from app.tuning.inproc import machine_info
    from app.tuning.load import prepare
    from app.tuning.mix import make_texts
    from app.tuning.stack import Stack, free_port
    from tasks.settings import get_settings
    from tests.tiny_clip import build_tiny_clip

    plan = schedule(args.rounds, args.modes)
    rows: list[dict[str, Any]] = []
    management_url = os.environ.get("SHOAL_MANAGEMENT_URL") or get_settings().management_url
    with tempfile.TemporaryDirectory(prefix="shoal-bench-claims-") as tmp, \
            tqdm(total=len(plan) + 2, unit="step", file=sys.stderr) as bar:
        bar.set_description("building the tiny CLIP and the images")
        root = Path(tmp)
        catalog = write_catalog(root, build_tiny_clip(root / "clip"))
        pngs = [make_png(args.image_bytes, seed) for seed in range(args.distinct_images)]
        texts = make_texts(args.texts, seed=0)
        bar.update()
        bar.set_description("starting the stack (worker, two gateways)")
        prefix = f"shoal-bench-claims-{os.getpid()}"
        env = {"SHOAL_CATALOG_DIR": str(catalog), "SHOAL_BLOB_URL": str(root / "blobs"),
               "SHOAL_MAX_BODY_BYTES": str(BODY_LIMIT),
               "SHOAL_MAX_CLAIM_BODY_BYTES": str(BODY_LIMIT),
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        models = f"{MINILM},{CLIP_ID}"
        with bench_stack(MINILM, extra_env={**env, "SHOAL_MODELS": models},
                         prefix=prefix) as stack:
            # The second gateway: the same stack's env, the claim check off.
            inline = Stack({**os.environ, **env, "SHOAL_QUEUE_PREFIX": prefix,
                            "SHOAL_MODELS": models}, stack.log_dir)
            try:
                port = free_port()
                gateway = inline.gateway("gateway-inline", port, [MINILM, CLIP_ID],
                                         SHOAL_CLAIM_CHECK_BYTES=str(INLINE_CLAIM_BYTES))
                urls = {"inline": f"http://127.0.0.1:{port}", "claim": stack.url,
                        "text": stack.url}
                _gateway_ready(urls["inline"], inline)
                broker = [int(p) for p in subprocess.run(
                    ["pgrep", "-x", "beam.smp"], text=True, capture_output=True).stdout.split()]
                cpu_pids = [*stack.pids, gateway.pid]
                requests = {mode: (prepare(f"{url}/v1/encode/{MINILM}", [[t] for t in texts]),
                                   image_requests(url, pngs)) for mode, url in urls.items()}
                memory = BrokerMemory(management_url, prefix, broker)
                bar.update()
                for mode in ("claim", "inline"):
                    bar.set_description(f"each image once through the {NAMES[mode]} gateway")
                    for image in requests[mode][1]:
                        send_once(urls[mode], image, args.timeout)
                check_modes({mode: claims_made(urls[mode]) for mode in ("inline", "claim")},
                            len(pngs))
                for r, mode in plan:
                    bar.set_description(f"round {r + 1}: {NAMES[mode]}")
                    time.sleep(args.settle)
                    before = memory.sample()
                    with memory:
                        text, image = uvloop.run(load_phase(
                            urls[mode], *requests[mode], args, r, mode != "text", cpu_pids))
                        # The management API's figures trail by up to its statistics
                        # interval (5 s): keep sampling so this phase's peak is its own.
                        time.sleep(args.tail)
                    rows.append(phase_row(mode, r, text, image,
                                          memory_peaks(memory.samples, before))
                                | {"text_load": asdict(text),
                                   "image_load": asdict(image) if image else None})
                    bar.update()
                claims = {mode: claims_made(urls[mode]) for mode in ("inline", "claim")}
            finally:
                inline.stop_all(timeout=30)
    return {"machine": machine_info(), "command": command(args),
            "image_bytes": len(pngs[0]), "image_side": png_side(args.image_bytes),
            "rate": args.rate, "image_share": args.image_share, "duration": args.duration,
            "warmup": args.warmup, "rounds": args.rounds, "modes": list(args.modes),
            "claims_made": claims, "rows": rows, "summary": summarise(rows)}


def plot(path: Path, summary: Mapping[str, Any], title_text: str) -> Path:
    """Text p50/p99 and the broker's added memory per mode, bars side by side."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    modes = list(summary["modes"])
    colors = {"inline": "tab:red", "claim": "tab:blue", "text": "tab:gray"}
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    panels = ((left, (("text_p50_ms", "p50"), ("text_p99_ms", "p99")), 1.0,
               "text requests' latency, ms (lower is better)"),
              (right, (("rss_added", "RSS added"), ("mem_used_added", "mem_used added"),
                       ("queue_memory_peak", "its queues' memory")), MB,
               "RabbitMQ memory: peak - before, MB (lower is better)"))
    for axis, metrics, scale, label in panels:
        width = 0.8 / len(modes)
        for i, mode in enumerate(modes):
            values = [(summary["modes"][mode][key] or 0) / scale for key, _ in metrics]
            bars = axis.bar([x + (i - (len(modes) - 1) / 2) * width for x in range(len(metrics))],
                            values, width=width, color=colors[mode], label=NAMES[mode])
            axis.bar_label(bars, fmt="%.0f", fontsize=8)
        axis.set_xticks(range(len(metrics)), [name for _, name in metrics])
        axis.set_title(label)
        axis.legend()
    fig.suptitle(title_text)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def parse_modes(spec: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in spec.split(",") if m.strip())
    unknown = [m for m in modes if m not in MODES]
    if not modes or unknown or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"modes are a comma-separated subset of "
                                         f"{','.join(MODES)}, got {spec!r}")
    return modes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.claims", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=40.0,
                        help="requests/s in all, texts and images (default 40)")
    parser.add_argument("--image-share", type=float, default=0.05,
                        help="share of the requests that carry an image (default 0.05)")
    parser.add_argument("--image-bytes", type=int, default=4_000_000,
                        help="size of each image (default 4000000)")
    parser.add_argument("--distinct-images", type=int, default=4,
                        help="different images, sent in turn (default 4)")
    parser.add_argument("--texts", type=int, default=200, help="distinct sentences")
    parser.add_argument("--duration", type=float, default=20.0, help="measured seconds a phase")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds before each")
    parser.add_argument("--settle", type=float, default=8.0,
                        help="idle seconds before each phase: the broker frees what the last "
                             "one held, and the management API's 5 s statistics catch up")
    parser.add_argument("--tail", type=float, default=6.0,
                        help="seconds the broker's memory is still sampled after the load")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=60.0, help="per request, seconds")
    parser.add_argument("--modes", type=parse_modes, default=MODES,
                        help="phases of a round: inline, claim, text (the reference: no "
                             "images); default all three")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON,
                        help=f"write rows and summary here (default {DEFAULT_JSON}, not "
                             "committed)")
    parser.add_argument("--plot", type=Path, help="plot the summary here (a PNG)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.duration <= 0 or min(args.warmup, args.settle, args.tail) < 0:
        parser.error("--rounds must be >= 1, --duration > 0, --warmup, --settle and --tail "
                     ">= 0")
    if not args.rate > 0 or not 0 < args.image_share < 1:
        parser.error("--rate must be > 0 and --image-share between 0 and 1")
    if args.image_bytes < 1000 or args.distinct_images < 1 or args.texts < 1:
        parser.error("--image-bytes must be >= 1000, --distinct-images and --texts >= 1")
    return args


def command(args: argparse.Namespace) -> str:
    return (f"python -m bench.claims --rate {args.rate:g} --image-share {args.image_share:g} "
            f"--image-bytes {args.image_bytes} --duration {args.duration:g} "
            f"--warmup {args.warmup:g} --rounds {args.rounds} --modes {','.join(args.modes)}")


def main(argv: list[str] | None = None) -> int:
    from bench.lib.output import emit

    args = parse_args(argv)
    data = run(args)
    print(f"`{command(args)}` ({data['image_bytes'] / MB:.2f} MB PNG images, "
          f"{data['machine'].get('nproc')} CPUs; medians of {args.rounds} rounds; ratios "
          "per round, then their median)\n")
    if args.plot:
        plot(args.plot, data["summary"],
             f"text latency and RabbitMQ memory while {args.image_share:.0%} of "
             f"{args.rate:g} req/s carry {data['image_bytes'] / MB:.0f} MB images")
    code = emit(table(data["summary"]), data, args.json)
    print("\nCPU cores over the text load's window (median over rounds):\n")
    print(cores_table(data["summary"]))
    errors = sum(m["text_errors"] + m["image_errors"] for m in data["summary"]["modes"].values())
    if errors:
        print(f"\nwarning: {errors} failed requests (error kinds in {args.json})",
              file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
