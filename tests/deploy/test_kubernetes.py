"""deploy/kubernetes, checked offline: each kustomization built by `kubectl kustomize`, every
built object validated by kubernetes-validate against a pinned Kubernetes version (strict:
unknown fields refused), and the Deployment's probes, grace period, ports, volumes and
autoscaling metric checked against the service's own settings, routes and metrics."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import promql_parser
import pytest
import yaml

from api.http.routes import status
from api.metrics import Metrics
from api.settings import Settings
from tests.support.in_process import SETTING_NAMES
from tests.support.promql import metric_names
from tests.support.server_process import REPO_ROOT

KUBERNETES_VERSION = "1.32.0"
DEPLOY = REPO_ROOT / "deploy" / "kubernetes"
KUSTOMIZATIONS = {"base": DEPLOY / "base", "gpu": DEPLOY / "overlays" / "gpu"}
# The compose healthchecks' start periods: Kubernetes allows a load at least as long.
COMPOSE_FILES = {"base": ("compose.yaml",), "gpu": ("compose.yaml", "compose.gpu.yaml")}
KINDS = {
    "ConfigMap",
    "Deployment",
    "HorizontalPodAutoscaler",
    "PersistentVolumeClaim",
    "PodDisruptionBudget",
    "Service",
}

Manifest = dict[str, Any]


def kustomize(folder: Path) -> list[Manifest]:
    """The objects `kubectl kustomize` builds from `folder`."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not installed: it builds the kustomizations (kubectl kustomize)")
    result = subprocess.run(
        [kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module", params=sorted(KUSTOMIZATIONS))
def built(request: pytest.FixtureRequest) -> tuple[str, list[Manifest]]:
    variant: str = request.param
    return variant, kustomize(KUSTOMIZATIONS[variant])


def one(manifests: list[Manifest], kind: str, name: str) -> Manifest:
    [found] = [m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name]
    return found


def quantity(value: str | int) -> float:
    """A Kubernetes quantity without binary suffixes: "250m" is 0.25, "2" is 2."""
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


# What the operator puts in the Secret loraserve-redis (kustomization.yaml says how).
SECRET_VALUES = {
    ("loraserve-redis", "password"): "0f" * 16,
    ("loraserve-redis", "cache-secret"): "1e" * 16,
}


def container_environment(manifests: list[Manifest], container: Manifest) -> dict[str, str]:
    """The variables a container gets, as the kubelet makes them: its ConfigMap's, then its
    `env` in order, each `$(NAME)` replaced by a variable defined before it, each secretKeyRef
    read from SECRET_VALUES."""
    environment: dict[str, str] = {}
    for source in container.get("envFrom", []):
        environment.update(one(manifests, "ConfigMap", source["configMapRef"]["name"])["data"])
    for variable in container.get("env", []):
        if "valueFrom" in variable:
            ref = variable["valueFrom"]["secretKeyRef"]
            environment[variable["name"]] = SECRET_VALUES[ref["name"], ref["key"]]
        else:
            environment[variable["name"]] = expand(variable["value"], environment)
    return environment


def expand(value: str, environment: dict[str, str]) -> str:
    """`value` with each `$(NAME)` of a defined variable replaced, as the kubelet does in
    `env` values, `command` and `args`."""
    for name, defined in environment.items():
        value = value.replace(f"$({name})", defined)
    return value


def served_settings(manifests: list[Manifest], container: Manifest) -> Settings:
    """The settings the pods get: their ConfigMap and variables, parsed by the service's own
    class (names that are not settings, such as REDIS_PASSWORD, only build others)."""
    [source] = container["envFrom"]
    data = one(manifests, "ConfigMap", source["configMapRef"]["name"])["data"]
    assert set(data) <= SETTING_NAMES, set(data) - SETTING_NAMES  # no misspelt setting
    environment = container_environment(manifests, container)
    values = {name.lower(): value for name, value in environment.items() if name in SETTING_NAMES}
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]


def test_every_built_object_validates(built: tuple[str, list[Manifest]]) -> None:
    _, manifests = built
    assert {m["kind"] for m in manifests} == KINDS
    for manifest in manifests:
        kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)


def test_probes_grace_period_ports_and_volumes_match_the_service(
    built: tuple[str, list[Manifest]],
) -> None:
    variant, manifests = built
    deployment = one(manifests, "Deployment", "loraserve")
    pod = deployment["spec"]["template"]
    [container] = pod["spec"]["containers"]
    settings = served_settings(manifests, container)
    defaults = Settings(_env_file=None)  # type: ignore[call-arg]
    routes = {getattr(route, "path", None) for route in status.router.routes}

    [port] = container["ports"]
    assert port["containerPort"] == settings.port and port["name"] == "http"
    probes = {kind: container[f"{kind}Probe"]["httpGet"] for kind in ("startup", "readiness")}
    probes["liveness"] = container["livenessProbe"]["httpGet"]
    assert {kind: probe["path"] for kind, probe in probes.items()} == {
        "startup": "/ready",
        "readiness": "/ready",
        "liveness": "/health",
    }
    assert {"/ready", "/health", "/metrics"} <= routes
    assert all(probe["port"] == "http" for probe in probes.values())

    # Loading: at least the start period the compose healthcheck allows the same image.
    startup = container["startupProbe"]
    compose = {}
    for name in COMPOSE_FILES[variant]:
        compose.update(yaml.safe_load((REPO_ROOT / name).read_text())["services"]["api"])
    start_period = float(compose["healthcheck"]["start_period"].removesuffix("s"))
    assert startup["periodSeconds"] * startup["failureThreshold"] >= start_period

    # Draining: the pod leaves the Service before the drain ends, and is killed only after
    # the preStop pause and the whole drain.
    assert settings.drain_seconds == defaults.drain_seconds
    readiness = container["readinessProbe"]
    assert readiness["periodSeconds"] * readiness["failureThreshold"] < settings.drain_seconds
    pause = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pause[0] == "sleep"
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert grace > float(pause[1]) + settings.drain_seconds

    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(settings.port)
    assert annotations["prometheus.io/path"] == "/metrics"

    mounts = {mount["mountPath"] for mount in container["volumeMounts"]}
    assert settings.hf_home is not None and settings.model_cache_dir is not None
    assert {str(settings.hf_home), str(settings.model_cache_dir)} <= mounts
    assert str(settings.disk_cache_dir) in mounts
    # The disk tier's key: outside its folder, on a volume of the pod's own as the folder is,
    # so a restarted container reads the key its entries were signed with.
    key_file = settings.disk_cache_secret_file
    assert key_file is not None and not key_file.is_relative_to(settings.disk_cache_dir)
    volume = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
    [key_volume] = [v for v in pod["spec"]["volumes"] if v["name"] == volume[str(key_file.parent)]]
    assert "emptyDir" in key_volume

    requests = container["resources"]["requests"]
    assert settings.torch_num_threads == quantity(requests["cpu"])
    if variant == "gpu":
        assert settings.device == "cuda" and container["image"].endswith(":cuda")
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    else:
        assert "nvidia.com/gpu" not in container["resources"].get("limits", {})

    # Everything else points at what it should.
    labels = pod["metadata"]["labels"]
    service = one(manifests, "Service", "loraserve")
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    budget = one(manifests, "PodDisruptionBudget", "loraserve")
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    redis = one(manifests, "Service", "loraserve-redis")
    password = SECRET_VALUES["loraserve-redis", "password"]
    assert settings.redis_url == f"redis://:{password}@{redis['metadata']['name']}:6379/0"
    assert redis["spec"]["ports"][0]["port"] == 6379
    assert settings.redis_cache_secret is not None
    assert (
        settings.redis_cache_secret.get_secret_value()
        == SECRET_VALUES["loraserve-redis", "cache-secret"]
    )
    assert not settings.redis_trusted_network


def test_redis_requires_the_password_the_replicas_connect_with(
    built: tuple[str, list[Manifest]],
) -> None:
    _, manifests = built
    [server] = one(manifests, "Deployment", "loraserve-redis")["spec"]["template"]["spec"][
        "containers"
    ]
    environment = container_environment(manifests, server)
    password = SECRET_VALUES["loraserve-redis", "password"]
    written = server["args"][server["args"].index("--requirepass") + 1]
    assert written.startswith("$(")  # a reference to the Secret, no password in the manifest
    assert expand(written, environment) == password
    # The probe's redis-cli authenticates with REDISCLI_AUTH: the same password.
    assert environment["REDISCLI_AUTH"] == password
    assert server["readinessProbe"]["exec"]["command"] == ["redis-cli", "ping"]


def exported_sample_names() -> set[str]:
    """Every sample name the service's metrics can have, from their declarations."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    names = set()
    for family in Metrics(latency_target_seconds=2.0).registry.collect():
        for suffix in suffixes.get(family.type, ("",)):
            names.add(family.name + suffix)
    return names


def test_autoscaling_follows_the_services_queue_wait(built: tuple[str, list[Manifest]]) -> None:
    _, manifests = built
    autoscaler = one(manifests, "HorizontalPodAutoscaler", "loraserve")
    assert autoscaler["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "loraserve",
    }
    assert autoscaler["spec"]["minReplicas"] >= 2  # the budget keeps one up in a drain
    [signal] = autoscaler["spec"]["metrics"]
    assert signal["type"] == "Pods"
    name = signal["pods"]["metric"]["name"]
    threshold = quantity(signal["pods"]["target"]["averageValue"])
    assert 0 < threshold < Settings.model_fields["latency_target_seconds"].default

    # prometheus-adapter's rule makes that metric from the service's own histogram.
    adapter = one(manifests, "ConfigMap", "loraserve-prometheus-adapter-rules")
    [rule] = yaml.safe_load(adapter["data"]["prometheus-adapter-rules.yaml"])["rules"]
    assert rule["name"]["as"] == name
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    query = (
        rule["metricsQuery"]
        .replace("<<.LabelMatchers>>", 'namespace="default",pod="loraserve-0"')
        .replace("<<.GroupBy>>", "pod")
    )
    selected = metric_names(promql_parser.parse(query))
    selected |= metric_names(promql_parser.parse(rule["seriesQuery"]))
    assert selected == {"loraserve_queue_wait_seconds_sum", "loraserve_queue_wait_seconds_count"}
    assert selected <= exported_sample_names()
