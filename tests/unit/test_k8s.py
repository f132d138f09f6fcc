"""The Kubernetes deploy (infra/k8s): every overlay renders, validates, and agrees with the code.

`kubectl kustomize` renders each overlay; core objects are validated against Kubernetes'
own schemas (kubernetes-validate, strict: no unknown field), the KEDA, RabbitMQ-operator
and Prometheus-operator objects against their CRDs' published schemas (vendored in
tests/schemas/crds, read as strictly). Then what the manifests say is checked against
what shoal does: the queues KEDA watches are the ones app.topology derives for each pool's
models, every SHOAL_* variable is a setting with a valid value, probes and scrapes hit
paths the processes serve, grace periods cover the drain, alert rules are
infra/prometheus/alerts.yaml's.
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

from app.catalog import load_catalog
from app.settings import PACKAGED_CATALOG_DIR, REPO_ROOT, Settings
from app.topology import queue_for
from app.worker import pinned_models

K8S = REPO_ROOT / "infra" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
CRD_SCHEMAS = REPO_ROOT / "tests" / "schemas" / "crds"
KUBERNETES_VERSION = "1.33.0"  # the oldest release the deploy supports
CORE_GROUPS = {"v1", "apps/v1", "autoscaling/v2", "policy/v1"}
NAMESPACE = "shoal"
SHOAL_IMAGES = {"shoal-gateway", "shoal-worker-cpu", "shoal-worker-cuda"}

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
            "PrometheusRule"} <= kinds
    errors = {f"{o['kind']}/{o['metadata']['name']}": validation_errors(o) for o in objects}
    assert {k: v for k, v in errors.items() if v} == {}


@pytest.mark.parametrize(("kind", "path"), [
    ("Deployment", ["spec", "template", "spec", "containers", 0, "imagePullPolicyy"]),
    ("ScaledObject", ["spec", "minReplicas"]),
    ("RabbitmqCluster", ["spec", "replica"]),
    ("PodMonitor", ["spec", "podMetricsEndpoints", 0, "paths"]),
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
        assert {r["name"] for r in ref["spec"]["secretTargetRef"]} \
            == {f"{cluster['name']}-default-user"}
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

    from app.worker_health import WorkerHealth

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
    from gateway.auth_middleware import OPEN_PATHS

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
    cluster = of_kind(objects, "RabbitmqCluster")[0]["metadata"]["name"]
    referenced = set()
    for deployment in of_kind(objects, "Deployment"):
        for item in container(deployment).get("env", []):
            ref = item.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                referenced.add(ref["name"])
        for volume in deployment["spec"]["template"]["spec"].get("volumes", []):
            if "secret" in volume:
                referenced.add(volume["secret"]["secretName"])
    # The operator creates the first; docs/operations.md tells how to create the others.
    assert referenced == {f"{cluster}-default-user", "shoal-flower", "shoal-api-keys"}
    operations = (REPO_ROOT / "docs" / "operations.md").read_text()
    for secret in referenced - {f"{cluster}-default-user"}:
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
        image = container(deployment)["image"].split(":")[0].rsplit("/", 1)[-1]
        assert image in SHOAL_IMAGES, image
        assert (REPO_ROOT / "infra" / "docker"
                / f"{image.removeprefix('shoal-')}.Dockerfile").is_file()
        if deployment in workers(rendered(overlay)):
            gpus = container(deployment)["resources"].get("limits", {}).get("nvidia.com/gpu")
            device = env_values(deployment)["SHOAL_DEVICE"]
            assert (image, device) == (("shoal-worker-cuda", "cuda") if gpus
                                       else ("shoal-worker-cpu", "cpu"))


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
