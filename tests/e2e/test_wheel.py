"""shoal installed from its wheel, away from the source tree: the catalog travels with it.

The wheel is built from a copy of the tree (the build writes build/ and *.egg-info
next to its sources) and installed, without dependencies, into a fresh venv that
reads the dependencies from this session's venv through a .pth file. Every command
runs in an empty directory, so nothing can be imported from the checkout.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tomllib
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tasks.settings import DEFAULT_MODEL, Settings
from tasks.topology import queue_for
from tests.stack import REPO, delete_queues, queue_counts, wait_for

pytestmark = pytest.mark.slow

SHIPPED = sorted(p.name for p in (REPO / "models").glob("*.yaml"))


@dataclass
class Installed:
    wheel: Path
    venv: Path
    workdir: Path  # empty: the current directory of every command

    @property
    def bin(self) -> Path:
        return self.venv / "bin"

    def env(self, **overrides: str) -> dict[str, str]:
        # The session points SHOAL_CATALOG_DIR at its test catalog; an installed shoal
        # must find its own.
        env = {k: v for k, v in os.environ.items()
               if k not in ("SHOAL_CATALOG_DIR", "PYTHONPATH")}
        return {**env, **overrides}

    def run(self, *argv: str, **env: str) -> str:
        done = subprocess.run([str(a) for a in argv], cwd=self.workdir, env=self.env(**env),
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout


def _copy_sources(destination: Path) -> None:
    """What the build reads: pyproject, README and the folders of the listed packages."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {config["package-dir"].get(p, p.replace(".", "/")).split("/")[0]
               for p in config["packages"]}
    destination.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, destination / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "out")
    for folder in sorted(folders):
        shutil.copytree(REPO / folder, destination / folder, ignore=skip)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("wheel")
    _copy_sources(root / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(root / "src"), "--no-deps",
                    "--no-build-isolation", "--no-index", "-q", "-w", str(root / "dist")],
                   check=True, timeout=300)
    (wheel,) = (root / "dist").glob("shoal-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    # Installed before the .pth exists, so pip sees no shoal (the editable one) to replace.
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                    "install", "--no-deps", "--no-index", "-q", str(wheel)],
                   check=True, timeout=300)
    site = subprocess.run([str(venv / "bin" / "python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = sysconfig.get_paths()
    # A plain path line: this venv's own .pth files (the editable install's finder among
    # them) are not run, and the new venv's site-packages stays first on sys.path.
    Path(site, "shoal_test_dependencies.pth").write_text(
        "\n".join(dict.fromkeys([ours["purelib"], ours["platlib"]])) + "\n")
    workdir = root / "cwd"
    workdir.mkdir()
    return Installed(wheel, venv, workdir)


def _source_packages() -> set[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = {p.split(".")[0] for p in config["packages"]}
    return {str(init.parent.relative_to(REPO)) for root in roots
            for init in (REPO / root).rglob("__init__.py") if "__pycache__" not in init.parts}


def test_the_wheel_holds_every_package_and_the_catalog(installed: Installed):
    names = zipfile.ZipFile(installed.wheel).namelist()
    missing = [p for p in _source_packages() if f"{p}/__init__.py" not in names]
    assert missing == [], "add them to [tool.setuptools] packages in pyproject.toml"
    assert sorted(n.split("/")[-1] for n in names if n.startswith("tasks/models/")) == SHIPPED


def test_models_list_runs_from_the_installed_wheel(installed: Installed):
    out = installed.run(installed.bin / "shoal", "models", "list")
    rows = out.splitlines()[1:]
    assert any(row.split()[0] == DEFAULT_MODEL for row in rows)
    assert len(rows) == len(SHIPPED)
    where = installed.run(installed.bin / "python", "-c",
                          "import app, app.cli, tasks, gateway, batching, runtimes\n"
                          "from tasks.settings import PACKAGED_CATALOG_DIR\n"
                          "for m in (app, app.cli, tasks, gateway, batching, runtimes):\n"
                          "    print(m.__file__)\n"
                          "print(PACKAGED_CATALOG_DIR)").splitlines()
    assert len(where) == 7
    for path in where:
        assert Path(path).resolve().is_relative_to(installed.venv.resolve()), path
    assert Path(where[-1]).name == "models"


def test_a_user_folder_adds_to_the_installed_catalog(installed: Installed, tmp_path: Path):
    (tmp_path / "mine.yaml").write_text("id: me/mine\nadapter: dense\ndims: 8\n"
                                        "source: {hub: me/mine}\n")
    out = installed.run(installed.bin / "shoal", "models", "list",
                        SHOAL_CATALOG_DIR=str(tmp_path))
    ids = [row.split()[0] for row in out.splitlines()[1:]]
    assert "me/mine" in ids and DEFAULT_MODEL in ids and len(ids) == len(SHIPPED) + 1


@pytest.mark.e2e
def test_shoal_worker_serves_from_the_installed_wheel(installed: Installed, tmp_path: Path):
    # Its own queue prefix and the sim runtime: it serves no queue of the session's
    # stack and loads no weights; what is checked is that it starts and consumes.
    prefix = f"shoal-wheel-{uuid.uuid4().hex[:8]}"
    env = {"SHOAL_QUEUE_PREFIX": prefix, "SHOAL_RUNTIME": "sim",
           "SHOAL_WORKER_METRICS_PORT": "0"}
    queue = queue_for(DEFAULT_MODEL, Settings(queue_prefix=prefix))
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log:
        worker = subprocess.Popen(
            [str(installed.bin / "shoal"), "worker", "--models", DEFAULT_MODEL,
             "--hostname", f"{prefix}@%h"],
            cwd=installed.workdir, env=installed.env(**env), stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: worker.poll() is None and queue_counts(queue.name)[1] >= 1, 120,
                 f"the installed worker to consume {queue.name}")
        out = installed.run(
            installed.bin / "python", "-c",
            "from tasks.client import embedding_rows, encode\n"
            f"result = encode.delay(model={DEFAULT_MODEL!r}, items=[{{'text': 'hi'}}])"
            ".get(timeout=60)\n"
            "print(len(embedding_rows(result)), len(embedding_rows(result)[0]))", **env)
        assert out.split() == ["1", "384"]
    except BaseException:
        print(log_path.read_text(errors="replace")[-5000:])
        raise
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait(10)
        delete_queues([queue.name, queue.dead_letter_queue, f"{prefix}.default"])
