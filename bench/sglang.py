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
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.lib import profiles
from bench.lib.args import parse_levels
from bench.sglang_load import (
    Target,
    bodies,
    build_model,
    candidate_prompts,
    each_once,
    greedy_outputs,
    measure,
    score,
    usable,
    write_catalog,
)
from bench.sglang_processes import (
    cmdline,
    group_cpu_seconds,
    group_of,
    process_name,
    sglang_server_of,
)
from bench.sglang_report import plot, summarise, table, verdicts
from bench.sglang_stream import HIDDEN_SIZE, MODEL_ID, NAMES, OFFLINE_ENV, SYSTEMS, schedule


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
            server_argv = cmdline(server).decode(errors="replace").split("\0")[1:]
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
