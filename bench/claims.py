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
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from app.tuning.load import LoadResult, Prepared
from bench.claims_broker import BrokerMemory
from bench.claims_report import (
    BODY_LIMIT,
    CLIP_ID,
    DEFAULT_JSON,
    INLINE_CLAIM_BYTES,
    MB,
    MODES,
    NAMES,
    cores_table,
    make_png,
    memory_peaks,
    phase_row,
    plot,
    png_side,
    schedule,
    summarise,
    table,
)
from bench.lib.minilm import MINILM


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
