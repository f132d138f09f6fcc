"""Where a batch's time goes: CPU and wall time per text of each stage, on this device.

    .venv/bin/python -m bench.stages [--device cuda:0] [--precision bf16] [--batch 256]
        [--texts 16] [--repeats 20] [--minilm DIR] [--json PATH]

MiniLM (the packaged weights, or `--minilm`) through the real dense adapter of a
`runtimes.child_side.host.ModelHost`, one batch of `--batch` texts (5-40 words, in requests of
`--texts`) cut into the stages the runtime process runs it in, each timed alone (the
device synchronised at its end, so its kernels count where they ran):

- frames in: the worker encodes the batch's run frame, the runtime decodes it;
- parse: each request checked and parsed (`Adapter.prepare`);
- tokenize: the Rust tokenizer (`DenseEncoder.tokenize`);
- pack: length-sorted chunks padded into (pinned) host tensors (`DenseEncoder.chunks`);
- host->device: the chunks copied to the device;
- forward: the model's passes (CUDA graphs where `runtimes.pytorch.buckets` has them);
- pool: pooling, and the conversion to float32;
- device->host: the pooled vectors copied back;
- results: normalisation, dimensions, each request's result (`dense_results`);
- frames out: the runtime encodes its reply, the worker decodes it.

Per stage: wall µs per text, CPU µs per text (the process's, every thread: the tokenizer
spreads a batch over its own threads where TOKENIZERS_PARALLELISM allows, as in the
runtime process), and its share of the sum;
the medians of `--repeats` runs after warm-up. The sum is what one preparation worker
pays per text in series, so `1e6 / sum` is one worker's ceiling in texts/s; the stage
with the largest CPU share is the next bottleneck. The runtime overlaps these stages on
three threads (`runtimes.child_side.pipeline`), which this does not: it names costs, not overlap.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.tuning import markdown
from bench.lib.minilm import MINILM, texts
from bench.lib.output import emit

HEADER_BYTES = 4  # runtimes.wire.protocol's length prefix
STAGES = ("frames in", "parse", "tokenize", "pack", "host->device", "forward", "pool",
          "device->host", "results", "frames out")


def _catalog(minilm: str | None) -> Path:
    from tasks.settings import PACKAGED_CATALOG_DIR

    if minilm is None:
        return PACKAGED_CATALOG_DIR
    import tempfile

    import yaml

    folder = Path(tempfile.mkdtemp(prefix="shoal-stages-"))
    (folder / "minilm.yaml").write_text(yaml.safe_dump(
        {"id": MINILM, "adapter": "dense", "source": {"path": str(minilm)}, "dims": 384}))
    return folder


def measure(device: str, precision: str, batch: int, per_request: int, repeats: int,
            minilm: str | None = None) -> dict[str, dict[str, float]]:
    """{stage: {"wall_us", "cpu_us"}} per text, medians over `repeats` runs."""
    import torch

    from runtimes.base import Request, prepare_each
    from runtimes.child_side.host import ModelHost
    from runtimes.child_side.pipeline import outcomes_reply
    from runtimes.families.vectors import dense_results
    from runtimes.pytorch import buckets
    from runtimes.pytorch.text import HostCopy, to_device
    from runtimes.wire.frames import BATCH_REPLY_DECODER, BATCH_REQUEST_DECODER, Run, RunRequest
    from runtimes.wire.protocol import encode_frame
    from tasks.catalog import load_catalog

    load_catalog.cache_clear()
    host = ModelHost(device=device, precision=precision)
    host.load(load_catalog(_catalog(minilm)).require([MINILM]))
    adapter: Any = host.adapter(MINILM)
    encoder = adapter.encoder
    requests = [Request(f"r{i}", "encode", {"items": [
        {"text": t} for t in texts(per_request, seed=i)]}) for i in range(batch // per_request)]
    cuda = device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def one_run() -> dict[str, tuple[float, float]]:
        timings: dict[str, tuple[float, float]] = {}
        carried: dict[str, Any] = {}

        def stage(name: str, work: Callable[[], Any]) -> Any:
            wall, cpu = time.perf_counter(), time.process_time()
            out = work()
            sync()
            timings[name] = (time.perf_counter() - wall, time.process_time() - cpu)
            return out

        def frames_in() -> list[Request]:
            frame = encode_frame(Run(MINILM, [RunRequest(r.id, r.op, r.kwargs, r.stream)
                                              for r in requests], False))
            run = BATCH_REQUEST_DECODER.decode(memoryview(frame)[HEADER_BYTES:])
            return [Request(r.id, r.op, r.kwargs, r.stream) for r in run.requests]

        decoded = stage("frames in", frames_in)
        _, runnable = stage("parse", lambda: prepare_each(
            MINILM, adapter.operation, decoded, lambda r: adapter.prepare(r.kwargs)))
        prepared = [p for _, p in runnable]
        texts_ = [t for parsed in prepared for t in adapter.prompted(parsed)]
        tokens = stage("tokenize", lambda: encoder.tokenize(texts_))
        chunks = stage("pack", lambda: encoder.chunks(tokens))
        with torch.inference_mode():
            on_device = stage("host->device", lambda: [to_device(c, device)
                                                       for _, c in chunks])
            carried["hidden"] = stage("forward", lambda: [
                buckets.forward(encoder.model, inputs, "last_hidden_state", None,
                                encoder.loras) for inputs in on_device])
            pooled = stage("pool", lambda: [
                encoder._pool(h, inputs["attention_mask"]).float()
                for h, inputs in zip(carried["hidden"], on_device, strict=True)])
            copy = stage("device->host", lambda: HostCopy(pooled).wait())
        vectors = encoder.gather(chunks, _Copied(copy), len(tokens.input_ids))
        results = stage("results", lambda: dense_results(prepared, vectors, tokens.input_ids,
                                                         encoder.normalize))

        def frames_out() -> Any:
            from runtimes.base import Outcome

            frame = encode_frame(outcomes_reply([Outcome(r.id, result=res) for r, res in
                                                 zip(decoded, results, strict=True)]))
            return BATCH_REPLY_DECODER.decode(memoryview(frame)[HEADER_BYTES:])

        stage("frames out", frames_out)
        return timings

    for _ in range(3):  # warm-up: kernels chosen, allocator grown, the tokenizer's twin made
        one_run()
    runs = [one_run() for _ in range(repeats)]
    return {name: {"wall_us": statistics.median(r[name][0] for r in runs) / batch * 1e6,
                   "cpu_us": statistics.median(r[name][1] for r in runs) / batch * 1e6}
            for name in STAGES}


class _Copied:
    """Outputs already on the host, as a HostCopy's `wait` gives them."""

    def __init__(self, outputs: list[Any]) -> None:
        self._outputs = outputs

    def wait(self) -> list[Any]:
        return self._outputs


def table(stages: dict[str, dict[str, float]]) -> str:
    cpu_total = sum(s["cpu_us"] for s in stages.values())
    wall_total = sum(s["wall_us"] for s in stages.values())
    rows = [[name, f"{s['wall_us']:.2f}", f"{s['cpu_us']:.2f}",
             f"{s['cpu_us'] / cpu_total:.0%}" if cpu_total else "-"]
            for name, s in stages.items()]
    rows.append(["**sum**", f"**{wall_total:.2f}**", f"**{cpu_total:.2f}**", "100%"])
    lines = markdown.table(["stage", "wall µs/text", "CPU µs/text", "CPU share"], rows,
                           align="lrrr")
    ceiling = f"\none preparation worker, these stages in series: {1e6 / wall_total:,.0f} " \
              f"texts/s at most" if wall_total else ""
    return "\n".join(lines) + ceiling


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stages",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="default: cuda:0 if there is one")
    parser.add_argument("--precision", default=None, help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--texts", type=int, default=16, help="texts per request")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--minilm", default=None, help="MiniLM's model folder")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.batch % args.texts:
        parser.error("--texts must divide --batch")
    import torch

    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    precision = args.precision or ("bf16" if device.startswith("cuda") else "fp32")
    stages = measure(device, precision, args.batch, args.texts, args.repeats, args.minilm)
    head = f"stages of one batch of {args.batch} texts ({args.texts} per request), MiniLM " \
           f"{precision} on {device}, medians of {args.repeats} runs\n\n"
    return emit(head + table(stages), {"device": device, "precision": precision,
                                       "batch": args.batch, "texts": args.texts,
                                       "stages": stages}, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
