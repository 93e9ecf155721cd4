"""`docker compose up`, for real: the images built, the stack started, scraped, stopped under
traffic and started again, on a Docker Engine (`make test-stack`; `make test` runs it where an
engine can be started, and says so where none can).

The stack is the project's own compose.yaml and Prometheus config, copied unchanged into a
scratch folder with the test's own .env (a developer's stays out), run as `docker compose up -d
api prometheus` (Grafana has no package here: tests/deploy/test_observability_stack.py checks
it). Its images are docker/Dockerfile built as it is and stand-ins for the two images the
project pulls (tests/support/stack_images.py). Everything is checked through the published
ports, as a user would, and the timings and the image size are printed at the end.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from api.models.spec import load_models_file
from tests.support.docker_engine import Docker, docker_engine
from tests.support.in_process import serving
from tests.support.load_client import metric
from tests.support.server_process import REPO_ROOT, free_port
from tests.support.stack_images import (
    Build,
    base_images,
    build_image,
    compose_text,
    ensure_stand_in,
    prometheus_stand_in,
    python_stand_in,
    served_folder,
    torch_wheelhouse,
)

pytestmark = [pytest.mark.stack, pytest.mark.timeout(2400)]

PROJECT = "loraserve-stack-test"  # not the file's own name: a user's stack stays untouched
HEALTHY_WITHIN_SECONDS = 360.0  # the healthcheck's start period (300 s) and its retries
SPAM = "WINNER!! Claim your free prize now, call 09061701461"
HAM = "Are we still meeting for lunch tomorrow?"
# The service's settings, through .env as a user sets them. Every request is accepted and
# queued (no admission by time), and the deadline and the drain are long enough for a busy
# shared machine, where requests in flight at the stop, slowed further by the refusals
# around them, took up to 7.5 s to finish (the drain's default is 10 s; compose's
# stop_grace_period, 30 s, stays longer). The drain must then answer every request sent before
# the stop, none refused or timed out. The disk tier writes every answer, so that a text asked
# once has its answer in the volume that outlives the container.
SERVICE_ENV = (
    "ADMISSION_CONTROL=false\nREQUEST_TIMEOUT_SECONDS=60\nDRAIN_SECONDS=20\n"
    "DISK_CACHE_ADMISSION=every\n"
)
# Asked in the first life of the api container and again after it was replaced.
REMEMBERED = "Your parcel is waiting: confirm delivery at the link, fee 1.99"


@dataclass
class Stack:
    """The running stack: how to reach it, how to drive compose, what was measured."""

    docker: Docker
    project_dir: Path
    ports: dict[str, int]
    image: str  # the api's
    build: Build
    bases: dict[str, str]
    timings: dict[str, float] = field(default_factory=dict)
    first_container: str = ""
    first_log: str = ""
    remembered: dict[str, Any] = field(default_factory=dict)  # its scores and X-Cache
    counts: dict[str, int] = field(default_factory=dict)  # what the drain saw

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['API_PORT']}"

    @property
    def prometheus_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['PROMETHEUS_PORT']}"

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> str:
        """`docker compose ARGS` in the stack's folder, with its ports."""
        result = self.docker.run(
            "compose",
            "--project-name",
            PROJECT,
            *args,
            cwd=self.project_dir,
            env={name: str(port) for name, port in self.ports.items()},
            timeout=timeout,
            check=check,
        )
        return result.stdout.strip()

    def api_container(self) -> str:
        return self.compose("ps", "--all", "--quiet", "api")

    def state(self, container: str) -> dict[str, Any]:
        state: dict[str, Any] = json.loads(
            self.docker("inspect", "--format", "{{json .State}}", container)
        )
        return state

    def logs(self, container: str) -> str:
        result = self.docker.run("logs", container)
        return result.stdout + result.stderr

    def wait_healthy(self) -> list[str]:
        """Polls the api container's health until healthy; returns the states it went through."""
        container = self.api_container()
        seen: list[str] = []
        deadline = time.monotonic() + HEALTHY_WITHIN_SECONDS
        while True:
            state = self.state(container)
            health = state["Health"]["Status"]
            if not seen or seen[-1] != health:
                seen.append(health)
            if health == "healthy":
                return seen
            if state["Status"] != "running" or time.monotonic() > deadline:
                raise AssertionError(f"api {state}:\n{self.logs(container)[-6000:]}")
            time.sleep(0.5)

    def up(self) -> float:
        """`docker compose up -d api prometheus`; the seconds until the api was healthy."""
        started = time.monotonic()
        self.compose("up", "--detach", "api", "prometheus")
        assert self.wait_healthy()[-2:] == ["starting", "healthy"]
        return time.monotonic() - started

    def predict(self, body: dict[str, Any]) -> httpx.Response:
        response = httpx.post(f"{self.api_url}/predict", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response


def project_copy(folder: Path) -> Path:
    """compose.yaml and what it mounts for api and prometheus, byte for byte, and a .env."""
    folder.mkdir()
    (folder / "compose.yaml").write_text(compose_text(), encoding="utf-8")
    shutil.copytree(REPO_ROOT / "docker" / "prometheus", folder / "docker" / "prometheus")
    (folder / ".env").write_text(SERVICE_ENV, encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Stack]:
    scratch = tmp_path_factory.mktemp("stack")
    compose_file = yaml.safe_load(compose_text())
    with docker_engine(scratch / "docker-config") as docker:
        python_image, prometheus_image = base_images()
        bases = {
            image: ensure_stand_in(docker, stand_in)
            for image, stand_in in (
                (python_image, python_stand_in(python_image)),
                (prometheus_image, prometheus_stand_in(prometheus_image)),
            )
        }
        image = compose_file["services"]["api"]["image"]
        with served_folder(torch_wheelhouse()) as wheelhouse_url:
            build = build_image(docker, image, wheelhouse_url)
        stack = Stack(
            docker,
            project_copy(scratch / "project"),
            {"API_PORT": free_port(), "PROMETHEUS_PORT": free_port()},
            image,
            build,
            bases,
        )
        stack.compose("down", "--volumes", "--remove-orphans")  # an interrupted run's leftovers
        try:
            stack.timings["start to healthy (first start: converts the LLM)"] = stack.up()
            stack.first_container = stack.api_container()
            stack.first_log = stack.logs(stack.first_container)
            response = stack.predict({"inputs": REMEMBERED})
            stack.remembered = {"scores": response.json(), "cache": response.headers["X-Cache"]}
            yield stack
        finally:
            stack.compose("down", "--volumes", "--remove-orphans", check=False)
            report(request, stack)


def report(request: pytest.FixtureRequest, stack: Stack) -> None:
    """The measurements, printed past pytest's capture."""
    build = stack.build
    lines = [
        f"image build: {build.seconds:.0f} s ({build.cached_steps} of {build.steps} steps "
        "from the build cache)",
        f"image size: {build.size_bytes / 1e6:.0f} MB",
        *(f"{name}: {seconds:.1f} s" for name, seconds in stack.timings.items()),
        *(f"{name}: {count}" for name, count in stack.counts.items()),
        *(f"base image {image}: {how}" for image, how in stack.bases.items()),
    ]
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line("")
        reporter.write_sep("-", "docker compose stack")
        for line in lines:
            reporter.write_line(line)


# --- the first start -------------------------------------------------------------------------


def test_api_turns_healthy_through_its_own_healthcheck(stack: Stack) -> None:
    # Healthy only once /ready is 200: the check probes /ready, not merely a port.
    container = stack.api_container()
    config = json.loads(stack.docker("inspect", "--format", "{{json .Config}}", container))
    assert "/ready" in " ".join(config["Healthcheck"]["Test"])
    last = stack.state(container)["Health"]["Log"][-1]
    assert last["ExitCode"] == 0, last
    assert httpx.get(f"{stack.api_url}/ready", timeout=10).status_code == 200
    assert "converting" in stack.first_log and "(once)" in stack.first_log, stack.first_log


def test_predict_answers_spam_and_ham_through_the_published_port(
    stack: Stack, tmp_path: Path
) -> None:
    for model in (None, "spam-minilm", "spam-smollm2", "cascade"):
        body = {"inputs": [SPAM, HAM], "cache": False} | ({"model": model} if model else {})
        spam, ham = stack.predict(body).json()
        assert spam[0]["label"] == "spam" and spam[0]["score"] > 0.9, (model, spam)
        assert ham[0]["label"] == "ham" and ham[0]["score"] > 0.9, (model, ham)

    # The same scores as this checkout computes on the host: the image serves the model the
    # models file declares, with the same numbers.
    served = stack.predict({"inputs": [SPAM, HAM], "cache": False}).json()
    [encoder, *_] = load_models_file(REPO_ROOT / "artifacts" / "models.yaml")
    with serving([encoder], tmp_path / "cache", ready_within=120) as client:
        local = client.post("/predict", json={"inputs": [SPAM, HAM], "cache": False}).json()
    for got, expected in zip(served, local, strict=True):
        got_scores = {item["label"]: item["score"] for item in got}
        for item in expected:
            assert got_scores[item["label"]] == pytest.approx(item["score"], abs=1e-5)


def test_prometheus_in_its_container_scrapes_the_api(stack: Stack) -> None:
    targets = httpx.get(f"{stack.prometheus_url}/api/v1/targets", timeout=10).json()
    [target] = targets["data"]["activeTargets"]
    assert target["labels"]["job"] == "loraserve"
    assert target["scrapeUrl"] == "http://api:8000/metrics"  # by its compose name

    stack.predict({"inputs": [SPAM, HAM]})
    total = metric(stack.api_url, "loraserve_predictions_total")

    def query(expr: str) -> list[dict[str, Any]]:
        body = httpx.get(
            f"{stack.prometheus_url}/api/v1/query", params={"query": expr}, timeout=10
        ).json()
        assert body["status"] == "success", (expr, body)
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    deadline = time.monotonic() + 60  # scraped every 5 s
    expr = 'sum(loraserve_predictions_total{job="loraserve"})'
    while [float(series["value"][1]) for series in query(expr)] != [total]:
        assert time.monotonic() < deadline, (query(expr), total)
        time.sleep(1)
    assert query('up{job="loraserve"}')[0]["value"][1] == "1"
    assert query("loraserve_ready")[0]["value"][1] == "1"

    deadline = time.monotonic() + 60  # the alert rules are evaluated every 15 s
    while True:
        groups = httpx.get(f"{stack.prometheus_url}/api/v1/rules", timeout=10).json()
        rules = [rule for group in groups["data"]["groups"] for rule in group["rules"]]
        if rules and all(rule["health"] == "ok" for rule in rules):
            break
        assert time.monotonic() < deadline, rules
        time.sleep(1)
    alerts = {r["name"]: r["state"] for r in rules if r["type"] == "alerting"}  # not recording
    assert alerts["LoraserveDown"] == "inactive"


def test_api_runs_as_a_non_root_user(stack: Stack) -> None:
    status = stack.compose("exec", "api", "cat", "/proc/1/status")
    [uids] = [line.split()[1:] for line in status.splitlines() if line.startswith("Uid:")]
    assert uids == ["10001"] * 4, uids  # real, effective, saved, file system: not root


def test_api_serves_on_jemalloc(stack: Stack) -> None:
    """The image installs it, and loraserve (PID 1, started again on it) has it mapped."""
    maps = stack.compose("exec", "api", "cat", "/proc/1/maps")
    assert "libjemalloc" in maps


def test_image_holds_the_cpu_build_of_torch(stack: Stack) -> None:
    versions = stack.docker(
        "run",
        "--rm",
        "--entrypoint",
        "python",
        stack.image,
        "-c",
        "import torch; print(torch.__version__, torch.version.cuda)",
    )
    assert versions.endswith("+cpu None"), versions


# --- stop under traffic, then up again -------------------------------------------------------


@dataclass(frozen=True)
class Sent:
    started: float
    ended: float
    status: int | str  # the HTTP status, or the transport error's name


def keep_sending(url: str, worker: int, done: threading.Event, sent: list[Sent]) -> None:
    """Requests of 16 new texts back to back, until `done`."""
    with httpx.Client(base_url=url, timeout=60) as client:
        index = 0
        while not done.is_set():
            index += 1
            texts = [f"client {worker} message {index}.{row}: call me back" for row in range(16)]
            started = time.monotonic()
            try:
                status: int | str = client.post(
                    "/predict", json={"inputs": texts, "cache": False}
                ).status_code
            except httpx.TransportError as exc:
                status = type(exc).__name__
            sent.append(Sent(started, time.monotonic(), status))
            if status != 200:
                time.sleep(0.05)  # refused or gone: do not spin


def stop_under_traffic(stack: Stack, timing: str) -> tuple[list[Sent], float]:
    """`docker compose stop api` while four clients keep sending: what they sent, and when
    the stop began; the stop's time in the timings under `timing`."""
    sent: list[Sent] = []
    done = threading.Event()
    clients = [
        threading.Thread(target=keep_sending, args=(stack.api_url, worker, done, sent))
        for worker in range(4)
    ]
    for client in clients:
        client.start()
    try:
        time.sleep(3)
        stopping = time.monotonic()
        stack.compose("stop", "api", timeout=120)
        stack.timings[timing] = time.monotonic() - stopping
    finally:
        done.set()
        for client in clients:
            client.join(timeout=90)
    return sent, stopping


def test_stop_under_traffic_answers_every_accepted_request_and_exits_0(stack: Stack) -> None:
    container = stack.api_container()
    sent, stopping = stop_under_traffic(stack, "docker compose stop under traffic (drain)")
    state = stack.state(container)
    assert state["Status"] == "exited" and not state["OOMKilled"], state
    assert state["ExitCode"] == 0, (state, stack.logs(container)[-4000:])
    log = stack.logs(container)
    drain = re.search(r"drained in ([\d.]+) s", log)  # ended with nothing accepted unanswered
    assert drain, log[-4000:]
    stack.timings["of which the service's drain"] = float(drain[1])
    before = [s for s in sent if s.started < stopping]
    after = [s for s in sent if s.started >= stopping]
    # Sent before the stop, so accepted: answered, also those the stop came in the middle of.
    assert {s.status for s in before} == {200}, before
    drained = [s for s in before if s.ended > stopping]
    assert drained, "no request was in flight when the stop began: nothing was drained"
    # Sent during the stop: answered or refused (503 while draining), or the port had closed.
    assert {s.status for s in after if isinstance(s.status, int)} <= {200, 503}, after
    stack.counts = {
        "in flight when the stop began, answered": len(drained),
        "sent during the stop, refused with 503": sum(s.status == 503 for s in after),
    }


def test_up_again_reuses_the_volumes(stack: Stack) -> None:
    # A new container (not the stopped one restarted): only the named volumes carry over.
    stack.compose("rm", "--stop", "--force", "api")
    stack.timings["start to healthy again (new container, same volumes)"] = stack.up()
    container = stack.api_container()
    assert container != stack.first_container
    log = stack.logs(container)
    assert "converting" not in log, log  # the LLM converted in the first life is read back

    again = stack.predict({"inputs": REMEMBERED})
    assert stack.remembered["cache"] == "lru=0,disk=0,model=1"
    assert again.headers["X-Cache"] == "lru=0,disk=1,model=0"  # the disk cache's volume
    assert again.json() == stack.remembered["scores"]


def test_the_split_from_env_answers_alike_and_stops_with_every_request_answered(
    stack: Stack,
) -> None:
    """SPLIT_FRONT_END=true in .env: the same container serves through a front end of its
    own, answers as one process does, and drains the front end first under traffic."""
    alone = stack.predict({"inputs": SPAM, "cache": False}).json()
    env_file = stack.project_dir / ".env"
    env_file.write_text(SERVICE_ENV + "SPLIT_FRONT_END=true\n", encoding="utf-8")
    try:
        stack.timings["start to healthy, the split (SPLIT_FRONT_END=true)"] = stack.up()
        container = stack.api_container()
        assert "front end started" in stack.logs(container)
        assert stack.predict({"inputs": SPAM, "cache": False}).json() == alone
        metrics = httpx.get(f"{stack.api_url}/metrics", timeout=30).text
        assert "loraserve_front_end_process_cpu_seconds_total" in metrics
        sent, stopping = stop_under_traffic(stack, "the same, the split (both drains)")
    finally:
        env_file.write_text(SERVICE_ENV, encoding="utf-8")
    state = stack.state(container)
    assert state["ExitCode"] == 0, (state, stack.logs(container)[-4000:])
    before = [s for s in sent if s.started < stopping]
    assert before and {s.status for s in before} == {200}, before
