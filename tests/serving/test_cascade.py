"""The confidence cascade on tiny models: only unsure texts reach the second model."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from fastapi.testclient import TestClient

from api.http.app import create_app
from api.serving.cascade import CascadeError, cascade_models
from tests.support.in_process import make_settings, spec_for
from tests.support.tiny_models import TinyModel

TEXTS = ["win a free prize now call", "are we still meeting for lunch tomorrow", "ok", "txt stop"]


@contextmanager
def serving(tiny_bert: TinyModel, tiny_llama: TinyModel, threshold: float) -> Iterator[TestClient]:
    specs = [
        spec_for(tiny_bert, name="cheap", adapters=("spam",)),
        spec_for(tiny_llama, name="big", adapters=("spam",)),
    ]
    settings = make_settings(cascade_threshold=threshold, disk_cache_max_bytes=0)
    with TestClient(create_app(settings, specs)) as client:
        while client.get("/ready").status_code != 200:
            time.sleep(0.02)
        yield client


def top(row: list[dict[str, object]]) -> float:
    return float(row[0]["score"])  # type: ignore[arg-type]


def test_cascade_sends_only_unsure_texts_to_the_second_model(
    tiny_bert: TinyModel, tiny_llama: TinyModel
) -> None:
    with serving(tiny_bert, tiny_llama, threshold=0.5) as client:
        cheap = client.post("/predict", json={"inputs": TEXTS, "model": "cheap"}).json()
        big = client.post("/predict", json={"inputs": TEXTS, "model": "big"}).json()
    # A threshold between the cheap model's answers, so some texts are sure and some not.
    threshold = sorted(top(row) for row in cheap)[len(TEXTS) // 2]
    with serving(tiny_bert, tiny_llama, threshold) as client:
        response = client.post("/predict", json={"inputs": TEXTS, "model": "cascade"})
        metrics = client.get("/metrics").text
    unsure = [top(row) < threshold for row in cheap]
    assert any(unsure) and not all(unsure), [top(row) for row in cheap]
    answered_by = response.headers["X-Answered-By"].split(",")
    assert answered_by == ["big" if u else "cheap" for u in unsure]
    assert response.headers["X-Model"] == "cascade"
    expected = [b if u else c for u, b, c in zip(unsure, big, cheap, strict=True)]
    for got, want in zip(response.json(), expected, strict=True):  # batches differ: ~1e-6
        assert [item["label"] for item in got] == [item["label"] for item in want]
        assert [item["score"] for item in got] == pytest.approx(
            [item["score"] for item in want], abs=1e-4
        )
    assert f"loraserve_cascade_escalations_total {float(sum(unsure))}" in metrics


@pytest.mark.parametrize(("threshold", "escalated"), [(0.5, 0), (1.0, len(TEXTS))])
def test_threshold_comes_from_settings(
    tiny_bert: TinyModel, tiny_llama: TinyModel, threshold: float, escalated: int
) -> None:
    with serving(tiny_bert, tiny_llama, threshold) as client:
        response = client.post("/predict", json={"inputs": TEXTS, "model": "cascade"})
    assert response.headers["X-Answered-By"].split(",").count("big") == escalated


def test_cascade_refuses_an_adapter_and_needs_two_models(
    tiny_bert: TinyModel, tiny_llama: TinyModel
) -> None:
    with serving(tiny_bert, tiny_llama, threshold=0.9) as client:
        refused = client.post(
            "/predict", json={"inputs": "x", "model": "cascade", "adapter": "spam"}
        )
    assert refused.status_code == 422
    one = [spec_for(tiny_bert, name="cheap", adapters=("spam",))]
    assert cascade_models(make_settings(), one) is None
    with pytest.raises(CascadeError, match="CASCADE_SECOND_MODEL"):
        cascade_models(make_settings(cascade_second_model="nope"), one)
