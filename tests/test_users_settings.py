"""The users' own `.env`, written for their existing loader, starts the service: their names
(USE_SAFETENSORS, LOW_CPU_MEM_USAGE, MAX_MEMORY_GB, HF_HOME, TRANSFORMERS_CACHE,
EXAONE_ADAPTER_DIR, KOELECTRA_ADAPTER_DIR) each do what they say, or start-up fails naming
the setting."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.http.app import create_app
from api.models.spec import ModelsFileError
from api.settings import load_settings
from tests.support.in_process import wait_ready
from tests.support.tiny_models import LABELS, TinyModel, write_models_file

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache_with(base: Path, cache: Path, repo: str) -> Path:
    """`cache` laid out as huggingface_hub's cache holding `repo` at COMMIT (refs/main)."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    shutil.copytree(base, folder / "snapshots" / COMMIT)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(COMMIT, encoding="utf-8")
    return cache


def users_env(tmp_path: Path, tiny_bert: TinyModel, tiny_llama: TinyModel, **extra: str) -> None:
    """Their deployment: a models file with `exaone` (a hub id) and `koelectra`, and `.env`."""
    models = write_models_file(
        tmp_path / "models.yaml",
        [
            {"name": "exaone", "base": "lgai/tiny-exaone", "labels": LABELS, "max_length": 32},
            {"name": "koelectra", "base": str(tiny_bert.base), "labels": LABELS, "max_length": 32},
        ],
    )
    hub_cache_with(tiny_llama.base, tmp_path / "transformers-cache", "lgai/tiny-exaone")
    values = {
        "MODELS_FILE": str(models),
        "USE_SAFETENSORS": "true",
        "LOW_CPU_MEM_USAGE": "true",
        "MAX_MEMORY_GB": "14",
        "HF_HOME": str(tmp_path / "hf-home"),
        "TRANSFORMERS_CACHE": str(tmp_path / "transformers-cache"),
        "EXAONE_ADAPTER_DIR": str(tiny_llama.adapters["spam"]),
        "KOELECTRA_ADAPTER_DIR": str(tiny_bert.adapters["promo"]),
        "DISK_CACHE_DIR": str(tmp_path / "predictions"),
        **extra,
    }
    lines = [f"{name}={value}" for name, value in values.items()]
    # The autouse fixture runs each test in its own tmp_path: this is the cwd's `.env`.
    (tmp_path / ".env").write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_the_users_dotenv_starts_the_service(
    tiny_bert: TinyModel,
    tiny_llama: TinyModel,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    users_env(tmp_path, tiny_bert, tiny_llama)
    with caplog.at_level(logging.WARNING):
        app = create_app(load_settings())
    assert "TRANSFORMERS_CACHE is deprecated" in caplog.text
    with TestClient(app) as client:
        wait_ready(client)
        models = {m["name"]: m for m in client.get("/models").json()["models"]}
        info = client.get("/info").json()
        answer = client.post("/predict", json={"inputs": "win a prize", "model": "exaone"})
    # The hub id resolved from TRANSFORMERS_CACHE (HF_HOME holds nothing), at its commit.
    assert models["exaone"]["revision"] == COMMIT
    # Neither declares an adapter: each gets one named "default", read from its *_ADAPTER_DIR.
    assert models["exaone"]["adapters"] == models["koelectra"]["adapters"] == ["default"]
    assert answer.status_code == 200
    assert info["low_cpu_mem_usage"] is True
    assert "always builds a model empty" in info["low_cpu_mem_usage_effect"]


def test_without_transformers_cache_the_hub_id_is_looked_up_under_hf_home(
    tiny_bert: TinyModel, tiny_llama: TinyModel, tmp_path: Path
) -> None:
    users_env(tmp_path, tiny_bert, tiny_llama, TRANSFORMERS_CACHE="")
    settings = load_settings()
    assert settings.hub_cache == tmp_path / "hf-home" / "hub"
    with TestClient(create_app(settings)) as client:
        deadline = time.monotonic() + 30
        while (ready := client.get("/ready").json())["status"] == "loading":
            assert time.monotonic() < deadline
            time.sleep(0.02)
    # Named: the model, the hub id, and where it was looked for.
    assert ready["status"] == "failed"
    assert "'exaone'" in ready["error"] and "lgai/tiny-exaone" in ready["error"]
    assert str(tmp_path / "hf-home" / "hub") in ready["error"]


def test_an_adapter_dir_for_a_model_not_declared_fails_naming_it(
    tiny_bert: TinyModel, tiny_llama: TinyModel, tmp_path: Path
) -> None:
    users_env(tmp_path, tiny_bert, tiny_llama, EXAONE4_ADAPTER_DIR=str(tmp_path))
    with pytest.raises(ModelsFileError, match="EXAONE4_ADAPTER_DIR"):
        create_app(load_settings())
