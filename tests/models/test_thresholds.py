"""Decision and cascade thresholds: read from the models file, applied to the answers, shown
by /info; and the embedded models file holds the thresholds its training runs chose."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from fastapi.testclient import TestClient
from peft import PeftModel
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from api.http.app import create_app
from api.models.spec import EMBEDDED_MODELS_FILE, ModelSpec
from tests.support.in_process import make_settings, spec_for, wait_ready
from tests.support.tiny_models import LABELS, TinyModel, spam_entry, write_models_file

TEXTS = ["win a free prize now call", "are we still meeting for lunch tomorrow", "ok", "txt stop"]


def info_and_scores(models_file: Path, **settings: object) -> tuple[dict, list]:  # type: ignore[type-arg]
    """/info and the first model's answers to TEXTS, from the app serving `models_file`."""
    app = create_app(make_settings(models_file=models_file, disk_cache_max_bytes=0, **settings))
    with TestClient(app) as client:
        wait_ready(client)
        info = client.get("/info").json()
        scores = client.post("/predict", json={"inputs": TEXTS, "cache": False}).json()
        models = client.get("/models").json()["models"]
    info["digest"] = models[0]["identities"][0]["digest"]
    return info, scores


def reference_spam_probability(tiny: TinyModel) -> list[float]:
    """P(second label) of TEXTS from transformers and peft directly, not the service."""
    tokenizer = AutoTokenizer.from_pretrained(tiny.base)
    base = AutoModelForSequenceClassification.from_pretrained(tiny.base, num_labels=len(LABELS))
    model = PeftModel.from_pretrained(base, str(tiny.adapters["spam"])).eval()
    with torch.no_grad():
        rows = [
            tokenizer(text, truncation=True, max_length=32, return_tensors="pt") for text in TEXTS
        ]
        return [float(torch.softmax(model(**row).logits[0], dim=-1)[1]) for row in rows]


def score_of(answer: list[dict[str, object]], label: str) -> float:
    return next(float(item["score"]) for item in answer if item["label"] == label)  # type: ignore[arg-type]


def test_thresholds_go_from_the_models_file_to_info_and_the_answers(
    tiny_bert: TinyModel, tiny_llama: TinyModel, tmp_path: Path
) -> None:
    reference = reference_spam_probability(tiny_bert)
    # A threshold between the texts' own probabilities: some answers must change sides.
    ordered = sorted(reference)
    threshold = round((ordered[1] + ordered[2]) / 2, 6)
    plain = write_models_file(
        tmp_path / "plain.yaml", [spam_entry(tiny_bert, "cheap"), spam_entry(tiny_llama, "big")]
    )
    chosen = write_models_file(
        tmp_path / "chosen.yaml",
        [
            spam_entry(tiny_bert, "cheap", decision_threshold=threshold, cascade_threshold=0.8),
            spam_entry(tiny_llama, "big"),
        ],
    )
    info, unshifted = info_and_scores(plain)
    assert info["decision_thresholds"] == {"cheap": None, "big": None}
    assert info["cascade"] == {
        "first": "cheap",
        "second": "big",
        "threshold": 0.9,
        "threshold_source": "fallback",
    }
    info_chosen, shifted = info_and_scores(chosen)
    assert info_chosen["decision_thresholds"] == {"cheap": threshold, "big": None}
    assert info_chosen["cascade"]["threshold"] == 0.8
    assert info_chosen["cascade"]["threshold_source"] == "models file"
    # Other scores are other answers: the cache must not hand one for the other.
    assert info_chosen["digest"] != info["digest"]

    offset = math.log(threshold / (1 - threshold))
    labels = LABELS[1]
    for p, before, after in zip(reference, unshifted, shifted, strict=True):
        assert score_of(before, labels) == pytest.approx(p, abs=1e-5)
        expected = 1 / (1 + math.exp(-(math.log(p / (1 - p)) - offset)))
        assert score_of(after, labels) == pytest.approx(expected, abs=1e-5)
        assert after[0]["label"] == (labels if p > threshold else LABELS[0])
    assert sum(p > threshold for p in reference) != sum(p > 0.5 for p in reference)

    overridden, _ = info_and_scores(chosen, cascade_threshold=0.7)
    assert overridden["cascade"]["threshold"] == 0.7
    assert overridden["cascade"]["threshold_source"] == "CASCADE_THRESHOLD"


def test_a_decision_threshold_needs_two_labels(tiny_bert: TinyModel) -> None:
    with pytest.raises(ValueError, match="two labels"):
        spec_for(tiny_bert, labels=["ham", "spam", "promo"], decision_threshold=0.7)
    for outside in (0.0, 1.0):
        with pytest.raises(ValueError, match="decision_threshold"):
            spec_for(tiny_bert, decision_threshold=outside)
    with pytest.raises(ValueError, match="cascade_threshold"):
        spec_for(tiny_bert, cascade_threshold=0.4)


def test_the_embedded_models_file_holds_what_the_training_runs_chose() -> None:
    declared = {
        m["name"]: ModelSpec.model_validate(m)
        for m in yaml.safe_load(EMBEDDED_MODELS_FILE.read_text(encoding="utf-8"))["models"]
    }
    for name, model in declared.items():
        report = json.loads((EMBEDDED_MODELS_FILE.parent / name / "eval.json").read_text())
        assert model.adapters[0].sha256 == report["adapter"]["sha256"], name
        # A model scored before thresholds were chosen was served, and is, at the argmax.
        chosen = report.get("evaluation", {}).get("decision_threshold", {}).get("threshold")
        assert model.decision_threshold == chosen, name
    llm = json.loads((EMBEDDED_MODELS_FILE.parent / "spam-smollm2" / "eval.json").read_text())
    encoder = declared["spam-minilm"]
    assert encoder.cascade_threshold == round(llm["cascade"]["threshold"], 6)
