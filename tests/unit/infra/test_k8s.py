"""The Kubernetes deploy (infra/k8s): every overlay renders, validates, and agrees with the code.

`kubectl kustomize` renders each overlay; core objects are validated against Kubernetes'
own schemas (kubernetes-validate, strict: no unknown field), the KEDA, RabbitMQ-operator
(cluster and messaging-topology) and Prometheus-operator objects against their CRDs'
published schemas (vendored in tests/schemas/crds, read as strictly). Then what the
manifests say is checked against what shoal does: the queues KEDA watches are the ones
tasks.topology derives for each pool's models, every SHOAL_* variable is a setting with a
valid value, probes and scrapes hit paths the processes serve, grace periods cover the
drain, alert rules are infra/prometheus/alerts.yaml's, each process's RabbitMQ user may do
what its code does and no more, Redis takes its password from a Secret, NetworkPolicies
select real pods and ports, the gateway's HPA scales on a metric the adapter serves.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from app.worker.limits import pinned_models
from tasks.catalog import load_catalog
from tasks.settings import PACKAGED_CATALOG_DIR, REPO_ROOT, Settings
from tasks.topology import dead_letter_exchange, queue_for, task_exchange

K8S = REPO_ROOT / "infra" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
CRD_SCHEMAS = REPO_ROOT / "tests" / "schemas" / "crds"
KUBERNETES_VERSION = "1.33.0"  # the oldest release the deploy supports
CORE_GROUPS = {"v1", "apps/v1", "autoscaling/v2", "policy/v1", "networking.k8s.io/v1"}
NAMESPACE = "shoal"
SHOAL_IMAGES = {"shoal-gateway", "shoal-worker-cpu", "shoal-worker-cuda", "shoal-worker-onnx"}

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None,
                                reason="kubectl (for `kubectl kustomize`) is not installed")


@cache
def rendered(overlay: str) -> tuple[dict[str, Any], ...]:
    out = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


def of_kind(objects: tuple[dict[str, Any], ...], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def named(objects: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in of_kind(objects, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["shoal"], deployment["metadata"]["name"]
    return containers[0]


def image_of(deployment: dict[str, Any]) -> str:
    return container(deployment)["image"].split(":")[0].rsplit("/", 1)[-1]


def env_values(deployment: dict[str, Any]) -> dict[str, str]:
    """The container's literal env values ($(VAR) references left as they are)."""
    return {e["name"]: e["value"] for e in container(deployment).get("env", []) if "value" in e}


def workers(objects: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    return [d for d in of_kind(objects, "Deployment")
            if d["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"]


def pool_settings(deployment: dict[str, Any]) -> Settings:
    env = env_values(deployment)
    fields = {k.removeprefix("SHOAL_").lower(): v for k, v in env.items()
              if k.startswith("SHOAL_") and "$(" not in v}
    return Settings(**fields)


# --- schemas -------------------------------------------------------------------------------


def _strict(schema: Any) -> Any:
    """A CRD schema read as `kubectl apply --validate=strict` reads it: an object that lists
    its properties takes no others unless it says it preserves unknown fields."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@cache
def crd_validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    group, version = api_version.split("/")
    path = CRD_SCHEMAS / f"{group}_{kind.lower()}_{version}.json"
    assert path.is_file(), f"no vendored schema for {api_version} {kind} ({path.name})"
    schema = _strict(json.loads(path.read_text()))
    # metadata is the API server's (ObjectMeta), not the CRD's to describe.
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft7Validator(schema)


def validation_errors(obj: dict[str, Any]) -> list[str]:
    if obj["apiVersion"] in CORE_GROUPS:
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            return [str(exc)]
        return []
    validator = crd_validator(obj["apiVersion"], obj["kind"])
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(obj)]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_validates_against_its_schema(overlay: str) -> None:
    objects = rendered(overlay)
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "ScaledObject",
            "TriggerAuthentication", "RabbitmqCluster", "PodMonitor", "ServiceMonitor",
            "PrometheusRule", "User", "Permission", "NetworkPolicy", "ConfigMap"} <= kinds
    errors = {f"{o['kind']}/{o['metadata']['name']}": validation_errors(o) for o in objects}
    assert {k: v for k, v in errors.items() if v} == {}


@pytest.mark.parametrize(("kind", "path"), [
    ("Deployment", ["spec", "template", "spec", "containers", 0, "imagePullPolicyy"]),
    ("ScaledObject", ["spec", "minReplicas"]),
    ("RabbitmqCluster", ["spec", "replica"]),
    ("PodMonitor", ["spec", "podMetricsEndpoints", 0, "paths"]),
    ("User", ["spec", "tag"]),
    ("Permission", ["spec", "permissions", "reed"]),
    ("NetworkPolicy", ["spec", "podSelectors"]),
])
def test_a_misspelt_field_fails_validation(kind: str, path: list[Any]) -> None:
    obj = copy.deepcopy(of_kind(rendered(OVERLAYS[0]), kind)[0])
    node = obj
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = 1
    assert validation_errors(obj)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_everything_lives_in_the_shoal_namespace(overlay: str) -> None:
    objects = rendered(overlay)
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} \
        == {NAMESPACE}
    assert [o["metadata"]["name"] for o in of_kind(objects, "Namespace")] == [NAMESPACE]


# --- KEDA: the queues each pool's workers consume --------------------------------------------


def matched_queues(pattern: str, settings: Settings) -> set[str]:
    """The queues among every catalog model's (and a few that are not models') that the
    trigger's regex selects; RabbitMQ's management API searches names with it."""
    catalog = load_catalog(PACKAGED_CATALOG_DIR)
    candidates = {f"{settings.queue_prefix}.default", "celery", "shoal-other.model.x"}
    for entry in catalog.select(["*"]):
        queue = queue_for(entry.id, settings)
        candidates |= {queue.name, queue.dead_letter_queue, f"other.{queue.name[6:]}"}
    return {q for q in candidates if re.search(pattern, q)}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_keda_watches_exactly_the_queues_of_each_pools_models(overlay: str) -> None:
    objects = rendered(overlay)
    scaled = {s["spec"]["scaleTargetRef"]["name"]: s for s in of_kind(objects, "ScaledObject")}
    assert sorted(scaled) == sorted(d["metadata"]["name"] for d in workers(objects))
    cluster = of_kind(objects, "RabbitmqCluster")[0]["metadata"]
    auth = {a["metadata"]["name"]: a for a in of_kind(objects, "TriggerAuthentication")}
    served: dict[str, str] = {}
    for worker in workers(objects):
        name = worker["metadata"]["name"]
        settings = pool_settings(worker)
        entries = load_catalog(settings.catalog_dir).select(settings.models)
        assert entries, f"{name}: SHOAL_MODELS selects no catalog model"
        for entry in entries:
            assert entry.id not in served, f"{entry.id} in {served[entry.id]} and {name}: " \
                "KEDA would count its queue for both pools"
            served[entry.id] = name
        expected = set()
        for entry in entries:
            queue = queue_for(entry.id, settings)
            expected |= {queue.name, queue.dead_letter_queue}
        spec = scaled[name]["spec"]
        [trigger] = spec["triggers"]
        meta = trigger["metadata"]
        assert trigger["type"] == "rabbitmq"
        assert meta["protocol"] == "http" and meta["mode"] == "QueueLength"
        assert meta["useRegex"] == "true" and meta["operation"] == "sum"
        assert meta["host"] == f"http://{cluster['name']}.{cluster['namespace']}.svc:15672/"
        assert matched_queues(meta["queueName"], settings) == expected, name
        ref = auth[trigger["authenticationRef"]["name"]]
        # KEDA's own management-only user (checked in test_keda_reads_queues_as_a_user_
        # that_can_do_nothing_else), not the operator's administrator.
        assert {r["name"] for r in ref["spec"]["secretTargetRef"]} \
            == {credentials_secret("shoal-keda")}
        assert {r["parameter"] for r in ref["spec"]["secretTargetRef"]} \
            == {"username", "password"}
        # A pool with a pinned model keeps a warm worker; one without scales to zero.
        pinned = pinned_models(settings, [e.id for e in entries])
        assert (spec["minReplicaCount"] >= 1) == bool(pinned), name
        if not pinned:
            assert spec["minReplicaCount"] == 0
            gateway = named(objects, "Deployment", "shoal-gateway")
            # Else the gateway would refuse requests for a pool at zero, and KEDA would
            # never see a message to wake it.
            assert env_values(gateway)["SHOAL_GATEWAY_UNSERVED"] == "wait"


# --- settings, probes, grace ---------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_shoal_variable_is_a_setting_with_a_valid_value(overlay: str) -> None:
    for deployment in of_kind(rendered(overlay), "Deployment"):
        env = container(deployment).get("env", [])
        names = [e["name"] for e in env]
        assert len(names) == len(set(names)), deployment["metadata"]["name"]
        for variable in names:
            if variable.startswith("SHOAL_"):
                field = variable.removeprefix("SHOAL_").lower()
                assert field in Settings.model_fields, f"{variable} is not a shoal setting"
        # $(VAR) expands only from variables defined above it.
        for i, item in enumerate(env):
            for ref in re.findall(r"\$\((\w+)\)", item.get("value", "")):
                assert ref in names[:i], f"{item['name']} uses $({ref}) before it is set"
        pool_settings(deployment)  # raises on a value the setting refuses


def grace_s(deployment: dict[str, Any]) -> float:
    return float(env_values(deployment)["SHOAL_SHUTDOWN_GRACE_S"])


def probe_target(deployment: dict[str, Any], probe: str) -> tuple[str, int]:
    c = container(deployment)
    get = c[probe]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    return get["path"], ports.get(get["port"], get["port"])


def worker_serves(path: str) -> bool:
    from wsgiref.util import setup_testing_defaults

    from app.worker.health import WorkerHealth

    environ: dict[str, Any] = {"PATH_INFO": path}
    setup_testing_defaults(environ)
    status: list[str] = []
    b"".join(WorkerHealth(120.0).app(environ, lambda s, headers: status.append(s)))
    return not status[0].startswith("404")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_probe_their_own_health_and_have_time_to_drain(overlay: str) -> None:
    assert worker_serves("/healthz") and worker_serves("/readyz") and worker_serves("/metrics")
    assert not worker_serves("/nothing")
    for worker in workers(rendered(overlay)):
        env = env_values(worker)
        port = int(env["SHOAL_WORKER_METRICS_PORT"])
        assert env["SHOAL_WORKER_METRICS_HOST"] == "0.0.0.0"  # probed and scraped by pod IP
        assert probe_target(worker, "livenessProbe") == ("/healthz", port)
        assert probe_target(worker, "readinessProbe") == ("/readyz", port)
        assert probe_target(worker, "startupProbe") == ("/healthz", port)
        spec = worker["spec"]["template"]["spec"]
        assert spec["terminationGracePeriodSeconds"] == grace_s(worker) + 5
        assert "replicas" not in worker["spec"]  # the ScaledObject owns them
        strategy = worker["spec"]["strategy"]["rollingUpdate"]
        assert strategy["maxUnavailable"] == 0  # a roll keeps the pool's capacity


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_probes_open_routes_and_drains_within_its_grace(overlay: str) -> None:
    from gateway.app import create_app
    from gateway.auth.key_middleware import OPEN_PATHS

    objects = rendered(overlay)
    gateway = named(objects, "Deployment", "shoal-gateway")
    env = env_values(gateway)
    routes = {r.path for r in create_app(Settings()).routes}
    for probe, path in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")]:
        assert probe_target(gateway, probe) == (path, int(env["SHOAL_PORT"]))
        assert path in routes and path in OPEN_PATHS  # no API key needed
    assert env["SHOAL_HOST"] == "0.0.0.0"
    assert 0 < float(env["SHOAL_GATEWAY_DRAIN_DELAY_S"]) < grace_s(gateway)
    assert gateway["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] \
        == grace_s(gateway) + 5
    hpa = named(objects, "HorizontalPodAutoscaler", "shoal-gateway")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "shoal-gateway"
    assert hpa["spec"]["minReplicas"] >= 2
    assert "cpu" in container(gateway)["resources"]["requests"]  # what the HPA divides by
    assert "/metrics" in routes and "/metrics" in OPEN_PATHS


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_are_referenced_not_written(overlay: str) -> None:
    objects = rendered(overlay)
    assert not of_kind(objects, "Secret")
    referenced = set()
    for workload in of_kind(objects, "Deployment") + of_kind(objects, "StatefulSet"):
        for c in workload["spec"]["template"]["spec"]["containers"]:
            for item in c.get("env", []):
                ref = item.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    referenced.add(ref["name"])
        for volume in workload["spec"]["template"]["spec"].get("volumes", []):
            if "secret" in volume:
                referenced.add(volume["secret"]["secretName"])
    # The messaging-topology operator creates the users' Secrets; docs/operations.md tells
    # how to create the others.
    generated = {credentials_secret(u) for u in ("shoal-gateway", "shoal-worker", "shoal-flower")}
    assert referenced == generated | {"shoal-flower", "shoal-api-keys", "shoal-redis"}
    operations = (REPO_ROOT / "docs" / "operations.md").read_text()
    for secret in referenced - generated:
        assert f"create secret generic {secret}" in operations
    flower = env_values(named(objects, "Deployment", "shoal-flower"))
    assert "SHOAL_FLOWER_PASSWORD" not in flower  # from the Secret, not a literal


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_api_keys_are_on_and_read_from_the_mounted_secret(overlay: str) -> None:
    gateway = named(rendered(overlay), "Deployment", "shoal-gateway")
    keys_file = Path(env_values(gateway)["SHOAL_API_KEYS_FILE"])
    volumes = {v["name"]: v for v in gateway["spec"]["template"]["spec"]["volumes"]}
    mounts = {Path(m["mountPath"]): volumes[m["name"]]
              for m in container(gateway)["volumeMounts"]}
    assert mounts[keys_file.parent]["secret"]["secretName"] == "shoal-api-keys"


# --- images, devices ----------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_are_the_ones_infra_docker_builds_and_match_the_device(overlay: str) -> None:
    for deployment in of_kind(rendered(overlay), "Deployment"):
        image = image_of(deployment)
        assert image in SHOAL_IMAGES, image
        assert (REPO_ROOT / "infra" / "docker"
                / f"{image.removeprefix('shoal-')}.Dockerfile").is_file()
        if deployment in workers(rendered(overlay)):
            gpus = container(deployment)["resources"].get("limits", {}).get("nvidia.com/gpu")
            device = env_values(deployment)["SHOAL_DEVICE"]
            if gpus:
                assert (image, device) == ("shoal-worker-cuda", "cuda")
            else:
                assert image in ("shoal-worker-cpu", "shoal-worker-onnx") and device == "cpu"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pools_on_the_torch_free_image_serve_only_the_graphs_it_holds(overlay: str) -> None:
    from app.worker.runtime import runtime_of_models
    from runtimes.child_side.host import make_engine
    from tasks.engines import engine as registered
    from tests.unit.infra.test_containers import docker_env, onnx_image_graphs

    image_env = docker_env("worker-onnx")
    for worker in workers(rendered(overlay)):
        if image_of(worker) != "shoal-worker-onnx":
            continue
        name = worker["metadata"]["name"]
        env = {**image_env, **env_values(worker)}
        assert env["SHOAL_RUNTIME"] == "onnx", name
        fields = {k.removeprefix("SHOAL_").lower(): v for k, v in env.items()
                  if k.startswith("SHOAL_") and "$(" not in v and k != "SHOAL_ONNX_CACHE"}
        settings = Settings(**fields)
        entries = load_catalog(settings.catalog_dir).select(settings.models)
        # Every model on ONNX Runtime: one on PyTorch would start a runtime this image
        # has no torch for.
        assert set(runtime_of_models(entries, settings.runtime).values()) == {"onnx"}, name
        # ...each with its graph in the image, in the format it will run in (the worker's
        # SHOAL_PRECISION, else the entry's profile, else fp32): without torch a missing
        # graph cannot be exported.
        onnx_formats = registered("onnx").precisions
        override = settings.precision if settings.precision in onnx_formats else None
        engine = make_engine("onnx", settings.device)
        wanted = {(e.id, engine.precision(e, override)) for e in entries}
        missing = wanted - onnx_image_graphs()
        assert not missing, f"{name}: the image has no graph for {missing}"


def test_the_cpu_overlay_serves_minilm_on_onnx_and_the_gpu_one_on_pytorch() -> None:
    def minilm_pools(overlay: str) -> list[str]:
        return [image_of(w) for w in workers(rendered(overlay))
                if "sentence-transformers/all-MiniLM-L6-v2" in env_values(w)["SHOAL_MODELS"]]

    assert minilm_pools("cpu") == ["shoal-worker-onnx"]
    assert minilm_pools("gpu") == ["shoal-worker-cuda"]


def test_the_gpu_overlay_runs_workers_on_gpus_and_the_cpu_one_on_cpus() -> None:
    def gpu_workers(overlay: str) -> int:
        return sum(1 for w in workers(rendered(overlay))
                   if "nvidia.com/gpu" in container(w)["resources"].get("limits", {}))

    assert gpu_workers("gpu") == len(workers(rendered("gpu"))) >= 2
    assert gpu_workers("cpu") == 0 and len(workers(rendered("cpu"))) >= 2


# --- services and monitoring --------------------------------------------------------------


def pods_matching(objects: tuple[dict[str, Any], ...], labels: dict[str, str]) -> list[dict]:
    templates = [o["spec"]["template"] for o in objects
                 if o["kind"] in ("Deployment", "StatefulSet")]
    return [t for t in templates
            if labels.items() <= t["metadata"].get("labels", {}).items()]


def port_names(template: dict[str, Any]) -> set[str]:
    return {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_and_pod_monitors_reach_named_ports_of_real_pods(overlay: str) -> None:
    objects = rendered(overlay)
    for service in of_kind(objects, "Service"):
        pods = pods_matching(objects, service["spec"]["selector"])
        assert pods, service["metadata"]["name"]
        for port in service["spec"]["ports"]:
            assert all(port["targetPort"] in port_names(p) for p in pods)
    for monitor in of_kind(objects, "PodMonitor"):
        pods = pods_matching(objects, monitor["spec"]["selector"]["matchLabels"])
        assert pods, monitor["metadata"]["name"]
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert endpoint["path"] == "/metrics"
            assert all(endpoint["port"] in port_names(p) for p in pods)
    assert {m["metadata"]["name"] for m in of_kind(objects, "PodMonitor")} \
        == {"shoal-gateway", "shoal-workers"}
    # RabbitMQ's Service is the operator's: it carries the cluster's name as
    # app.kubernetes.io/name and serves rabbitmq_prometheus on the port "prometheus".
    cluster = of_kind(objects, "RabbitmqCluster")[0]
    [rabbit] = of_kind(objects, "ServiceMonitor")
    assert rabbit["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] \
        == cluster["metadata"]["name"]
    assert cluster["spec"]["replicas"] == 3
    detailed = [e for e in rabbit["spec"]["endpoints"] if e["path"] == "/metrics/detailed"]
    # What infra/prometheus/prometheus.yml scrapes for the compose stack, and the alerts use.
    compose = yaml.safe_load((REPO_ROOT / "infra/prometheus/prometheus.yml").read_text())
    [queues_job] = [j for j in compose["scrape_configs"] if j["job_name"] == "rabbitmq-queues"]
    assert [e["params"] for e in detailed] == [queues_job["params"]]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_prometheus_rule_holds_the_alert_rules_file(overlay: str) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("sync_alerts", K8S / "sync_alerts.py")
    assert spec is not None and spec.loader is not None
    sync = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sync)
    [rule] = of_kind(rendered(overlay), "PrometheusRule")
    assert rule["spec"] == sync.prometheus_rule()["spec"], \
        "infra/k8s/base/alerts.yaml is stale: run python infra/k8s/sync_alerts.py"


# --- least privilege: RabbitMQ users, Redis's password, NetworkPolicies -------------------

# Which RabbitMQ user (a messaging-topology operator User) each kind of shoal process uses.
USER_OF_COMPONENT = {"gateway": "shoal-gateway", "worker": "shoal-worker",
                     "flower": "shoal-flower"}


def credentials_secret(user: str) -> str:
    """The Secret the messaging-topology operator generates for the User `user`."""
    return f"{user}-user-credentials"


def secret_refs(deployment: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """The container's env variables taken from a Secret: name -> (secret, key)."""
    return {e["name"]: (ref["name"], ref["key"]) for e in container(deployment).get("env", [])
            if (ref := e.get("valueFrom", {}).get("secretKeyRef"))}


def component(deployment: dict[str, Any]) -> str:
    return deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_shoal_process_uses_the_operators_default_user(overlay: str) -> None:
    objects = rendered(overlay)
    cluster = of_kind(objects, "RabbitmqCluster")[0]["metadata"]["name"]
    default_user = f"{cluster}-default-user"
    users = {u["metadata"]["name"]: u for u in of_kind(objects, "User")}
    for user in users.values():
        assert user["spec"]["rabbitmqClusterReference"] == {"name": cluster}
        # Generated credentials: no password written anywhere in the repository.
        assert "importCredentialsSecret" not in user["spec"]
        assert "administrator" not in user["spec"].get("tags", [])
    deployments = of_kind(objects, "Deployment")
    assert {component(d) for d in deployments} == set(USER_OF_COMPONENT)
    for deployment in deployments:
        name = deployment["metadata"]["name"]
        user = USER_OF_COMPONENT[component(deployment)]
        assert user in users, f"{name}: no User {user}"
        refs = secret_refs(deployment)
        secret = credentials_secret(user)
        assert refs["RABBITMQ_USER"] == (secret, "username"), name
        assert refs["RABBITMQ_PASSWORD"] == (secret, "password"), name
        assert default_user not in {s for s, _ in refs.values()}, name
        env = env_values(deployment)
        assert env["SHOAL_BROKER_URL"].startswith("amqp://$(RABBITMQ_USER):$(RABBITMQ_PASSWORD)@")
        # Only Flower reads the management API (its broker tab).
        assert ("SHOAL_MANAGEMENT_URL" in env) == (component(deployment) == "flower"), name
        if "SHOAL_MANAGEMENT_URL" in env:
            assert "$(RABBITMQ_PASSWORD)@" in env["SHOAL_MANAGEMENT_URL"]
            assert "management" in users[user]["spec"]["tags"]
    # Nothing else (KEDA's TriggerAuthentication included) names the administrator's Secret.
    others = [o for o in objects if o["kind"] != "RabbitmqCluster"]
    assert default_user not in json.dumps(others)


def permission_of(objects: tuple[dict[str, Any], ...], user: str) -> dict[str, str]:
    found = [p for p in of_kind(objects, "Permission")
             if p["spec"].get("userReference", {}).get("name") == user]
    assert len(found) == 1, f"{user}: {len(found)} Permissions"
    cluster = of_kind(objects, "RabbitmqCluster")[0]["metadata"]["name"]
    assert found[0]["spec"]["rabbitmqClusterReference"] == {"name": cluster}
    assert found[0]["spec"]["vhost"] == "/"  # the vhost of the broker URLs ("//")
    return found[0]["spec"]["permissions"]


def allowed(permissions: dict[str, str], operation: str, resource: str) -> bool:
    """RabbitMQ's check: the regex is searched (not anchored) in the name; "" is "^$"."""
    regex = permissions.get(operation) or "^$"
    return re.search(regex, resource) is not None


def needs(settings: Settings) -> dict[str, dict[str, set[str]]]:
    """Per process, per operation, the resources its code touches, named as the code (and
    Celery's, for its remote control and events) names them under `settings`."""
    from app.celery import app as celery_app
    from gateway.broker.link import Broker
    from gateway.broker.streams import CONTROL_EXCHANGE
    from gateway.jobs.part_replies import replies_queue
    from tasks.pool_state import pool_exchange
    from tasks.queues import kombu_queues

    prefix = settings.queue_prefix
    catalog = load_catalog(PACKAGED_CATALOG_DIR)
    queues = [queue_for(e.id, settings) for e in catalog.select(["*"])]
    model_queues = {n for q in queues for n in (q.name, q.dead_letter_queue)}
    exchanges = {task_exchange(prefix), dead_letter_exchange(prefix)}
    for queue, dead in (kombu_queues(q) for q in queues[:1]):
        assert {queue.exchange.name, dead.exchange.name} == exchanges
    gateway = Broker(settings, [])
    pool, jobs = pool_exchange(prefix), replies_queue(prefix)
    mailbox = celery_app.control.mailbox
    control, control_reply = mailbox.exchange.name, mailbox.reply_exchange.name
    cli = (REPO_ROOT / "app" / "cli" / "serve.py").read_text()
    hostname = re.search(r'"--hostname", default="([^"]+)"', cli)
    assert hostname, "the worker's default --hostname"
    from celery.utils.nodenames import host_format

    pidbox = mailbox.get_queue(host_format(hostname.group(1), h="shoal-worker-embed-7d9c")).name
    from tasks.settings import get_settings

    # Celery's default queue, named by app.celery from the prefix it was imported with.
    default_queue = prefix + celery_app.conf.task_default_queue.removeprefix(
        get_settings().queue_prefix)
    # app.worker.pool_states names a worker's pool-state queue as the gateway does its own
    # ({prefix}.pool.<uuid hex>): one name stands for both.
    worker_pool_queue = gateway.pool_queue
    events = celery_app.conf.event_exchange
    receiver = celery_app.events.Receiver(celery_app.connection_for_read(), handlers={})
    flower_reply = mailbox.get_reply_queue().name
    return {
        "gateway": {
            "configure": exchanges | model_queues | {pool, jobs, gateway.reply_to,
                                                     gateway.pool_queue},
            "write": {task_exchange(prefix), gateway.pool_queue, CONTROL_EXCHANGE}
            | model_queues,
            "read": exchanges | {pool, jobs, gateway.reply_to, gateway.pool_queue},
        },
        "worker": {
            "configure": exchanges | model_queues | {default_queue, pool, worker_pool_queue,
                                                     control, control_reply, events, pidbox},
            "write": model_queues | {default_queue, pool, worker_pool_queue, pidbox,
                                     "amq.default", control_reply, events},
            "read": exchanges | model_queues | {default_queue, pool, worker_pool_queue,
                                                control, pidbox},
        },
        "flower": {
            "configure": {events, receiver.queue.name, control, control_reply, flower_reply},
            "write": {receiver.queue.name, control, flower_reply},
            "read": {events, receiver.queue.name, control_reply, flower_reply},
        },
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_rabbitmq_user_may_do_what_its_process_does_and_no_more(overlay: str) -> None:
    objects = rendered(overlay)
    prefixes = {env_values(d)["SHOAL_QUEUE_PREFIX"] for d in of_kind(objects, "Deployment")}
    assert len(prefixes) == 1
    settings = Settings(queue_prefix=prefixes.pop())
    required = needs(settings)
    granted = {c: permission_of(objects, USER_OF_COMPONENT[c]) for c in required}
    for process, operations in required.items():
        for operation, resources in operations.items():
            refused = sorted(r for r in resources if not allowed(granted[process], operation, r))
            assert refused == [], f"{process} may not {operation} {refused}"
    everything = {r for ops in required.values() for rs in ops.values() for r in rs}
    strangers = {"x", "other.tasks", f"other.{settings.queue_prefix}.tasks",
                 f"{settings.queue_prefix}x.model.a", "amq.topic"}
    for process, permissions in granted.items():
        for operation in ("configure", "write", "read"):
            # Exactly what some process needs, nothing of another prefix or broker user.
            assert not any(allowed(permissions, operation, r) for r in strangers), \
                (process, operation)
            extra = {r for r in everything - required[process][operation]
                     if allowed(permissions, operation, r)}
            assert extra == set(), (process, operation)
    gw, worker, flower = (required[c] for c in ("gateway", "worker", "flower"))
    # The separations that matter: a gateway cannot take requests nor answer them; a
    # worker cannot read a gateway's replies; Flower touches nothing of shoal's.
    model = queue_for("sentence-transformers/all-MiniLM-L6-v2", settings).name
    assert not allowed(granted["gateway"], "read", model)
    assert not allowed(granted["gateway"], "write", "amq.default")
    reply = next(r for r in gw["read"] if ".reply." in r)
    assert not allowed(granted["worker"], "read", reply)
    assert not allowed(granted["worker"], "configure", reply)
    for operation in ("configure", "write", "read"):
        assert not any(allowed(granted["flower"], operation, r)
                       for r in (gw[operation] | worker[operation]) - flower[operation])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_keda_reads_queues_as_a_user_that_can_do_nothing_else(overlay: str) -> None:
    objects = rendered(overlay)
    [keda] = [u for u in of_kind(objects, "User") if u["metadata"]["name"] == "shoal-keda"]
    assert keda["spec"]["tags"] == ["management"]  # the management API, its vhosts only
    permissions = permission_of(objects, "shoal-keda")
    everything = {r for ops in needs(Settings()).values() for rs in ops.values() for r in rs}
    for operation in ("configure", "write", "read"):
        assert permissions[operation] == ""
        assert not any(allowed(permissions, operation, r) for r in everything)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_requires_a_password_that_the_gateway_takes_from_a_secret(overlay: str) -> None:
    import redis.connection

    from tasks.redact import mask_url

    objects = rendered(overlay)
    [statefulset] = of_kind(objects, "StatefulSet")
    [server] = statefulset["spec"]["template"]["spec"]["containers"]
    server_env = {e["name"]: e for e in server["env"]}
    args = server["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    secret = server_env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert (secret["name"], secret["key"]) == ("shoal-redis", "password")
    # The readiness probe's redis-cli authenticates from the environment.
    assert "redis-cli" in server["readinessProbe"]["exec"]["command"]
    assert server_env["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"] == secret
    for deployment in of_kind(objects, "Deployment"):
        env = env_values(deployment)
        # Only the gateway uses Redis (jobs, rate limits); nobody else gets its password.
        assert ("SHOAL_REDIS_URL" in env) == (component(deployment) == "gateway")
        if "SHOAL_REDIS_URL" not in env:
            assert "shoal-redis" not in {s for s, _ in secret_refs(deployment).values()}
            continue
        assert secret_refs(deployment)["REDIS_PASSWORD"] == ("shoal-redis", "password")
        url = env["SHOAL_REDIS_URL"]
        expanded = url.replace("$(REDIS_PASSWORD)", "0123abcd")
        assert expanded != url
        assert redis.connection.parse_url(expanded)["password"] == "0123abcd"
        assert "0123abcd" not in mask_url(expanded)  # logs and `shoal settings` hide it
        assert Settings(redis_url=expanded).redis_url == expanded


def network_peers(policy: dict[str, Any]) -> list[tuple[dict, list]]:
    """(peer, ports) of each ingress rule's `from` entries ({} for a rule open to all)."""
    return [(peer, rule.get("ports", [])) for rule in policy["spec"].get("ingress", [])
            for peer in rule.get("from", [{}])]


def policy_pods(objects: tuple[dict[str, Any], ...], labels: dict[str, str]) -> list[dict]:
    """Pod templates the labels select, with the RabbitMQ operator's pods: it labels them
    with its cluster's name and component rabbitmq (as the ServiceMonitor relies on)."""
    cluster = of_kind(objects, "RabbitmqCluster")[0]["metadata"]["name"]
    operator_pod = {"metadata": {"labels": {"app.kubernetes.io/name": cluster,
                                            "app.kubernetes.io/component": "rabbitmq"}},
                    "spec": {"containers": []}}
    found = pods_matching(objects, labels)
    if labels.items() <= operator_pod["metadata"]["labels"].items():
        found.append(operator_pod)
    return found


def allowed_in(objects: tuple[dict[str, Any], ...], target: str, port: Any) -> set[str]:
    """The components of shoal pods that some policy lets reach `target`'s pods on `port`."""
    sources = set()
    for policy in of_kind(objects, "NetworkPolicy"):
        selected = policy_pods(objects, policy["spec"]["podSelector"].get("matchLabels", {}))
        if not any(p["metadata"]["labels"].get("app.kubernetes.io/component") == target
                   for p in selected):
            continue
        for peer, ports in network_peers(policy):
            if ports and port not in [p["port"] for p in ports]:
                continue
            if not peer:
                sources.add("*")
            elif "podSelector" in peer and "namespaceSelector" not in peer:
                for pod in policy_pods(objects, peer["podSelector"]["matchLabels"]):
                    sources.add(pod["metadata"]["labels"]["app.kubernetes.io/component"])
            else:
                sources.add(peer["namespaceSelector"]["matchLabels"]
                            ["kubernetes.io/metadata.name"])
    return sources


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_select_real_pods_and_let_only_their_clients_in(overlay: str) -> None:
    objects = rendered(overlay)
    policies = of_kind(objects, "NetworkPolicy")
    # Closed by default: a pod no other policy names takes no connection.
    [deny] = [p for p in policies if p["spec"]["podSelector"] == {}]
    assert deny["spec"]["policyTypes"] == ["Ingress"] and "ingress" not in deny["spec"]
    for policy in policies:
        name = policy["metadata"]["name"]
        assert policy["spec"]["policyTypes"] == ["Ingress"], name
        labels = policy["spec"]["podSelector"].get("matchLabels", {})
        pods = policy_pods(objects, labels)
        assert pods, f"{name} selects no pod"
        for peer, ports in network_peers(policy):
            if "podSelector" in peer:
                assert policy_pods(objects, peer["podSelector"]["matchLabels"]), name
            for port in ports:  # a named port must be one the selected pods declare
                if isinstance(port["port"], str):
                    assert all(port["port"] in port_names(p) for p in pods), (name, port)
    # Every pod but the default is named by a policy of its own.
    selected = [policy_pods(objects, p["spec"]["podSelector"].get("matchLabels", {}))
                for p in policies if p is not deny]
    components = {pod["metadata"]["labels"]["app.kubernetes.io/component"]
                  for pods in selected for pod in pods}
    assert components == {"gateway", "worker", "flower", "redis", "rabbitmq"}
    assert allowed_in(objects, "gateway", "http") == {"*"}  # its Ingress, Prometheus
    assert allowed_in(objects, "worker", "metrics") == {"monitoring"}
    assert allowed_in(objects, "redis", "redis") == {"gateway"}
    assert allowed_in(objects, "flower", "http") == set()  # port-forward only
    assert allowed_in(objects, "rabbitmq", 5672) == {"gateway", "worker", "flower", "rabbitmq"}
    assert allowed_in(objects, "rabbitmq", 15672) \
        == {"flower", "keda", "rabbitmq-system", "rabbitmq"}
    assert allowed_in(objects, "rabbitmq", 15692) == {"monitoring", "rabbitmq"}
    # Each RabbitMQ port named is one the Service the operator makes serves.
    assert {5672, 15672, 15692} <= {p["port"] for peer, ports in network_peers(
        named(objects, "NetworkPolicy", "shoal-rabbitmq")) for p in ports}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_hpa_scales_on_cpu_and_on_requests_in_flight_the_adapter_serves(
        overlay: str) -> None:
    from gateway.edge.gateway_metrics import LATENCY
    from gateway.edge.outer_middleware import route_label

    objects = rendered(overlay)
    hpa = named(objects, "HorizontalPodAutoscaler", "shoal-gateway")
    metrics = {m["type"]: m for m in hpa["spec"]["metrics"]}
    assert set(metrics) == {"Resource", "Pods"}
    assert metrics["Resource"]["resource"]["name"] == "cpu"
    pods = metrics["Pods"]["pods"]
    name = pods["metric"]["name"]
    assert name == "shoal_gateway_requests_in_flight"
    assert pods["target"]["type"] == "AverageValue"
    gateway_env = env_values(named(objects, "Deployment", "shoal-gateway"))
    cap = int(gateway_env.get("SHOAL_GATEWAY_MAX_CONNECTIONS",
                              Settings.model_fields["gateway_max_connections"].default))
    assert 0 < float(pods["target"]["averageValue"]) < cap  # scales before it refuses
    config = yaml.safe_load(named(objects, "ConfigMap", "shoal-prometheus-adapter")
                            ["data"]["config.yaml"])
    served = {}
    for rule in config["rules"]:
        series = re.match(r"\w+", rule["seriesQuery"]).group(0)
        served[re.sub(rule["name"]["matches"], rule["name"]["as"], series)] = (series, rule)
    series, rule = served[name]
    # A series the gateway exports (the latency histogram's sum), per pod of the namespace.
    assert series == f"{LATENCY._name}_sum"
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"},
                                              "pod": {"resource": "pod"}}
    query = rule["metricsQuery"]
    assert query.startswith("sum(rate(<<.Series>>{<<.LabelMatchers>>,")
    assert query.endswith("by (<<.GroupBy>>)")
    routes = re.search(r'route=~"([^"]+)"', query).group(1)
    # Load is the API's requests, not probes and scrapes.
    for path, counted in [("/v1/embeddings", True), ("/v1/encode/BAAI/bge", True),
                          ("/v1/jobs/abc", True), ("/v2/rerank", True), ("/embed", True),
                          ("/rerank", True), ("/predict", True), ("/healthz", False),
                          ("/readyz", False), ("/metrics", False), ("/anything", False)]:
        assert bool(re.fullmatch(routes, route_label(path))) == counted, path


def compose_interpolated(text: str) -> str:
    """compose's interpolation with every variable set to a placeholder: ${VAR...} -> its
    name in lower case, "$$" -> "$"."""
    text = re.sub(r"\$\{(\w+)[^}]*\}", lambda m: m.group(1).lower(), text.replace("$$", "\0"))
    return text.replace("\0", "$")


def test_the_compose_stack_gives_its_processes_the_kubernetes_users_rights() -> None:
    compose = yaml.safe_load((REPO_ROOT / "infra" / "compose.yaml").read_text())
    conf = (REPO_ROOT / "infra" / "rabbitmq" / "20-shoal.conf").read_text()
    mounted = {c["source"]: c["target"] for c in compose["services"]["rabbitmq"]["configs"]}
    assert mounted["rabbitmq-conf"].startswith("/etc/rabbitmq/conf.d/")
    assert f"load_definitions = {mounted['rabbitmq-definitions']}" in conf.splitlines()
    definitions = json.loads(compose_interpolated(
        compose["configs"]["rabbitmq-definitions"]["content"]))
    users = {u["name"]: u for u in definitions["users"]}
    permissions = {p["user"]: p for p in definitions["permissions"]}
    objects = rendered(OVERLAYS[0])
    for service, user in USER_OF_COMPONENT.items():
        # Each process logs in as its own user, whose password comes from infra/.env.
        env = compose["services"][service]["environment"]
        url = compose_interpolated(env["SHOAL_BROKER_URL"])
        assert url.startswith(f"amqp://{user}:") and user in users, service
        assert users[user]["password"] == url.split(":")[2].split("@")[0] != ""
        [k8s_user] = [u for u in of_kind(objects, "User") if u["metadata"]["name"] == user]
        assert users[user]["tags"] == ",".join(k8s_user["spec"].get("tags", []))
        granted = permissions[user]
        assert granted["vhost"] == "/"
        assert {op: granted[op] for op in ("configure", "write", "read")} \
            == permission_of(objects, user)
        assert ("SHOAL_REDIS_URL" in env) == (service == "gateway")
        assert ("SHOAL_MANAGEMENT_URL" in env) == (service == "flower")
    redis = compose["services"]["redis"]
    password = "${REDIS_PASSWORD:?set REDIS_PASSWORD in infra/.env}"
    assert redis["command"][redis["command"].index("--requirepass") + 1] == password
    assert compose["services"]["gateway"]["environment"]["SHOAL_REDIS_URL"] \
        == f"redis://:{password}@redis:6379/0"
    # Every password compose needs is listed in the example, and infra/.env stays local.
    example = (REPO_ROOT / "infra" / ".env.example").read_text()
    needed = set(re.findall(r"\$\{(\w+):\?", (REPO_ROOT / "infra" / "compose.yaml").read_text()))
    assert needed and needed <= set(re.findall(r"^(\w+)=", example, re.M))
    ignored = subprocess.run(["git", "check-ignore", "-q", "infra/.env"], cwd=REPO_ROOT)
    assert ignored.returncode == 0
