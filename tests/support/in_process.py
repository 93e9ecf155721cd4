"""The app in process for tests: settings that ignore the developer's .env, model specs for the
tiny models, polling, and the real app serving them through TestClient."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from fastapi.testclient import TestClient

from api.http.app import create_app
from api.models.spec import AdapterSpec, ModelSpec
from api.settings import Settings
from tests.support.tiny_models import LABELS, TinyModel

SETTING_NAMES = {name.upper() for name in Settings.model_fields}
# In-process loads convert and pre-quantize into a folder of the test session, not into the
# user's ~/.cache (server processes, started with the environment, still use the default).
# tests/conftest.py sets it when the session starts.
SESSION_FOLDERS: dict[str, Path] = {}


def make_settings(**overrides: object) -> Settings:
    """Settings from defaults and the given values only (the model cache: the session's)."""
    values = {**SESSION_FOLDERS, **overrides}
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]


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


def wait_for(condition: Callable[[], bool], seconds: float, what: str) -> None:
    """Polls `condition` until true; fails naming `what` after `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"not within {seconds} s: {what}"
        time.sleep(0.05)


def wait_ready(client: TestClient, timeout: float = 60.0) -> None:
    """Polls /ready until 200, failing with its body after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while client.get("/ready").status_code != 200:
        assert time.monotonic() < deadline, client.get("/ready").json()
        time.sleep(0.02)


@contextmanager
def serving(
    specs: list[ModelSpec], cache_dir: Path, ready_within: float = 60.0, **settings: object
) -> Iterator[TestClient]:
    """The real app serving `specs`, its disk cache in `cache_dir`, once ready (which must
    take less than `ready_within` seconds)."""
    app = create_app(make_settings(disk_cache_dir=cache_dir, **settings), specs)
    with TestClient(app) as client:
        wait_ready(client, ready_within)
        yield client
