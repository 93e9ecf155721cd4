"""The compose stack, checked with the real tools: Prometheus, promtool, the compose spec, hadolint.

A real Prometheus, started with the project's own scrape config (only the target address
and the scrape interval changed), scrapes the real server; every dashboard expression must
parse, name only exported metrics, and return data from that Prometheus.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import promql_parser
import pytest
import yaml

from api.metrics import GPU_METRICS
from tests.server_process import REPO_ROOT, ServerProcess, free_port, run_server
from tests.tiny_models import TinyModel, tiny_models_file

DOCKER = REPO_ROOT / "docker"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "loraserve.json"
BIN = Path(sys.executable).parent
# Panels whose metrics only a CUDA host exports: empty here, by design.
GPU_ONLY_PANELS = {"GPU memory by device"}


def tool(name: str) -> str:
    """The tool's path; a missing one fails (never skips) and says how to install it."""
    found = shutil.which(name) or shutil.which(name, path=str(BIN))
    if found is None:
        pytest.fail(
            f"{name} is not installed: `make test` installs it (apt-get install prometheus)"
        )
    return found


def run(*command: str, cwd: Path = REPO_ROOT) -> str:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_promtool_checks_the_config_and_its_rules(tmp_path: Path) -> None:
    run(tool("promtool"), "check", "config", str(DOCKER / "prometheus" / "prometheus.yml"))
    run(tool("promtool"), "test", "rules", "alerts_test.yml", cwd=DOCKER / "prometheus")


def test_compose_files_validate_against_the_compose_specification() -> None:
    run(
        tool("check-jsonschema"),
        "--builtin-schema",
        "vendor.compose-spec",
        "compose.yaml",
        "compose.gpu.yaml",
    )
    compose = yaml.safe_load((REPO_ROOT / "compose.yaml").read_text(encoding="utf-8"))
    assert set(compose["services"]) == {"api", "prometheus", "grafana"}
    assert compose["services"]["api"]["stop_grace_period"] == "30s"  # > DRAIN_SECONDS


def test_dockerfiles_pass_hadolint() -> None:
    run(tool("hadolint"), "docker/Dockerfile", "docker/Dockerfile.cuda")


def panel_queries() -> dict[str, list[str]]:
    """Panel title → its PromQL expressions, with Grafana's variables made concrete."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    concrete = {
        "$__rate_interval": "20s",
        '=~"$instance"': '=~".+"',
        '=~"$model"': '=~".+"',
    }
    queries: dict[str, list[str]] = {}
    for panel in dashboard["panels"]:
        exprs = []
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in concrete.items():
                expr = expr.replace(variable, value)
            assert "$" not in expr, expr
            exprs.append(expr)
        queries[panel["title"]] = exprs
    return queries


def metric_names(node: object) -> set[str]:
    """Every metric a parsed PromQL expression selects."""
    names: set[str] = set()
    if type(node).__name__ == "VectorSelector" and getattr(node, "name", None):
        names.add(node.name)  # type: ignore[attr-defined]
    for child in ("lhs", "rhs", "expr", "param", "vector_selector"):
        value = getattr(node, child, None)
        if value is not None and not isinstance(value, (str, int, float)):
            names |= metric_names(value)
    for arg in getattr(node, "args", None) or []:
        names |= metric_names(arg)
    return names


@pytest.fixture
def scraped(tiny_bert: TinyModel, tmp_path: Path) -> Iterator[tuple[ServerProcess, str]]:
    """The real server with traffic, and a real Prometheus that has scraped it a few times."""
    models = tiny_models_file(tmp_path, tiny_bert, adapters=("spam",))
    env = {"MODELS_FILE": str(models), "DISK_CACHE_DIR": str(tmp_path / "cache")}
    with run_server(env, tmp_path) as server:
        server.wait_ready()
        config_dir = tmp_path / "prometheus"
        shutil.copytree(DOCKER / "prometheus", config_dir)
        config = (config_dir / "prometheus.yml").read_text(encoding="utf-8")
        target = server.url.removeprefix("http://")
        # The only changes: where the service is, and scrapes every second so a short test
        # sees several.
        config = config.replace("api:8000", target).replace(
            "scrape_interval: 5s", "scrape_interval: 1s"
        )
        (config_dir / "prometheus.yml").write_text(config, encoding="utf-8")
        port = free_port()
        prometheus = subprocess.Popen(
            [
                tool("prometheus"),
                f"--config.file={config_dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=(tmp_path / "prometheus.log").open("w"),
        )
        url = f"http://127.0.0.1:{port}"
        try:
            traffic(server.url, seconds=8)
            wait_for_scrapes(url, count=5)
            yield server, url
        finally:
            prometheus.terminate()
            prometheus.wait(timeout=20)


def traffic(url: str, seconds: float) -> None:
    """Predictions with one and several texts, repeats (cache hits), and one refusal."""
    deadline = time.monotonic() + seconds
    index = 0
    with httpx.Client(base_url=url, timeout=10) as client:
        client.post("/predict", json={"inputs": []})
        while time.monotonic() < deadline:
            index += 1
            client.post("/predict", json={"inputs": f"win a prize {index % 7}"})
            client.post("/predict", json={"inputs": ["lunch", f"call now {index}"]})
            time.sleep(0.05)


def wait_for_scrapes(url: str, count: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            result = query(url, 'count_over_time(up{job="loraserve"}[1m])')
            if result and float(result[0]["value"][1]) >= count:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise AssertionError("Prometheus did not scrape the service")


def query(url: str, expr: str) -> list[dict[str, object]]:
    response = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    body = response.json()
    assert response.status_code == 200 and body["status"] == "success", (expr, body)
    result: list[dict[str, object]] = body["data"]["result"]
    return result


def test_prometheus_scrapes_the_service_and_every_panel_returns_data(
    scraped: tuple[ServerProcess, str],
) -> None:
    server, prometheus = scraped
    assert float(query(prometheus, 'up{job="loraserve"}')[0]["value"][1]) == 1  # type: ignore[index]
    exported = {
        re.split(r"[{ ]", line, maxsplit=1)[0]
        for line in httpx.get(f"{server.url}/metrics").text.splitlines()
        if line and not line.startswith("#")
    } | {"up"}
    empty = []
    for title, exprs in panel_queries().items():
        for expr in exprs:
            names = metric_names(promql_parser.parse(expr))
            unknown = names - exported
            if title in GPU_ONLY_PANELS:
                unknown -= set(GPU_METRICS)
            assert names and not unknown, (title, expr, unknown)
            if not query(prometheus, expr):
                empty.append(title)
    assert set(empty) == GPU_ONLY_PANELS, empty


def test_dashboard_has_the_variables_and_every_panel_says_what_it_tells() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"model", "instance"}
    for panel in dashboard["panels"]:
        assert panel["description"], panel["title"]
        assert panel["datasource"]["uid"] == "prometheus"
