"""The peer servers bench.peers runs beside shoal: Infinity from its own venv (torch or
optimum), the ONNX model folder optimum wants, and their versions."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from bench.lib.minilm import MINILM
from bench.peers_report import OFFLINE_ENV, PEERS_VENV, Server, openai_body


def infinity_argv(venv: Path, model_dir: str, port: int, engine: str = "torch") -> list[str]:
    return [str(venv / "bin" / "infinity_emb"), "v2", "--model-id", model_dir,
            "--served-model-name", MINILM, "--engine", engine, "--device", "cpu",
            "--batch-size", "32", "--no-vector-disk-cache", "--no-compile",
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _answers(url: str) -> bool:
    body = json.dumps(openai_body(["warm up"])).encode()
    request = urllib.request.Request(f"{url}/embeddings", data=body,
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status == 200


def _stop(process: subprocess.Popen[bytes]) -> None:
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(wait)
            return


def has_optimum(venv: Path = PEERS_VENV) -> bool:
    """Whether `venv` has optimum's ONNX Runtime models (infinity-emb[optimum])."""
    return any(venv.glob("lib/python*/site-packages/optimum/onnxruntime/modeling.py"))


def onnx_model_folder(model_dir: Path, graph: Path, folder: Path) -> Path:
    """`folder`: `model_dir` less its weights, with `graph` as `model.onnx`, its first
    output renamed `last_hidden_state` (what optimum's feature-extraction model reads)."""
    import onnx

    shutil.copytree(model_dir, folder, ignore=shutil.ignore_patterns(
        "*.safetensors", "*.bin", "*.onnx", "onnx", "openvino", "*.md", ".git*"))
    proto = onnx.load(str(graph))
    old = proto.graph.output[0].name
    for node in proto.graph.node:
        for i, name in enumerate(node.output):
            if name == old:
                node.output[i] = "last_hidden_state"
    proto.graph.output[0].name = "last_hidden_state"
    onnx.save(proto, str(folder / "model.onnx"))
    return folder


def require_peer(venv: Path = PEERS_VENV) -> Path:
    """Infinity's executable in `venv`; SystemExit saying how to install it if missing."""
    exe = venv / "bin" / "infinity_emb"
    if not exe.exists():
        raise SystemExit(f"Infinity is not installed in {venv}: run `make bench-peers` first")
    return exe


@contextlib.contextmanager
def infinity(model_dir: str, venv: Path = PEERS_VENV, timeout: float = 300,
             engine: str = "torch", graph: Path | None = None,
             name: str = "infinity") -> Iterator[Server]:
    """Infinity serving `model_dir` from `venv` on `engine`, ready once an embedding
    answers. `optimum` serves `graph` from a copy of the folder (`onnx_model_folder`)."""
    from app.tuning.stack import free_port, wait_for

    require_peer(venv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkstemp(prefix=f"shoal-peers-{name}-", suffix=".log")[1])
    env = {**os.environ, **OFFLINE_ENV}
    cwd, model_id, scratch = None, model_dir, None
    if engine == "optimum":
        if graph is None:
            raise ValueError("Infinity's optimum engine needs the ONNX graph to serve")
        scratch = Path(tempfile.mkdtemp(prefix="shoal-peers-onnx-"))
        cwd = onnx_model_folder(Path(model_dir), graph, scratch / "model")
        model_id = "."  # optimum-onnx matches the graph by a path relative to the folder
        env["HF_HUB_CACHE"] = str(scratch / "hub")  # where Infinity puts optimised graphs
    with log.open("wb") as out:
        process = subprocess.Popen(infinity_argv(venv, model_id, port, engine), env=env,
                                   cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        try:
            wait_for(lambda: _answers(url), timeout, "Infinity", interval=0.5,
                     give_up=lambda: None if process.poll() is None
                     else f"it exited with {process.returncode}")
        except (TimeoutError, RuntimeError):
            print(f"--- Infinity's log ({log}):\n{log.read_text(errors='replace')}",
                  file=sys.stderr)
            raise
        yield Server(name, url, [process.pid, *_children(process.pid)])
    finally:
        _stop(process)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    log.unlink()


def peer_version(venv: Path = PEERS_VENV) -> str | None:
    found = sorted(venv.glob("lib/python*/site-packages/infinity_emb-*.dist-info"))
    return found[0].name.removesuffix(".dist-info").split("-", 1)[1] if found else None


def optimum_versions(venv: Path = PEERS_VENV) -> dict[str, str]:
    """optimum's, optimum-onnx's and onnxruntime's versions in `venv`."""
    found = {}
    for path in venv.glob("lib/python*/site-packages/*.dist-info"):
        name, _, version = path.name.removesuffix(".dist-info").partition("-")
        if name in ("optimum", "optimum_onnx", "onnxruntime"):
            found[name] = version
    return found
