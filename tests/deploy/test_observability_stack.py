"""The compose stack, checked with the real tools: Prometheus, promtool, the compose spec, hadolint.

tests/deploy/test_stack.py runs the stack in Docker, but without Grafana (no package here), so the
stack's parts are also checked one by one: a real Prometheus, started with the project's own
scrape config and alert rules, scrapes the real server after traffic (serving the rollout
demo, artifacts/rollout.yaml, so that the candidate panels have data); every dashboard
expression must parse, name only metrics the service exports, and return data from that
Prometheus. A missing tool fails the test and says how to install it.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import diskcache
import httpx
import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from api.metrics import DASHBOARD_METRICS, GPU_METRICS
from api.serving.cache.entry import cache_key
from api.settings import Settings
from tests.support.in_process import SETTING_NAMES
from tests.support.promql import metric_names
from tests.support.server_process import REPO_ROOT, free_port, run_server

DOCKER = REPO_ROOT / "docker"
ARTIFACTS = REPO_ROOT / "artifacts"
# The rollout demo: the embedded encoder serving its previous adapter (spam-v1), the current
# one (spam-v2) its shadow candidate on every text: the candidate and drift panels' data.
ROLLOUT_MODELS = ARTIFACTS / "rollout.yaml"
PROMETHEUS_DIR = DOCKER / "prometheus"
GRAFANA_DIR = DOCKER / "grafana"
DASHBOARDS = sorted((GRAFANA_DIR / "dashboards").glob("*.json"))
DOCKERFILES = (DOCKER / "Dockerfile", DOCKER / "Dockerfile.cuda")
VENV_BIN = Path(sys.executable).parent

# The names dashboards and alerts may use: the pinned ones, the GPU ones (exported on CUDA
# hosts only), three fault counters, the candidates' promotions (at 0 from the start, but
# not pinned), Prometheus's own `up`, and the process_* collector's.
ALLOWED_METRICS = {
    *DASHBOARD_METRICS,
    *GPU_METRICS,
    "loraserve_batch_dropped_total",
    "loraserve_cache_errors_total",
    "loraserve_cache_rejected_total",
    "loraserve_candidate_promotions_total",
    "up",
}
# A text the disk tier holds a row for that this service did not write (refused_from_disk).
PLANTED_TEXT = "a text whose cached answer someone else wrote"
# Panels that only a CUDA host fills: empty on CPU, and the only ones allowed to be.
GPU_PANELS = {"GPU memory by device"}
# Stands for Grafana's $__rate_interval: the whole test's traffic lies inside one minute.
RATE_INTERVAL = "1m"
# Ads their recipient asked for, from the PH set: spam-v1, trained without that set,
# blocks most of them (artifacts/spam-minilm/MODEL_CARD.md), so the candidate flips some.
WANTED_ADS = 4

APT = "apt-get update && apt-get install -y prometheus  (`make test` does it)"
PIP = ".venv/bin/pip install -e '.[dev]'  (`make test` does it)"
INSTALL = {"prometheus": APT, "promtool": APT, "hadolint": PIP, "check-jsonschema": PIP}


def tool(name: str) -> str:
    """The tool's path; a missing one fails (never skips) and says how to install it."""
    found = shutil.which(name, path=str(VENV_BIN)) or shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed; install it with: {INSTALL[name]}")
    return found


def run(*command: str, cwd: Path = REPO_ROOT) -> str:
    """Runs a tool; its whole output is the failure message."""
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"{' '.join(command)}:\n{result.stdout}{result.stderr}"
    return result.stdout


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


# --- Prometheus config and alert rules -------------------------------------------------------


def test_promtool_checks_the_config_and_unit_tests_the_alert_rules(tmp_path: Path) -> None:
    # A copy with its rules beside it, as compose mounts them, so rule_files resolves.
    config_dir = shutil.copytree(PROMETHEUS_DIR, tmp_path / "prometheus")
    promtool = tool("promtool")
    run(promtool, "check", "config", "prometheus.yml", cwd=config_dir)
    run(promtool, "check", "rules", "alerts.yml", cwd=config_dir)
    run(promtool, "test", "rules", "alerts_test.yml", cwd=config_dir)


def test_every_alert_has_a_firing_and_a_not_firing_unit_test() -> None:
    rules = load_yaml(PROMETHEUS_DIR / "alerts.yml")
    alerts = {
        rule["alert"] for group in rules["groups"] for rule in group["rules"] if "alert" in rule
    }
    cases = [
        case
        for test in load_yaml(PROMETHEUS_DIR / "alerts_test.yml")["tests"]
        for case in test["alert_rule_test"]
    ]
    firing = {case["alertname"] for case in cases if case["exp_alerts"]}
    quiet = {case["alertname"] for case in cases if not case["exp_alerts"]}
    assert alerts == firing == quiet, (alerts, firing, quiet)


# --- compose, Dockerfiles --------------------------------------------------------------------


def test_compose_files_validate_against_the_compose_specification() -> None:
    # check-jsonschema vendors the compose-spec schema, so this works offline.
    run(
        tool("check-jsonschema"),
        "--builtin-schema",
        "vendor.compose-spec",
        "compose.yaml",
        "compose.gpu.yaml",
    )


def test_compose_stack_wires_the_service_prometheus_and_grafana() -> None:
    compose = load_yaml(REPO_ROOT / "compose.yaml")
    services = compose["services"]
    # `docker compose up` without a profile (the `scale` profile: tests/service/test_scale_out.py).
    unprofiled = {name for name, service in services.items() if "profiles" not in service}
    assert unprofiled == {"api", "prometheus", "grafana"}
    api = services["api"]
    assert api["build"]["dockerfile"] == "docker/Dockerfile"
    assert "/ready" in " ".join(api["healthcheck"]["test"])
    grace_seconds = float(api["stop_grace_period"].removesuffix("s"))
    assert grace_seconds > Settings.model_fields["drain_seconds"].default
    # The container's layout must win over a .env written for a local run.
    assert api["environment"]["HOST"] == "0.0.0.0" and api["environment"]["PORT"] == 8000
    assert "./docker/prometheus:/etc/prometheus:ro" in services["prometheus"]["volumes"]
    grafana_mounts = " ".join(services["grafana"]["volumes"])
    assert "./docker/grafana/provisioning:" in grafana_mounts
    assert "./docker/grafana/dashboards:" in grafana_mounts
    assert {"hf-cache", "prediction-cache", "grafana-data"} <= set(compose["volumes"])
    # Prometheus scrapes the service by its compose name; the GPU override keeps that name.
    scrape = load_yaml(PROMETHEUS_DIR / "prometheus.yml")["scrape_configs"][0]
    assert scrape["static_configs"][0]["targets"] == ["api:8000"]

    gpu = load_yaml(REPO_ROOT / "compose.gpu.yaml")["services"]
    assert set(gpu) == {"api", "replica"} and gpu["replica"] == gpu["api"]
    assert gpu["api"]["build"]["dockerfile"] == "docker/Dockerfile.cuda"
    [device] = gpu["api"]["deploy"]["resources"]["reservations"]["devices"]
    assert device == {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}


def test_every_compose_knob_has_a_default_and_is_listed_in_env_example() -> None:
    text = "".join(
        (REPO_ROOT / name).read_text(encoding="utf-8")
        for name in ("compose.yaml", "compose.gpu.yaml")
    )
    knobs = re.findall(r"\$\{(\w+)(:-)?", text)
    assert knobs and all(default for _, default in knobs), knobs
    listed = set(re.findall(r"^#? ?(\w+)=", (REPO_ROOT / ".env.example").read_text(), re.M))
    assert {name for name, _ in knobs} <= listed


def test_dockerfiles_pass_hadolint() -> None:
    run(tool("hadolint"), "--failure-threshold", "style", *map(str, DOCKERFILES))


def test_dockerignore_keeps_what_the_images_copy() -> None:
    # The build context is an allow-list: a new COPY needs its path re-included.
    patterns = (REPO_ROOT / ".dockerignore").read_text(encoding="utf-8").split()
    included = {p.removeprefix("!").rstrip("/") for p in patterns if p.startswith("!")}
    assert "*" in patterns
    for dockerfile in DOCKERFILES:
        for line in dockerfile.read_text(encoding="utf-8").splitlines():
            if line.startswith("COPY "):
                sources = line.split()[1:-1]
                assert {s.rstrip("/") for s in sources} <= included, (dockerfile.name, line)


# --- dashboards ------------------------------------------------------------------------------


def panels() -> list[dict[str, Any]]:
    """Every panel with queries: rows only head a group of them."""
    return [
        panel
        for path in DASHBOARDS
        for panel in json.loads(path.read_text(encoding="utf-8"))["panels"]
        if panel["type"] != "row"
    ]


def test_dashboards_use_the_provisioned_datasource_and_describe_every_panel() -> None:
    datasources = load_yaml(GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yml")
    [uid] = [source["uid"] for source in datasources["datasources"]]
    assert DASHBOARDS
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text(encoding="utf-8"))
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        assert set(variables) == {"model", "instance"}, path.name
        assert all(v["definition"].startswith("label_values(") for v in variables.values())
        for panel in dashboard["panels"]:
            title = panel["title"]
            assert len(panel.get("description", "")) > 20, f"{title}: say what it tells"
            if panel["type"] == "row":
                # Expanded, so the panels under it are the dashboard's own, checked here; a
                # collapsed row would keep them inside itself, out of every test's sight.
                assert panel["collapsed"] is False and panel["panels"] == [], title
                continue
            assert panel["datasource"]["uid"] == uid, title
            assert all(t["datasource"]["uid"] == uid for t in panel["targets"]), title


# --- a real Prometheus scraping the real server ----------------------------------------------


@dataclass
class Stack:
    """The server under traffic and a Prometheus that has scraped it since."""

    server_url: str
    prometheus_url: str
    exported: set[str] = field(default_factory=set)  # sample names in /metrics after traffic

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query; any error fails the test with Prometheus's message."""
        response = httpx.get(
            f"{self.prometheus_url}/api/v1/query", params={"query": expr}, timeout=10
        )
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", (expr, body)
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def label_values(self, selector: str, label: str) -> set[str]:
        """What Grafana's `label_values(selector, label)` lists."""
        response = httpx.get(
            f"{self.prometheus_url}/api/v1/series", params={"match[]": selector}, timeout=10
        )
        response.raise_for_status()
        return {series[label] for series in response.json()["data"] if label in series}


def wanted_ads() -> list[str]:
    """The first of the PH set's `ads` texts: ham its recipient wanted, worded like spam."""
    with (REPO_ROOT / "data" / "ph_spam_marketing_sms.tsv").open(encoding="utf-8") as rows:
        ads = [
            row["text"] for row in csv.DictReader(rows, delimiter="\t") if row["category"] == "ads"
        ]
    return ads[:WANTED_ADS]


def traffic(url: str, seconds: float) -> None:
    """Predictions with one and several texts, repeats (cache hits), one invalid request, and
    new texts each round, some worded like spam, for the candidate to compare."""
    ads = wanted_ads()
    deadline: float | None = None
    with httpx.Client(base_url=url, timeout=10) as client:
        assert client.post("/predict", json={"inputs": []}).status_code == 422
        index = 0
        while deadline is None or time.monotonic() < deadline:
            index += 1
            one = client.post("/predict", json={"inputs": "win a free prize now"})
            several = client.post("/predict", json={"inputs": ["lunch?", f"call {index}", "ok"]})
            fresh = [f"{text} {index}" for text in ads]  # not cached: compared anew
            compared = client.post("/predict", json={"inputs": fresh})
            statuses = {one.status_code, several.status_code, compared.status_code}
            assert statuses == {200}, (one.text, several.text, compared.text)
            if deadline is None:
                # Counted from the first round's end: on a busy machine that round alone took
                # the whole time, and the repeats (cache hits) and rises the rates need came
                # after the last scrape or not at all.
                deadline = time.monotonic() + seconds
            time.sleep(0.1)


def predictions(text: str) -> float:
    """The server's loraserve_predictions_total, summed over its labels."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "loraserve_predictions_total"
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("stack")
    [model] = yaml.safe_load(ROLLOUT_MODELS.read_text(encoding="utf-8"))["models"]
    # One run-time adapter in the watched folder, loaded at start: the adapter panels' data.
    shutil.copytree(
        ARTIFACTS / "spam-minilm" / "adapter", tmp / "adapters" / model["name"] / "spam-runtime"
    )
    env = {
        "MODELS_FILE": str(ROLLOUT_MODELS),
        "DISK_CACHE_DIR": str(tmp / "cache"),
        "ADAPTERS_DIR": str(tmp / "adapters"),
        # Every request queued: on a busy machine admission by time refused some of the
        # traffic's (429) while the encoder and its shadow shared the cores.
        "ADMISSION_CONTROL": "false",
    }
    with pytest.MonkeyPatch.context() as patch:
        for name in SETTING_NAMES & set(os.environ):
            patch.delenv(name)  # the developer's own settings stay out of the server
        with run_server(env, tmp) as server:
            server.wait_ready()
            refused_from_disk(server.url, tmp / "cache")
            yield from scrape(server.url, tmp)


def refused_from_disk(url: str, folder: Path) -> None:
    """A text whose disk row someone else wrote (a pickle), asked for: the disk tier refuses
    the row and the model answers, the 'Cache values refused' panel's data."""
    [model] = httpx.get(f"{url}/models", timeout=10).json()["models"]
    default = model["default_adapter"]
    identity = next(i["digest"] for i in model["identities"] if i["adapter"] == default)
    with diskcache.Cache(str(folder)) as planted:
        planted.set(cache_key(identity, True, PLANTED_TEXT), ["not", "an", "answer"])
    response = httpx.post(f"{url}/predict", json={"inputs": PLANTED_TEXT}, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["X-Cache"] == "lru=0,disk=0,model=1"


def scrape(server_url: str, tmp: Path) -> Iterator[Stack]:
    """Starts Prometheus on the project's config, sends traffic, waits until it is scraped."""
    config_dir = shutil.copytree(PROMETHEUS_DIR, tmp / "prometheus")
    config_path = config_dir / "prometheus.yml"
    config = config_path.read_text(encoding="utf-8")
    # The only changes: where the service listens, and 1 s scrape and rule evaluation
    # intervals (5 s and 15 s in compose) so a short test sees many scrapes and evaluations.
    for old, new in (
        ("api:8000", server_url.removeprefix("http://")),
        ("scrape_interval: 5s", "scrape_interval: 1s"),
        ("evaluation_interval: 15s", "evaluation_interval: 1s"),
    ):
        assert config.count(old) == 1, f"prometheus.yml no longer has {old!r}: update this test"
        config = config.replace(old, new)
    config_path.write_text(config, encoding="utf-8")

    port = free_port()
    log_path = tmp / "prometheus.log"
    with log_path.open("w", encoding="utf-8") as log:
        prometheus = subprocess.Popen(
            [
                tool("prometheus"),
                f"--config.file={config_path}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        stack = Stack(server_url, f"http://127.0.0.1:{port}")
        # Until its storage is open, Prometheus answers queries 503 in plain text.
        ready = f"{stack.prometheus_url}/-/ready"
        wait_for(lambda: httpx.get(ready, timeout=10).status_code == 200, "not ready", log_path)
        # Scraped before the traffic and several times during it, so every rate has a rise.
        wait_for(lambda: bool(stack.query('up{job="loraserve"} == 1')), "no scrape", log_path)
        traffic(server_url, seconds=3)
        metrics = httpx.get(f"{server_url}/metrics", timeout=10).text
        stack.exported = {
            s.name for f in text_string_to_metric_families(metrics) for s in f.samples
        }
        final = predictions(metrics)

        def scraped_final() -> bool:
            latest = stack.query("sum(loraserve_predictions_total)")
            return bool(latest) and float(latest[0]["value"][1]) == final

        wait_for(scraped_final, "Prometheus did not scrape the final count", log_path)
        yield stack
    finally:
        prometheus.terminate()
        try:
            prometheus.wait(timeout=10)
        except subprocess.TimeoutExpired:
            prometheus.kill()
            prometheus.wait(timeout=10)


def wait_for(condition: Callable[[], bool], what: str, log: Path) -> None:
    """Polls until the condition holds (bounded: 30 s); Prometheus's log is the message."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except httpx.TransportError:
            pass  # Prometheus is still starting
        time.sleep(0.2)
    raise AssertionError(f"{what} within 30 s:\n{log.read_text()}")


def concrete(expr: str, values: dict[str, set[str]]) -> str:
    """The expression as Grafana sends it: variables replaced by what they list."""
    expr = expr.replace("$__rate_interval", RATE_INTERVAL)
    for name, listed in values.items():
        expr = expr.replace(f"${name}", "|".join(sorted(listed)))
    assert "$" not in expr, f"unknown Grafana variable in {expr}"
    return expr


def has_data(result: list[dict[str, Any]]) -> bool:
    return any(not math.isnan(float(series["value"][1])) for series in result)


def test_prometheus_scrapes_the_server_with_the_projects_config(stack: Stack) -> None:
    [up] = stack.query('up{job="loraserve"}')
    assert up["value"][1] == "1"
    assert stack.query("loraserve_ready")[0]["value"][1] == "1"


def test_every_dashboard_expression_parses_names_exported_metrics_and_returns_data(
    stack: Stack,
) -> None:
    on_gpu = set(GPU_METRICS) <= stack.exported
    exported = stack.exported | {"up"} | set(GPU_METRICS)  # GPU ones: exported with CUDA
    values: dict[str, set[str]] = {}
    for path in DASHBOARDS:
        for variable in json.loads(path.read_text(encoding="utf-8"))["templating"]["list"]:
            match = re.fullmatch(r"label_values\((.+), *(\w+)\)", variable["definition"])
            assert match, variable["definition"]
            values[variable["name"]] = stack.label_values(*match.groups())
            assert values[variable["name"]], f"variable {variable['name']} lists nothing"

    empty: set[str] = set()
    for panel in panels():
        title = panel["title"]
        for target in panel["targets"]:
            expr = concrete(target["expr"], values)
            names = metric_names(promql_parser.parse(expr))
            # The AST walk must see every metric-like word, or a missed node hides a name.
            assert set(re.findall(r"\b(?:loraserve|process)_\w+", expr)) <= names, expr
            disallowed = {n for n in names if n not in ALLOWED_METRICS}
            disallowed = {n for n in disallowed if not n.startswith("process_")}
            assert names and not disallowed, f"{title}: {expr} names {disallowed}"
            assert names <= exported, f"{title}: {expr} names unexported {names - exported}"
            if not has_data(stack.query(expr)):
                empty.add(title)
    assert empty == (set() if on_gpu else GPU_PANELS), f"panels without data: {empty}"


def test_alert_rules_load_and_evaluate_against_the_live_metrics(stack: Stack) -> None:
    rules = load_yaml(PROMETHEUS_DIR / "alerts.yml")
    # Alerts and the recording rules they read, by the name Prometheus lists them under.
    expected = {
        rule.get("alert", rule.get("record")): rule
        for group in rules["groups"]
        for rule in group["rules"]
    }
    recorded = {rule["record"] for rule in expected.values() if "record" in rule}
    for name, rule in expected.items():
        names = metric_names(promql_parser.parse(rule["expr"])) - recorded
        assert names <= ALLOWED_METRICS, (name, names - ALLOWED_METRICS)
        assert names <= stack.exported | {"up"}, (name, names - stack.exported)

    deadline = time.monotonic() + 15
    while True:  # rules evaluate every second in this config: wait for one round
        response = httpx.get(f"{stack.prometheus_url}/api/v1/rules", timeout=10)
        loaded = {
            rule["name"]: rule
            for group in response.json()["data"]["groups"]
            for rule in group["rules"]
        }
        evaluated = loaded and all(rule.get("health") == "ok" for rule in loaded.values())
        if evaluated or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert set(loaded) == set(expected)
    for name, rule in loaded.items():
        assert rule["health"] == "ok", (name, rule.get("lastError"))
    # The service is up and ready: those two must be quiet.
    assert loaded["LoraserveDown"]["state"] == loaded["LoraserveNotReady"]["state"] == "inactive"
