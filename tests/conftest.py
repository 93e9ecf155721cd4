"""Shared fixtures: tiny real checkpoints on disk, settings that ignore the developer's .env."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from api.cli import quiet_libraries
from api.models.spec import AdapterSpec, ModelSpec
from api.settings import Settings
from tests.tiny_models import LABELS, TinyModel, build_tiny

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
        if key.endswith("_ADAPTER_DIR") or key in SETTING_NAMES:
            monkeypatch.delenv(key)
    yield


SETTING_NAMES = {name.upper() for name in Settings.model_fields}


def make_settings(**overrides: object) -> Settings:
    """Settings from defaults and the given values only."""
    return Settings(_env_file=None, **overrides)  # type: ignore[call-arg]


def spec_for(
    tiny: TinyModel,
    name: str = "tiny",
    adapters: tuple[str, ...] = ("spam", "promo"),
    **fields: object,
) -> ModelSpec:
    """A model spec serving a tiny model with the named adapters."""
    values: dict[str, object] = {
        "name": name,
        "base": str(tiny.base),
        "labels": LABELS,
        "max_length": 32,
        "adapters": [AdapterSpec(name=a, path=tiny.adapters[a], sha256=None) for a in adapters],
    }
    values.update(fields)
    return ModelSpec.model_validate(values)
