"""The embedded default's languages: its encoder (as `make serve` serves it, from the embedded
models file) refuses Korean texts, ordinary and smishing, with the error that names them,
in every door; English and Taglish SMS are answered as by the same model declaring no
languages, to the bit."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from api.batch.local import LocalSource, started_service
from api.batch.scoring import Outcome, Target, score_rows
from api.http.app import create_app
from api.models.spec import load_models_file
from api.service.contract import ClassifyRequest
from api.serving.errors import OtherLanguage
from scripts.spam_data import every_text
from tests.support.in_process import make_settings, wait_ready
from tests.support.tiny_models import embedded_encoder_file

ROOT = Path(__file__).parents[2]
KOREAN = ROOT / "tests" / "data" / "korean_sms.tsv"
ENGLISH_SAMPLE_EVERY = 19  # about 400 of the 7,559 texts of data/: the test stays short


def korean_texts() -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {"ham": [], "spam": []}
    for line in KOREAN.read_text(encoding="utf-8").splitlines():
        label, text = line.split("\t", 1)
        groups[label].append(text)
    return groups


def english_sample() -> list[str]:
    return every_text()[::ENGLISH_SAMPLE_EVERY]


def test_korean_texts_are_refused_by_the_embedded_encoder_in_every_door(tmp_path: Path) -> None:
    models_file = embedded_encoder_file(tmp_path)
    app = create_app(make_settings(models_file=models_file, disk_cache_max_bytes=0))
    with TestClient(app) as client:
        wait_ready(client, 120)
        listed = client.get("/models").json()["models"][0]
        assert listed["languages"] == ["en", "tl"] and listed["on_other_language"] == "refuse"
        for label, texts in korean_texts().items():
            refused = 0
            for text in texts:
                response = client.post("/predict", json={"inputs": text})
                error = response.json().get("error") if response.status_code == 422 else None
                if error is not None and error["code"] == "other_language":
                    assert error["message"].startswith("inputs[0] is in ko")
                    assert "model 'spam-minilm' reads en, tl" in error["message"]
                    refused += 1
            assert refused >= 0.95 * len(texts), (label, refused, len(texts))
        # The Inference API's shape and OIP's carry the same refusal.
        mixed = ["Are we still meeting for lunch tomorrow?", "내일 회의 3시로 변경되었습니다"]
        response = client.post("/", json={"inputs": mixed, "parameters": {}})
        assert response.status_code == 422
        assert response.json()["error"]["message"].startswith("inputs[1] is in ko")
        tensor = {"name": "input-0", "datatype": "BYTES", "shape": [2], "data": mixed}
        response = client.post("/v2/models/spam-minilm/infer", json={"inputs": [tensor]})
        assert response.status_code == 422
        assert response.json()["error"].startswith("inputs[1] is in ko")
        # Texts without letters are never refused: URL-only and number-only spam is common.
        for text in ["http://bit.ly/3kR9xT", "010-1234-5678", "😀🎉", "!!!"]:
            assert client.post("/predict", json={"inputs": text}).status_code == 200, text


async def scored(source: LocalSource, rows: list[str]) -> list[Outcome]:
    """The rows' outcomes as `loraserve score` gets them: a refused row an error row."""

    async def score(batch: list[str]) -> list[Outcome]:
        return await source.score(Target(), batch, True)

    return await score_rows(score, rows)


async def test_english_sms_are_answered_as_without_languages_to_the_bit(tmp_path: Path) -> None:
    settings = make_settings(disk_cache_max_bytes=0, admission_control=False)
    declared = load_models_file(embedded_encoder_file(tmp_path))
    assert declared[0].languages == ["en", "tl"]
    undeclared = [declared[0].model_copy(update={"languages": None})]
    texts = english_sample()
    answers: list[list[tuple[float, ...]]] = []
    refused = 0
    for specs in (declared, undeclared):
        async with started_service(settings, specs, run_candidates=False) as service:
            scores: list[tuple[float, ...]] = []
            for start in range(0, len(texts), 32):
                batch = texts[start : start + 32]
                try:
                    answer = await service.classify(ClassifyRequest(batch, use_cache=False))
                except OtherLanguage:
                    refused += len(batch)
                    continue
                scores += [s.probabilities for s in answer.result.scores]
            answers.append(scores)
            if specs is declared:
                # A file scored in process: the Korean row is an error row, the others scored.
                rows = [texts[0], "[Web발신] 택배 주소 불명 http://bit.ly/3kR9xT", texts[1]]
                outcomes = await scored(LocalSource(service, use_cache=False), rows)
                assert [o.error is None for o in outcomes] == [True, False, True]
                assert outcomes[1].error is not None
                assert outcomes[1].error["code"] == "other_language"
                assert outcomes[1].error["message"].startswith("inputs[0] is in ko")
    assert refused <= 0.005 * len(texts)
    assert len(answers[0]) == len(answers[1]) == len(texts)
    assert answers[0] == answers[1]  # equal floats: the same bits
