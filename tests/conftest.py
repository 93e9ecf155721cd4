"""Shared fixtures: tiny real checkpoints on disk, settings that ignore the developer's .env.
The helpers tests import are in tests/support (settings, specs, the app: in_process)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from api.observability.logs import quiet_libraries
from tests.support.in_process import SESSION_FOLDERS, SETTING_NAMES
from tests.support.redis_server import RedisServer
from tests.support.tiny_models import TinyModel, build_tiny

quiet_libraries()


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return build_tiny(tmp_path_factory.mktemp("tiny"), "bert")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return build_tiny(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """Each test starts from no settings: no .env from the checkout, no seed variables."""
    monkeypatch.chdir(tmp_path)
    for key in list(os.environ):
        # OTEL_*: a developer's tracing setup would send the test servers' spans to it.
        if key.endswith("_ADAPTER_DIR") or key in SETTING_NAMES or key.startswith("OTEL_"):
            monkeypatch.delenv(key)
    yield


@pytest.fixture(autouse=True, scope="session")
def _session_model_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    SESSION_FOLDERS["model_cache_dir"] = tmp_path_factory.mktemp("model-cache")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port, killed after the test."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.kill()  # SIGKILL ends it even while frozen
