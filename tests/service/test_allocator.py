"""The serving process runs on jemalloc where it is installed (the same process, started
again with it preloaded), and on the system's allocator when MEMORY_ALLOCATOR says so."""

from __future__ import annotations

import ctypes.util
from pathlib import Path

import httpx
import pytest

from tests.support.server_process import run_server
from tests.support.tiny_models import TinyModel, tiny_models_file


def mapped_libraries(pid: int) -> str:
    """The files mapped into the process: every shared library it has loaded."""
    return Path(f"/proc/{pid}/maps").read_text(encoding="utf-8")


@pytest.mark.skipif(
    ctypes.util.find_library("jemalloc") is None,
    reason="no jemalloc installed (make test installs it with redis-server: libjemalloc2)",
)
def test_the_server_process_serves_on_jemalloc(tiny_bert: TinyModel, tmp_path: Path) -> None:
    models = tiny_models_file(tmp_path, tiny_bert)
    with run_server({"MODELS_FILE": str(models)}, tmp_path) as server:
        server.wait_ready()
        # The same process (its supervisor's pid) answers, now with jemalloc loaded.
        assert "jemalloc" in mapped_libraries(server.process.pid)
        response = httpx.post(f"{server.url}/predict", json={"inputs": "win a prize"})
        assert response.status_code == 200, response.text
        assert server.stop() == 0


def test_the_system_allocator_when_asked(tiny_bert: TinyModel, tmp_path: Path) -> None:
    models = tiny_models_file(tmp_path, tiny_bert)
    env = {"MODELS_FILE": str(models), "MEMORY_ALLOCATOR": "system"}
    with run_server(env, tmp_path) as server:
        server.wait_ready()
        assert "jemalloc" not in mapped_libraries(server.process.pid)
        assert server.stop() == 0
