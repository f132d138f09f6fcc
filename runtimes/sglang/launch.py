"""shoal's launcher of SGLang's HTTP server: `python launch.py <sglang launch_server flags>`.

Runs in the SGLang venv (`.venv-sglang`), as a script (not `-m runtimes...`: shoal is not
installed there), started by `runtimes.sglang.server.SGLangServer` instead of
`python -m sglang.launch_server`. It adds three things to SGLang's own launcher, then runs it:

1. Parent-death watch. The worker passes the read end of a pipe (fd in
   `SHOAL_SGLANG_PARENT_FD`) and never writes to it; when the worker dies, however it dies
   (kill -9 included), the pipe reads EOF and this process kills its own process group
   (the server was started in a new session, so the group is SGLang's processes and
   nothing else). An orphan SGLang server never outlives its worker. (PR_SET_PDEATHSIG
   would not do: it fires when the worker *thread* that spawned the server exits.)

2. Per-request seeds. SGLang 0.5.23 honours `sampling_params.sampling_seed` only with
   `--enable-deterministic-inference`, which refuses the `torch_native` attention backend
   of the CPU path. With `SHOAL_SGLANG_SEEDS=1` every batch gets a seed tensor: a request's
   own `sampling_seed`, or a random one drawn once per request. SGLang's pytorch sampler
   then draws each token from (seed, position) (`multinomial_with_seed`), so a seeded
   request repeats whatever else shares its batch. Needs `--sampling-backend pytorch`.

3. TEST-ONLY fault hook, off unless `SHOAL_SGLANG_FAULT_CRASH_ON` is set: a request whose
   prompt (decoded from its input ids) contains that text kills the whole server
   (SIGKILL to its process group), as a poison input that crashes a model would. The
   tests of `tests/sglang` use it to check crash recovery and poison isolation. Never set
   it in production.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading


def _kill_group() -> None:
    if os.getpgrp() == os.getpid():  # our own session: the group is SGLang's, not the worker's
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _watch_parent(fd: int) -> None:
    def watch() -> None:
        try:
            while os.read(fd, 1):
                pass
        except OSError:
            pass
        # The worker read our output: with it gone, writing may raise (EPIPE). Kill first.
        _kill_group()

    threading.Thread(target=watch, name="shoal-parent-watch", daemon=True).start()


def _seed_every_request() -> None:
    import torch
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    original = SamplingBatchInfo.from_schedule_batch.__func__

    def from_schedule_batch(cls, batch, vocab_size):  # type: ignore[no-untyped-def]
        info = original(cls, batch, vocab_size)
        if info.sampling_seed is None:
            seeds = []
            for req in batch.reqs:
                params = req.sampling_params
                if params.sampling_seed is None:
                    params.sampling_seed = random.getrandbits(62)
                seeds.append(params.sampling_seed)
            info.sampling_seed = torch.tensor(seeds, dtype=torch.int64).to(
                info.temperatures.device)
        return info

    SamplingBatchInfo.from_schedule_batch = classmethod(from_schedule_batch)
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
        # SGLang's seeded draw hashes (seed, position, column) with sgl_kernel's
        # murmur_hash32_cpu, which the CPU stub does not have: draw the same kind of
        # Gumbel noise from a torch generator seeded with (seed, position) instead.
        from sglang.srt.layers import sampler

        sampler.multinomial_with_seed = _multinomial_with_seed


def _multinomial_with_seed(logprobs, seed, positions):  # type: ignore[no-untyped-def]
    import torch

    n, m = logprobs.shape
    noise = torch.empty((n, m), dtype=torch.float64)
    generator = torch.Generator(device="cpu")
    for row, (s, p) in enumerate(zip(seed.tolist(), positions.tolist(), strict=True)):
        generator.manual_seed((int(s) * 1_000_003 + int(p)) % (2**63 - 1))
        noise[row].uniform_(generator=generator)
    noise.clamp_(min=2.0**-60, max=1 - 2.0**-52).log_().neg_().log_().neg_()  # Gumbel
    noise.add_(logprobs.to(device="cpu", dtype=torch.float64))
    return torch.argmax(noise, dim=1, keepdim=True).to(logprobs.device)


def _crash_on(marker: str) -> None:
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    original = TokenizerManager.generate_request

    def poisoned(obj) -> bool:  # type: ignore[no-untyped-def]
        texts = obj.text if isinstance(getattr(obj, "text", None), list) else [obj.text]
        if any(isinstance(t, str) and marker in t for t in texts):
            return True
        ids = getattr(obj, "input_ids", None)
        if not ids:
            return False
        rows = ids if isinstance(ids[0], list) else [ids]
        return False if not hasattr(poisoned, "tokenizer") else any(
            marker in poisoned.tokenizer.decode(row) for row in rows)

    async def generate_request(self, obj, request=None):  # type: ignore[no-untyped-def]
        poisoned.tokenizer = self.tokenizer
        if poisoned(obj):
            print(f"shoal TEST fault hook: a request contains {marker!r}; killing the "
                  "SGLang server (SHOAL_SGLANG_FAULT_CRASH_ON)", file=sys.stderr, flush=True)
            _kill_group()
        async for out in original(self, obj, request):
            yield out

    TokenizerManager.generate_request = generate_request


# At import, not under __main__: SGLang spawns its scheduler with multiprocessing's
# "spawn", which runs this module again (as __mp_main__) in each child; the seed patch is
# needed in the scheduler.
if os.environ.get("SHOAL_SGLANG_SEEDS") == "1":
    _seed_every_request()

if __name__ == "__main__":
    if os.environ.get("SHOAL_SGLANG_PARENT_FD"):
        _watch_parent(int(os.environ.pop("SHOAL_SGLANG_PARENT_FD")))
    if os.environ.get("SHOAL_SGLANG_FAULT_CRASH_ON"):
        _crash_on(os.environ["SHOAL_SGLANG_FAULT_CRASH_ON"])
    # What `python -m sglang.launch_server` runs, with this file staying __main__ (so the
    # spawned children import it again and get the patches above).
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(sys.argv[1:])
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
