"""One SGLang HTTP server process per loaded model: start, wait for health, stop.

The server runs `runtimes/sglang/launch.py` (SGLang's launcher plus shoal's parent-death
watch, seed patch and test-only fault hook) with the SGLang venv's python. It gets its own
session (a Ctrl-C for the worker does not reach it; `stop` kills the whole process group),
and the read end of a pipe whose write end only this worker holds: if the worker dies,
the server sees EOF and kills its group (no orphan server survives a killed worker).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from runtimes.worker_side.children import OutputTail, describe_exit

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
LAUNCHER = HERE / "launch.py"
CPU_KERNEL_STUB = HERE / "cpu_kernel_stub"
DEFAULT_PYTHON = REPO / ".venv-sglang" / "bin" / "python"


class ServerStartError(RuntimeError):
    """The SGLang server did not become healthy (its output tail is in the message)."""


class PortTaken(ServerStartError):
    """The port `free_port` chose was taken before the server bound it (another process
    got there in between): the server logs the bind error and stays up without serving,
    so it is stopped at once and a new one started on another port."""


# What SGLang's HTTP server (uvicorn) says when its port is taken.
PORT_TAKEN = "address already in use"


def sglang_python(env: Mapping[str, str] | None = None) -> Path:
    """The SGLang venv's python: SHOAL_SGLANG_PYTHON, else <repo>/.venv-sglang/bin/python."""
    value = (env or {}).get("SHOAL_SGLANG_PYTHON") or os.environ.get("SHOAL_SGLANG_PYTHON")
    return Path(value) if value else DEFAULT_PYTHON


def missing_python_message(python: Path) -> str:
    return (f"the SGLang runtime needs SGLang's own venv, and {python} does not exist: run "
            "`make sglang` (it builds .venv-sglang; `make test` and CI do it too), or set "
            "SHOAL_SGLANG_PYTHON to the python of a venv with sglang installed")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """How to start one model's server."""

    model_path: str
    served_name: str
    device: str = "cpu"
    embedding: bool = False
    threads: int = 0
    # CPU: the KV cache is this many tokens (SGLang sizes it from GPU memory otherwise).
    max_total_tokens: int = 4096
    mem_fraction_static: float = 0.05
    context_length: int | None = None
    log_level: str = "warning"
    extra_args: tuple[str, ...] = ()

    def argv(self, python: Path, port: int) -> list[str]:
        args = [str(python), str(LAUNCHER), "--model-path", self.model_path,
                "--served-model-name", self.served_name, "--host", "127.0.0.1",
                "--port", str(port), "--log-level", self.log_level,
                # Seeded requests repeat (launch.py's SHOAL_SGLANG_SEEDS patch).
                "--sampling-backend", "pytorch",
                # An idle scheduler otherwise polls a whole core (measured: 1.00 core at
                # rest, 0.01 with this; a lone request's TTFT unchanged; BENCHMARKS.md).
                "--sleep-on-idle"]
        if self.device == "cpu":
            args += ["--device", "cpu", "--attention-backend", "torch_native",
                     "--disable-overlap-schedule", "--disable-cuda-graph",
                     "--mem-fraction-static", str(self.mem_fraction_static),
                     "--max-total-tokens", str(self.max_total_tokens)]
        elif self.device != "cuda":
            args += ["--device", self.device]
        if self.context_length:
            args += ["--context-length", str(self.context_length)]
        if self.embedding:
            args.append("--is-embedding")
        return [*args, *self.extra_args]


class SGLangServer:
    """One running SGLang server (one incarnation: a restart is a new SGLangServer)."""

    def __init__(self, config: ServerConfig, env: Mapping[str, str] | None = None) -> None:
        self.config = config
        self.python = sglang_python(env)
        if not self.python.exists():
            raise ServerStartError(missing_python_message(self.python))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        merged = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ, **(env or {}),
                  "PYTHONUNBUFFERED": "1", "SHOAL_SGLANG_SEEDS": "1"}
        if config.device == "cpu":
            # Only on CPU: the import-only sgl_kernel stand-in (see its docstring).
            merged["SGLANG_USE_CPU_ENGINE"] = "1"
            merged["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(CPU_KERNEL_STUB), merged.get("PYTHONPATH")) if p)
            if config.threads > 0:
                merged["OMP_NUM_THREADS"] = str(config.threads)
        read_end, self._write_end = os.pipe()  # both non-inheritable
        merged["SHOAL_SGLANG_PARENT_FD"] = str(read_end)
        self.started = time.monotonic()
        try:
            self.proc = subprocess.Popen(
                config.argv(self.python, self.port), env=merged, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                pass_fds=(read_end,), cwd=str(REPO),
            )
        except BaseException:
            os.close(self._write_end)
            raise
        finally:
            os.close(read_end)
        self.pid = self.proc.pid
        assert self.proc.stdout is not None
        self.output = OutputTail(self.proc.stdout, f"sglang-{self.pid}-output", 60)
        self._stopped = False

    def output_tail(self) -> str:
        return self.output.text()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def describe_exit(self) -> str:
        return describe_exit(self.proc.poll())

    def wait_healthy(self, timeout: float, closed=lambda: False) -> float:
        """Block until GET /health answers 200: the seconds start-up took. ServerStartError
        (with the output tail) if the process exits or `timeout` passes first."""
        import httpx

        deadline = self.started + timeout
        with httpx.Client(timeout=5.0) as client:
            while True:
                if closed():
                    raise ServerStartError("the runtime was closed while the server started")
                if not self.alive():
                    raise ServerStartError(
                        f"the SGLang server for {self.config.served_name} (pid {self.pid}) "
                        f"exited during start-up ({self.describe_exit()}); its last output:\n"
                        f"{self.output_tail()}")
                if PORT_TAKEN in self.output_tail():
                    self.stop()
                    raise PortTaken(
                        f"the SGLang server for {self.config.served_name} (pid {self.pid}) "
                        f"found its port {self.port} taken; its last output:\n"
                        f"{self.output_tail()}")
                if time.monotonic() > deadline:
                    self.stop()
                    raise ServerStartError(
                        f"the SGLang server for {self.config.served_name} (pid {self.pid}) "
                        f"was not healthy within {timeout:.0f}s; its last output:\n"
                        f"{self.output_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.url}/health").status_code == 200:
                        took = time.monotonic() - self.started
                        log.info("SGLang server for %s (pid %d, port %d) healthy in %.1fs",
                                 self.config.served_name, self.pid, self.port, took)
                        return took
                time.sleep(0.25)

    def stop(self, grace: float = 5.0) -> str:
        """Kill the server with its process group (SIGTERM, then SIGKILL); safe twice."""
        if not self._stopped:
            self._stopped = True
            for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.pid, sig)
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            # Whatever of the group outlived its leader (SGLang's scheduler, detokenizer).
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.close(self._write_end)
        self.output.join()
        return self.describe_exit()

    def reap_group(self) -> None:
        """After the leader died by itself: kill what is left of its group."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
