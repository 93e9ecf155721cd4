"""The optional API key: every route but the allow-list needs it; it never leaks."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from api.http.app import create_app
from api.http.middleware.auth import OPEN_PATHS, is_admin_route
from tests.support.app_routes import walk
from tests.support.in_process import make_settings, spec_for
from tests.support.tiny_models import TinyModel

KEY = "s3cret-key-for-tests"
# Bodies for POST routes that do not take /predict's.
BODIES = {
    "/v2/models/tiny/infer": {
        "inputs": [{"name": "input-0", "shape": [1], "datatype": "BYTES", "data": ["win"]}]
    }
}


@pytest.fixture
def client(tiny_bert: TinyModel, tmp_path: object) -> Iterator[TestClient]:
    spec = spec_for(tiny_bert, adapters=("spam",), runtime_adapters=True)
    app = create_app(make_settings(api_key=KEY, disk_cache_max_bytes=0), [spec])
    with TestClient(app) as client:
        while client.get("/ready").status_code != 200:
            time.sleep(0.02)
        yield client


def every_route(client: TestClient) -> list[tuple[str, str]]:
    return [
        (method, route.path)
        for route in walk(client.app.routes)  # type: ignore[attr-defined]
        for method in sorted(route.methods or {"GET"})
        if method != "HEAD"
    ]


def adapter_bodies(tiny: TinyModel) -> dict[str, dict[str, object]]:
    """Bodies that load, then unload, a run-time adapter (the routes are walked in order)."""
    return {
        "/v1/load_lora_adapter": {"lora_name": "extra", "lora_path": str(tiny.adapters["promo"])},
        "/v1/unload_lora_adapter": {"lora_name": "extra"},
    }


def test_every_route_but_the_allow_list_needs_the_key(
    client: TestClient, tiny_bert: TinyModel
) -> None:
    bodies = {**BODIES, **adapter_bodies(tiny_bert)}
    routes = every_route(client)
    assert {path for _, path in routes} >= {
        "/predict",
        "/models",
        "/info",
        "/docs",
        "/openapi.json",
    }
    assert {path for _, path in routes} >= {"/v2", "/v2/models/{name}/infer"}
    for method, template in routes:
        # The served model: its routes answer 200.
        path = template.replace("{name}", "tiny").replace("{model}", "tiny")
        body = bodies.get(path, {"inputs": "win"}) if method == "POST" else None
        without = client.request(method, path, json=body)
        wrong = client.request(method, path, json=body, headers={"Authorization": "Bearer nope"})
        right = client.request(method, path, json=body, headers={"Authorization": f"Bearer {KEY}"})
        if path in OPEN_PATHS:
            assert without.status_code == 200, path
            continue
        if is_admin_route(path, method):  # closed without ADMIN_API_KEY, whatever the key
            for closed in (without, wrong, right):
                assert closed.status_code == 403, (method, path)
                assert "ADMIN_API_KEY" in closed.json()["error"]["message"]
            continue
        for refused in (without, wrong):
            assert refused.status_code == 401, (method, path)
            assert refused.headers["WWW-Authenticate"] == "Bearer"
            assert KEY not in refused.text
            # The Open Inference Protocol's routes answer in its error shape, 401 included.
            shape = str if path.startswith("/v2") else dict
            assert isinstance(refused.json()["error"], shape), (method, path)
        assert right.status_code == 200, (method, path, right.text)


def test_the_admin_key_alone_opens_the_routes_that_change_the_adapters(
    tiny_bert: TinyModel,
) -> None:
    admin = "admin-key-for-tests"
    spec = spec_for(tiny_bert, adapters=("spam",), runtime_adapters=True)
    for api_key in (KEY, None):  # with an API key, and with none (predict open to all)
        settings = make_settings(
            api_key=api_key,
            admin_api_key=admin,
            adapter_roots=[tiny_bert.adapters["promo"].parent],
            disk_cache_max_bytes=0,
        )
        with TestClient(create_app(settings, [spec])) as client:
            while client.get("/ready").status_code != 200:
                time.sleep(0.02)
            as_user = {"Authorization": f"Bearer {KEY}"} if api_key else {}
            as_admin = {"Authorization": f"Bearer {admin}"}
            for path, body in adapter_bodies(tiny_bert).items():
                refused = client.post(path, json=body, headers=as_user)
                assert refused.status_code == 401, (api_key, path)
                assert admin not in refused.text and KEY not in refused.text
                assert client.post(path, json=body, headers=as_admin).status_code == 200, path
            for headers in (as_user, as_admin):  # predict and the listing: either key
                assert client.post("/predict", json={"inputs": "win"}, headers=headers).is_success
                assert client.get("/v1/adapters", headers=headers).is_success


def test_unknown_paths_need_the_key_too(client: TestClient) -> None:
    assert client.get("/admin").status_code == 401


def test_the_key_never_appears_in_logs_metrics_or_errors(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    headers = {"Authorization": f"Bearer {KEY}"}
    client.post("/predict", json={"inputs": []}, headers=headers)
    client.post("/predict", json={"inputs": "x", "model": "nope"}, headers=headers)
    client.post("/predict", json={"inputs": "x"}, headers={"Authorization": f"Bearer {KEY}x"})
    metrics = client.get("/metrics").text
    assert KEY not in metrics and KEY not in caplog.text
    assert KEY not in client.get("/info", headers=headers).text


def test_no_key_configured_means_open_routes(tiny_bert: TinyModel) -> None:
    app = create_app(make_settings(disk_cache_max_bytes=0), [spec_for(tiny_bert)])
    with TestClient(app) as client:
        assert client.get("/info").status_code == 200
