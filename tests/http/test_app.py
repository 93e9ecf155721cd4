"""The real app (lifespan included) serving tiny real models through TestClient."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
from fastapi import FastAPI, Request, Response
from fastapi.testclient import TestClient
from starlette.types import Message, Receive, Scope, Send

from api.http.app import create_app
from api.http.middleware.observer import RequestObserver
from api.http.routes.common import OwnBodyRoute
from api.models.loader import PHASES
from api.service.contract import Phase
from api.service.core import Service
from tests.support.in_process import make_settings, spec_for, wait_ready
from tests.support.tiny_models import TinyModel


@pytest.fixture
def app(tiny_bert: TinyModel, tiny_llama: TinyModel) -> FastAPI:
    specs = [spec_for(tiny_bert, name="bert"), spec_for(tiny_llama, name="llama")]
    return create_app(make_settings(max_texts_per_request=4, max_text_chars=200), specs)


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app) as client:
        wait_ready(client)
        yield client


def test_ready_is_503_with_progress_before_models_load(app: FastAPI) -> None:
    client = TestClient(app)  # no `with`: the lifespan has not started, nothing is loaded
    response = client.get("/ready")
    assert response.status_code == 503
    assert response.headers["Retry-After"]
    body = response.json()
    assert body["status"] == "loading" and body["loaded"] == 0 and body["total"] == 2
    assert body["models"]["bert"]["state"] == "waiting"
    predict = client.post("/predict", json={"inputs": "hi"})
    assert predict.status_code == 503 and predict.headers["Retry-After"]


def test_ready_after_load_lists_both_models(client: TestClient) -> None:
    body = client.get("/ready").json()
    assert body["status"] == "ready" and body["loaded"] == body["total"] == 2
    models = client.get("/models").json()["models"]
    assert [m["name"] for m in models] == ["bert", "llama"]
    for model in models:
        assert model["adapters"] == ["spam", "promo"] and model["adapter_mode"] == "unmerged"
        assert set(model["load_seconds"]) == set(PHASES)
        assert model["load_seconds"]["warmup"] > 0
    bert, llama = models
    # The encoder runs packed, so it needs no cost model; the decoder is padded and has one,
    # measured at warm-up (tiny models cost almost nothing per token, so the measured slope
    # may be none: then no limit); tests/models/test_loader.py checks the arithmetic.
    assert bert["packed_batches"] and bert["batch_overhead_tokens"] is None
    assert not bert["cuda_graphs"] and not llama["cuda_graphs"]  # CUDA_GRAPHS is for GPUs
    assert not llama["packed_batches"]
    assert llama["batch_overhead_tokens"] is None or llama["batch_overhead_tokens"] >= 0


def test_batch_overhead_setting_reaches_models_and_batchers(
    tiny_bert: TinyModel,
) -> None:
    settings = make_settings(batch_overhead_tokens=12.5, pack_batches=False)
    app = create_app(settings, [spec_for(tiny_bert)])
    with TestClient(app) as client:
        wait_ready(client)
        (model,) = client.get("/models").json()["models"]
        assert model["batch_overhead_tokens"] == 12.5 and not model["packed_batches"]
        (runner,) = app.state.service.runners.values()
        assert runner.batcher.limits.overhead_tokens == 12.5
        assert not runner.batcher.limits.packed


def test_predict_one_text_answers_a_ranked_label_list(client: TestClient) -> None:
    response = client.post("/predict", json={"inputs": "win a free prize"})
    assert response.status_code == 200
    body = response.json()
    assert {item["label"] for item in body} == {"ham", "spam"}
    assert body[0]["score"] >= body[1]["score"]
    assert sum(item["score"] for item in body) == pytest.approx(1.0, abs=1e-5)
    assert response.headers["X-Model"] == "bert" and response.headers["X-Adapter"] == "spam"


def test_predict_batch_model_adapter_top_k_and_raw_scores(client: TestClient) -> None:
    body = {"inputs": ["win a free prize", "lunch tomorrow"], "model": "llama"}
    spam = client.post("/predict", json={**body, "adapter": "spam"}).json()
    promo = client.post("/predict", json={**body, "adapter": "promo"}).json()
    assert len(spam) == 2 and all(len(row) == 2 for row in spam)
    assert spam != promo
    top = client.post("/predict", json={**body, "top_k": 1}).json()
    assert all(len(row) == 1 for row in top)
    raw = client.post("/predict", json={**body, "raw_scores": True}).json()
    assert any(item["score"] < 0 or item["score"] > 1 for row in raw for item in row)


@pytest.mark.parametrize(
    ("payload", "status", "fragment"),
    [
        ({"inputs": []}, 422, "inputs"),
        ({"inputs": 5}, 422, "inputs"),
        ({"inputs": ["ok", 5]}, 422, "inputs"),
        ({"inputs": "x", "truncate": "yes"}, 422, "truncate"),
        ({"inputs": ["a"] * 5}, 422, "at most 4"),
        ({"inputs": "x" * 201}, 422, "at most 200"),
        ({"inputs": "\ud800"}, 422, "lone surrogate"),
        ({"inputs": "x", "model": "nope"}, 404, "model 'nope'"),
        ({"inputs": "x", "adapter": "nope"}, 404, "adapter 'nope'"),
        ({"inputs": "win " * 40, "truncate": False}, 422, "over the model's limit"),
        ({"text": "x"}, 422, "inputs"),
    ],
)
def test_bad_input_gets_a_clear_small_error(
    client: TestClient, payload: dict[str, object], status: int, fragment: str
) -> None:
    # json.dumps escapes a lone surrogate as "\\ud800", as a client's JSON would carry it.
    response = client.post(
        "/predict", content=json.dumps(payload), headers={"content-type": "application/json"}
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert fragment in error["message"]
    assert len(response.content) < 500


def test_error_body_never_echoes_a_large_input(client: TestClient) -> None:
    response = client.post("/predict", json={"inputs": 12345, "model": "x" * 100_000})
    assert response.status_code == 422
    assert len(response.content) < 500


def test_invalid_utf8_body_is_a_client_error(client: TestClient) -> None:
    response = client.post(
        "/predict", content=b'{"inputs": "\xff\xfe"}', headers={"content-type": "application/json"}
    )
    assert response.status_code in (400, 422)


def test_body_over_the_byte_limit_is_413_also_when_chunked(
    tiny_bert: TinyModel,
) -> None:
    app = create_app(make_settings(max_body_bytes=2048), [spec_for(tiny_bert)])
    with TestClient(app) as client:
        wait_ready(client)
        big = b'{"inputs": "' + b"a" * 4096 + b'"}'
        assert client.post("/predict", content=big).status_code == 413

        def chunks() -> Iterator[bytes]:
            for start in range(0, len(big), 512):
                yield big[start : start + 512]

        response = client.post(
            "/predict", content=chunks(), headers={"content-type": "application/json"}
        )
        assert response.status_code == 413
        assert client.post("/predict", json={"inputs": "ok"}).status_code == 200


def test_health_info_and_openapi(client: TestClient) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    info = client.get("/info").json()
    assert info["models"] == ["bert", "llama"] and info["max_texts_per_request"] == 4
    schema = client.get("/openapi.json").json()
    assert {"/predict", "/models", "/ready", "/health", "/info"} <= set(schema["paths"])
    assert client.get("/docs").status_code == 200


def test_a_model_that_fails_to_load_fails_the_service(tiny_bert: TinyModel) -> None:
    failures: list[BaseException] = []
    spec = spec_for(tiny_bert, adapters=())  # no adapter: its head would be random
    app = create_app(make_settings(), [spec], on_fatal=failures.append)
    with TestClient(app) as client:
        deadline = time.monotonic() + 30
        while not failures and time.monotonic() < deadline:
            time.sleep(0.02)
        response = client.get("/ready")
    assert failures and "head would be random" in str(failures[0])
    assert response.status_code == 503 and response.json()["status"] == "failed"


@pytest.mark.parametrize("phase", list(Phase))
async def test_the_drain_waits_only_for_requests_accepted_before_it(
    phase: Phase, tiny_bert: TinyModel
) -> None:
    """A request arriving while the service drains (or has failed) is refused at once; were it
    counted, clients retrying through the drain would hold it open until DRAIN_SECONDS."""
    state = Service(make_settings(), [spec_for(tiny_bert)])  # not started: nothing loads
    state.phase = phase
    counted: list[int] = []

    async def route(scope: Scope, receive: Receive, send: Send) -> None:
        counted.append(state.in_flight)
        await send({"type": "http.response.start", "status": 503, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        pass

    scope = {"type": "http", "method": "POST", "path": "/predict", "headers": []}
    await RequestObserver(route, state)(scope, receive, send)
    assert counted == [0 if phase in (Phase.DRAINING, Phase.FAILED) else 1]
    assert state.in_flight == 0


def test_a_route_that_reads_its_own_body_takes_the_request_alone() -> None:
    """OwnBodyRoute skips FastAPI's request handler, which is what would fill any other
    parameter: an endpoint with one would be called without it, so it is refused up front."""

    async def alone(request: Request) -> Response:
        return Response()

    async def with_a_query(request: Request, page: int = 1) -> Response:
        return Response()

    assert OwnBodyRoute("/alone", alone, methods=["POST"]).get_route_handler() is alone
    with pytest.raises(TypeError, match="takes `request` alone"):
        OwnBodyRoute("/query", with_a_query, methods=["POST"])
