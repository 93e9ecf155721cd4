"""/metrics: the names dashboards use, and values that follow the traffic."""

from __future__ import annotations

import time
from pathlib import Path

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from api.http.app import create_app
from api.metrics import DASHBOARD_METRICS, GPU_METRICS
from tests.support.in_process import make_settings, spec_for, wait_for
from tests.support.tiny_models import TinyModel


def samples(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}"] = sample.value
    return values


def total(values: dict[str, float], name: str, **labels: str) -> float:
    wanted = [f"{k}={v}" for k, v in labels.items()]
    return sum(
        value
        for key, value in values.items()
        if key.split("{")[0] == name and all(w in key for w in wanted)
    )


def test_metrics_expose_every_dashboard_name_after_traffic(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    # A candidate in shadow beside the default, so that the rollout's series fill too.
    candidate = {"adapter": "promo", "mode": "shadow", "share": 1.0}
    spec = spec_for(tiny_bert, candidate=candidate)
    app = create_app(make_settings(disk_cache_dir=tmp_path / "cache"), [spec])
    with TestClient(app) as client:
        while client.get("/ready").status_code != 200:
            time.sleep(0.02)
        client.post("/predict", json={"inputs": ["win a prize", "lunch"]})
        client.post("/predict", json={"inputs": ["win a prize"], "adapter": "promo"})
        client.post("/predict", json={"inputs": "win a prize"})  # an LRU hit
        client.post("/predict", json={"inputs": []})  # a rejection
        # The shadow's comparisons come after the answers: three texts of the default's.
        wait_for(
            lambda: client.get("/v1/adapters/tiny/candidate").json()["candidate"]["texts"] == 3,
            10,
            "the shadow's comparisons",
        )
        response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    values = samples(response.text)
    names = {key.split("{")[0] for key in values}
    missing = [name for name in DASHBOARD_METRICS if name not in names]
    assert not missing, missing
    assert not any(name in names for name in GPU_METRICS)  # no CUDA here: absent, not zero

    assert total(values, "loraserve_predictions_total") == 4
    assert total(values, "loraserve_requests_total", route="/predict", status="200") == 3
    assert total(values, "loraserve_rejections_total", reason="invalid") == 1
    assert total(values, "loraserve_cache_lookups_total", tier="lru", result="hit") == 1
    assert total(values, "loraserve_batch_size_count", model="tiny") >= 2
    assert total(values, "loraserve_model_load_seconds", phase="weights") > 0
    assert total(values, "loraserve_ready") == 1
    assert total(values, "loraserve_latency_target_seconds") == 2.0
    assert total(values, "loraserve_model_info", adapter="promo", quantization="none") == 1
    assert total(values, "process_resident_memory_bytes") > 10_000_000
    assert total(values, "loraserve_candidate_texts_total", candidate="promo") == 3
    assert total(values, "loraserve_answer_labels_total", adapter="spam") == 3
    assert total(values, "loraserve_answer_labels_total", adapter="promo") == 1
    assert total(values, "loraserve_answer_positive_score_count") == 4
