"""RabbitMQ and Redis for bench.gpu_stack on a host without either: unpacked from
`make gpu-bundle`'s Debian packages into a private prefix and started on free ports
(`private_services`; tests/e2e/test_gpu_stack_check.py uses it too)."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.tuning.stack import free_port, wait_for

DEFAULT_PREFIX = Path("/tmp/shoal-services")


def unpack(debs: Path, root: Path) -> Path:
    """`dpkg -x` every .deb of `debs` into `root` (again only when the set changed), with
    Erlang's `erl` scripts pointed at the relocated tree. Returns `root`."""
    packages = sorted(debs.glob("*.deb"))
    if not packages:
        raise FileNotFoundError(f"no Debian packages in {debs}: run `make gpu-bundle` "
                                "(infra/gpu-host/bundle.sh) where apt-get works")
    stamp = root / ".unpacked"
    listing = "\n".join(p.name for p in packages)
    if stamp.exists() and stamp.read_text() == listing:
        return root
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for deb in packages:
        subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)
    erlang = root / "usr/lib/erlang"
    # ROOTDIR is written into the scripts at build time; erlexec finds everything from it.
    for script in [erlang / "bin/erl", *erlang.glob("erts-*/bin/erl")]:
        text = script.read_text()
        script.write_text(text.replace("ROOTDIR=/usr/lib/erlang", f"ROOTDIR={erlang}"))
    stamp.write_text(listing)
    return root


@dataclass
class Services:
    """A private RabbitMQ and Redis, on free ports of 127.0.0.1."""

    prefix: Path
    broker_url: str
    redis_url: str
    broker_pids: list[int]  # beam.smp
    redis_pid: int
    rabbitmqctl: Path  # a wrapper that reaches this node
    logs: list[Path] = field(default_factory=list)


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        path = Path(f"/proc/{todo.pop()}/task")
        for task in path.glob("*/children") if path.exists() else []:
            with contextlib.suppress(OSError):
                kids = [int(k) for k in task.read_text().split()]
                found += kids
                todo += kids
    return found


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _redis_ping(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        sock.sendall(b"PING\r\n")
        return sock.recv(64).startswith(b"+PONG")


def _amqp_open(url: str) -> bool:
    from kombu import Connection

    with Connection(url, connect_timeout=5) as conn:
        conn.connect()
        return True


def _stop(proc: subprocess.Popen[bytes], timeout: float) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@contextlib.contextmanager
def private_services(debs: Path, prefix: Path = DEFAULT_PREFIX,
                     timeout: float = 120) -> Iterator[Services]:
    """RabbitMQ and Redis unpacked from `debs` into `prefix`/root and started on free ports,
    their data and logs in a fresh `prefix`/run-<pid>; everything stopped on exit. While
    it runs, PATH starts with a folder holding a `rabbitmqctl` for this node (what
    app.tuning.bench_stack calls where the broker has no management plugin)."""
    root = unpack(debs, prefix / "root")
    run = prefix / f"run-{os.getpid()}"
    shutil.rmtree(run, ignore_errors=True)
    for sub in ("home", "mnesia", "log", "redis", "bin"):
        (run / sub).mkdir(parents=True)
    amqp_port, dist_port, epmd_port, redis_port = (free_port() for _ in range(4))
    libs = f"{root}/usr/lib/x86_64-linux-gnu:{root}/lib/x86_64-linux-gnu"
    path = f"{root}/usr/lib/erlang/bin:{root}/usr/bin:{os.environ.get('PATH', '')}"
    (run / "enabled_plugins").write_text("[].\n")
    (run / "rabbitmq-env.conf").write_text("")
    (run / "rabbitmq.conf").write_text("loopback_users.guest = true\n"
                                       "disk_free_limit.absolute = 50MB\n")
    node = f"shoal-gpu-{os.getpid()}@localhost"
    rabbit_env = {
        **os.environ, "PATH": path, "HOME": str(run / "home"),
        "LD_LIBRARY_PATH": f"{libs}:{os.environ.get('LD_LIBRARY_PATH', '')}",
        "ERL_EPMD_PORT": str(epmd_port), "RABBITMQ_NODENAME": node,
        "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1", "RABBITMQ_NODE_PORT": str(amqp_port),
        "RABBITMQ_DIST_PORT": str(dist_port),
        "RABBITMQ_CONF_ENV_FILE": str(run / "rabbitmq-env.conf"),
        "RABBITMQ_CONFIG_FILE": str(run / "rabbitmq.conf"),
        "RABBITMQ_ADVANCED_CONFIG_FILE": str(run / "advanced.config"),
        "RABBITMQ_ENABLED_PLUGINS_FILE": str(run / "enabled_plugins"),
        "RABBITMQ_MNESIA_BASE": str(run / "mnesia"), "RABBITMQ_LOG_BASE": str(run / "log"),
        "RABBITMQ_PID_FILE": str(run / "rabbitmq.pid"), "RABBITMQ_LOGS": "-",
    }
    sbin = root / "usr/lib/rabbitmq/bin"
    ctl = run / "bin/rabbitmqctl"
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in rabbit_env.items()
                       if k != "PATH" and (k.startswith(("RABBITMQ_", "ERL_")) or k in
                                           ("HOME", "LD_LIBRARY_PATH")))
    ctl.write_text(f"#!/bin/sh\nexport {exports}\nexport PATH={shlex.quote(path)}\n"
                   f"exec {shlex.quote(str(sbin / 'rabbitmqctl'))} \"$@\"\n")
    ctl.chmod(0o755)
    started: list[tuple[subprocess.Popen[bytes], Any]] = []

    def launch(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        out = log.open("wb")
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        started.append((proc, out))
        return proc

    def tail(log: Path) -> str:
        return log.read_text(errors="replace")[-3000:] if log.exists() else ""

    old_path = os.environ.get("PATH", "")
    rabbit_log, redis_log = run / "rabbitmq.log", run / "redis.log"
    try:
        rabbit = launch([str(sbin / "rabbitmq-server")], rabbit_env, rabbit_log)
        redis = launch([str(root / "usr/bin/redis-server"), "--port", str(redis_port),
                        "--bind", "127.0.0.1", "--dir", str(run / "redis"), "--save", "",
                        "--appendonly", "no", "--daemonize", "no", "--logfile", ""],
                       {**os.environ, "LD_LIBRARY_PATH": rabbit_env["LD_LIBRARY_PATH"]},
                       redis_log)
        broker_url = f"amqp://guest:guest@127.0.0.1:{amqp_port}//"

        def dead() -> str | None:
            for proc, log in ((rabbit, rabbit_log), (redis, redis_log)):
                if proc.poll() is not None:
                    return f"{proc.args[0]} exited ({proc.returncode}):\n{tail(log)}"
            return None

        wait_for(lambda: _redis_ping(redis_port), timeout, "Redis", interval=0.1,
                 give_up=dead)
        wait_for(lambda: _amqp_open(broker_url), timeout, "RabbitMQ", interval=0.25,
                 give_up=dead)
        beams = [p for p in _descendants(rabbit.pid) if _comm(p) == "beam.smp"]
        if not beams:
            raise RuntimeError(f"RabbitMQ answers but no beam.smp under {rabbit.pid}")
        os.environ["PATH"] = f"{run / 'bin'}:{old_path}"
        yield Services(prefix, broker_url, f"redis://127.0.0.1:{redis_port}/0", beams,
                       redis.pid, ctl, [rabbit_log, redis_log])
    finally:
        os.environ["PATH"] = old_path
        for proc, out in reversed(started):
            _stop(proc, timeout=30)
            out.close()
        # The node started an epmd of its own on ERL_EPMD_PORT (a daemon, outside the
        # process group): only that one is asked to stop.
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run([str(root / "usr/lib/erlang/bin/epmd"), "-kill"], env=rabbit_env,
                           capture_output=True, timeout=10)
        if os.environ.get("SHOAL_GPU_KEEP_SERVICES_DATA") != "1":
            shutil.rmtree(run, ignore_errors=True)
