"""Languages through the served app: an English and a Korean model, the English one routing
(Korean texts to the Korean model, mixed batches answered in order, each answer naming its
model), refusing or answering flagged; every outcome checked against the models themselves,
called with transformers and peft directly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from peft import PeftModel
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from api.models.spec import ModelSpec
from tests.support.in_process import serving, spec_for
from tests.support.tiny_korean import build_korean_classifier
from tests.support.tiny_models import LABELS, TinyModel

KOREAN = ["내일 회의 3시로 변경되었습니다", "[Web발신] 택배 주소 불명 http://bit.ly/3kR9xT", "네"]
ENGLISH = ["win a free prize now call", "ok", "are we still meeting for lunch tomorrow"]
NO_LETTERS = ["😀🎉", "010-1234-5678", "http://bit.ly/3kR9xT"]


@pytest.fixture(scope="module")
def korean_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_korean_classifier(tmp_path_factory.mktemp("ko") / "base", KOREAN)


def models(tiny_bert: TinyModel, korean: Path, policy: str) -> list[ModelSpec]:
    english = spec_for(tiny_bert, "en", ("spam",), languages=["en"], on_other_language=policy)
    korean_spec = ModelSpec(
        name="ko", base=str(korean), labels=LABELS, max_length=32, languages=["ko"]
    )
    return [english, korean_spec]


def reference(folder: Path, texts: list[str], adapter: Path | None = None) -> list[float]:
    """P(spam) of each text from transformers (and peft) alone, one text at a time."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=len(LABELS))
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    with torch.no_grad():
        return [
            float(torch.softmax(model(**tokenizer(t, return_tensors="pt")).logits[0], -1)[1])
            for t in texts
        ]


def spam_scores(answer: list[list[dict[str, object]]]) -> list[float]:
    return [next(float(s["score"]) for s in one if s["label"] == "spam") for one in answer]  # type: ignore[arg-type]


def predict(client: TestClient, texts: list[str], **body: object) -> tuple[int, dict, object]:  # type: ignore[type-arg]
    response = client.post("/predict", json={"inputs": texts, **body})
    return response.status_code, dict(response.headers), response.json()


def test_route_sends_each_text_to_the_model_that_reads_it_in_order(
    tiny_bert: TinyModel, korean_base: Path, tmp_path: Path
) -> None:
    english_ref = reference(tiny_bert.base, ENGLISH + NO_LETTERS, tiny_bert.adapters["spam"])
    korean_ref = reference(korean_base, KOREAN)
    mixed = [ENGLISH[0], KOREAN[0], NO_LETTERS[0], KOREAN[1], ENGLISH[1], KOREAN[2]]
    expected = [english_ref[0], korean_ref[0], english_ref[3], korean_ref[1], english_ref[1]]
    expected.append(korean_ref[2])
    with serving(models(tiny_bert, korean_base, "route"), tmp_path / "cache") as client:
        listed = {m["name"]: m for m in client.get("/models").json()["models"]}
        assert listed["en"]["languages"] == ["en"] and listed["ko"]["languages"] == ["ko"]
        assert listed["en"]["on_other_language"] == "route"

        status, headers, answer = predict(client, mixed, cache=False)
        assert status == 200, answer
        assert headers["x-answered-by"] == "en,ko,en,ko,en,ko"
        assert headers["x-adapter"] == "spam,,spam,,spam,"  # the Korean model has none
        assert spam_scores(answer) == pytest.approx(expected, abs=1e-5)  # type: ignore[arg-type]

        # Korean only: the Korean model answers all, and X-Model says so.
        status, headers, answer = predict(client, KOREAN, cache=False)
        assert headers["x-model"] == "ko" and headers["x-answered-by"] == "ko,ko,ko"
        assert spam_scores(answer) == pytest.approx(korean_ref, abs=1e-5)  # type: ignore[arg-type]

        # Texts without letters and English stay with the default, unflagged.
        status, headers, answer = predict(client, ENGLISH + NO_LETTERS, cache=False)
        assert headers["x-answered-by"] == ",".join(["en"] * 6)
        assert "x-outside-languages" not in headers
        assert spam_scores(answer) == pytest.approx(english_ref, abs=1e-5)  # type: ignore[arg-type]

        # A request that names the model (or an adapter) is not routed: a clear refusal.
        status, _, body = predict(client, [ENGLISH[0], KOREAN[0]], model="en")
        assert status == 422 and body["error"]["code"] == "other_language"  # type: ignore[index]
        message = body["error"]["message"]  # type: ignore[index]
        assert "inputs[1] is in ko" in message and "reads en" in message and "'ko'" in message
        status, _, body = predict(client, [KOREAN[0]], adapter="spam")
        assert status == 422, body

        # The Korean model asked by name answers English as its models file says (answer),
        # flagged by position.
        status, headers, answer = predict(client, [KOREAN[0], ENGLISH[0]], model="ko")
        assert status == 200 and headers["x-outside-languages"] == "1"
        metrics = client.get("/metrics").text
    for line in (
        'loraserve_language_texts_total{language="ko",model="en",outcome="routed"} 6.0',
        'loraserve_language_texts_total{language="und-Latn",model="en",outcome="answered"} 5.0',
        'loraserve_language_texts_total{language="none",model="en",outcome="answered"} 4.0',
        'loraserve_language_texts_total{language="ko",model="en",outcome="refused"} 2.0',
        'loraserve_language_texts_total{language="und-Latn",model="ko",'
        'outcome="outside_answered"} 1.0',
    ):
        assert line in metrics, line


def test_a_routed_answer_is_the_answering_models_in_every_cache(
    tiny_bert: TinyModel, korean_base: Path, tmp_path: Path
) -> None:
    """The route is decided before any cache is asked, and a routed text is cached under the
    identity of the model that answered it: another service whose English model answers the
    same Korean text itself (answer) finds nothing of the Korean model's in the shared disk
    tier, and the Korean model's own answer is the routed one."""
    cache = tmp_path / "shared-disk-cache"
    text = KOREAN[0]
    with serving(
        models(tiny_bert, korean_base, "route"), cache, disk_cache_admission="every"
    ) as client:
        _, headers, routed = predict(client, [text])
        assert headers["x-answered-by"] == "ko" and headers["x-cache"].endswith("model=1")
        _, headers, named = predict(client, [text], model="ko")
        assert headers["x-cache"].startswith("lru=1") and named == routed
    with serving(
        models(tiny_bert, korean_base, "answer"), cache, disk_cache_admission="every"
    ) as client:
        _, headers, flagged = predict(client, [text])
        assert headers["x-answered-by"] == "en" and headers["x-outside-languages"] == "0"
        assert headers["x-cache"] == "lru=0,disk=0,model=1"  # the Korean answer is not its
        assert flagged != routed
        _, headers, named = predict(client, [text], model="ko")
        assert headers["x-cache"] == "lru=0,disk=1,model=0" and named == routed
    with serving(
        models(tiny_bert, korean_base, "refuse"), cache, disk_cache_admission="every"
    ) as client:
        status, _, body = predict(client, [text])  # refused before any cache is read
        assert status == 422 and "model 'ko' reads it" in body["error"]["message"]  # type: ignore[index]


def test_a_text_no_model_reads_is_refused_when_routing(
    tiny_bert: TinyModel, korean_base: Path, tmp_path: Path
) -> None:
    with serving(models(tiny_bert, korean_base, "route"), tmp_path / "cache") as client:
        status, _, body = predict(client, [ENGLISH[0], "Привет, как дела"])
        assert status == 422
        message = body["error"]["message"]  # type: ignore[index]
        assert "inputs[1] is in und-Cyrl" in message and "no other model reads it" in message
        # OIP's error shape carries the same message.
        tensor = {"name": "input-0", "datatype": "BYTES", "shape": [1], "data": ["안녕"]}
        infer = {"inputs": [tensor]}
        response = client.post("/v2/models/en/infer", json=infer)
        assert response.status_code == 422
        assert "inputs[0] is in ko" in response.json()["error"]


def test_the_cascade_routes_nothing_its_first_model_refuses(
    tiny_bert: TinyModel, korean_base: Path, tmp_path: Path
) -> None:
    with serving(models(tiny_bert, korean_base, "route"), tmp_path / "cache") as client:
        status, _, body = predict(client, [ENGLISH[0], KOREAN[0]], model="cascade")
        assert status == 422 and body["error"]["code"] == "other_language"  # type: ignore[index]
        status, headers, _ = predict(client, ENGLISH + NO_LETTERS, model="cascade")
        assert status == 200 and headers["x-answered-by"].split(",")[0] in ("en", "ko")
