"""BATCH_LOGIT_TOLERANCE: a model whose batches move a text's logits by more than the operator
allows scores each text alone, so that its answers are a function of the text alone.

The reference is the text scored as a batch of one, which is what the load's probe
(`batch_max_logit_difference`) compares a batch against. A padded decoder in bitsandbytes nf4
is the kind of model it is for: the embedded cascade LLM's batched logits differ from its lone
ones by up to ~0.014 on these texts (on an H200, EXAONE's in nf4 differed by 0.0886).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from api.http.app import create_app
from api.models.loader import load_model
from api.models.predictor import Predictor, Scores
from tests.support.in_process import make_settings, spec_for, wait_ready
from tests.support.server_process import run_server
from tests.support.tiny_models import TinyModel

# Lengths that pad a batch unevenly: the shape under which a padded decoder rounds differently.
TEXTS = [
    "win",
    "win a free prize now call this number to claim it today",
    "are we still meeting for lunch tomorrow",
    "ok",
    "urgent your account has been selected for a cash reward reply yes",
    "see you at six",
]
# The row lengths of the load's probe (Predictor.probe_batches): on the tiny Llama these
# round apart batched, where its word-level texts do not.
LENGTHS = (5, 2, 9, 5, 1, 7, 3, 12)
# Each text sent this many times at once: batches of many mixes, some of which round apart.
ROUNDS = 4
# The embedded default's two models (artifacts/models.yaml).
ENCODER, LLM = "spam-minilm", "spam-smollm2"


def logits(scores: list[object]) -> list[tuple[float, ...]]:
    assert all(isinstance(s, Scores) for s in scores)
    return [s.logits for s in scores if isinstance(s, Scores)]


def test_scoring_alone_gives_each_text_its_lone_logits_to_the_bit(tiny_llama: TinyModel) -> None:
    spec = spec_for(tiny_llama, quantization="nf4")
    predictor = Predictor(load_model(spec, make_settings()))
    # Rows of the lengths the load's probe uses, of ordinary tokens of the tiny vocabulary.
    vocab = predictor.loaded.tokenizer.vocab_size
    rows = [[(7 + 13 * row + 3 * i) % vocab for i in range(n)] for row, n in enumerate(LENGTHS)]
    adapters: list[str | None] = ["spam"] * len(rows)
    alone = [logits(predictor.forward([row], ["spam"]))[0] for row in rows]
    # Batched, this model's logits are not its lone ones: without that, nothing is shown.
    assert logits(predictor.forward(rows, adapters)) != alone
    assert predictor.probe_batches().variance > 0

    predictor.scores_alone = True
    assert logits(predictor.forward(rows, adapters)) == alone
    mixed: list[str | None] = ["spam", "promo", "spam", "promo", "promo", "spam", "promo", "spam"]
    assert logits(predictor.forward(rows, mixed)) == [
        logits(predictor.forward([row], [adapter]))[0]
        for row, adapter in zip(rows, mixed, strict=True)
    ]


@pytest.mark.parametrize("tolerance", [None, 0.0, 1.0])
def test_the_tolerance_decides_per_model_and_names_itself_in_the_answer_identity(
    tiny_bert: TinyModel, tiny_llama: TinyModel, tolerance: float | None
) -> None:
    specs = [
        spec_for(tiny_bert, name="bert"),
        spec_for(tiny_llama, name="llama", quantization="nf4"),
    ]
    app = create_app(make_settings(batch_logit_tolerance=tolerance), specs)
    with TestClient(app) as client:
        wait_ready(client)
        models = {m["name"]: m for m in client.get("/models").json()["models"]}
    assert models["llama"]["batch_max_logit_difference"] > 0  # so a tolerance of 0 binds
    for model in models.values():
        difference = model["batch_max_logit_difference"]
        expected = tolerance is not None and difference > tolerance
        assert model["scores_texts_alone"] is expected
        for identity in model["identities"]:
            assert identity["components"]["scores_texts_alone"] is expected


def test_through_the_server_a_text_among_others_answers_as_alone(tmp_path: Path) -> None:
    """The embedded default through the real server: its cascade LLM (SmolLM2 in nf4, padded)
    moves these texts' logits by up to ~0.014 batched against alone, its encoder (packed) by
    nothing. With the tolerance at 0 the LLM scores each text alone and the encoder batches;
    requests sent together (batched by the real batcher) answer as the same texts sent one at
    a time, cache off, to the bit."""
    env = {
        "BATCH_LOGIT_TOLERANCE": "0",
        "MAX_BATCH_WAIT_SECONDS": "0.02",
        # Every request answered: the comparison is of answers, not of admission (texts scored
        # alone make batches slower, and many sent at once could be refused with 429).
        "ADMISSION_CONTROL": "false",
        "DISK_CACHE_MAX_BYTES": "0",
    }
    with run_server(env, tmp_path) as server:
        server.wait_ready()
        models = {
            m["name"]: m for m in httpx.get(f"{server.url}/models", timeout=30).json()["models"]
        }
        assert models[LLM]["batch_max_logit_difference"] > 0 and models[LLM]["scores_texts_alone"]
        assert models[ENCODER]["batch_max_logit_difference"] == 0
        assert not models[ENCODER]["scores_texts_alone"]

        def ask(text: str) -> list[dict[str, object]]:
            body = {"inputs": [text], "model": LLM, "cache": False}
            response = httpx.post(f"{server.url}/predict", json=body, timeout=60)
            response.raise_for_status()
            answer: list[dict[str, object]] = response.json()
            return answer

        one_at_a_time = [ask(text) for text in TEXTS]
        with ThreadPoolExecutor(len(TEXTS) * ROUNDS) as pool:
            together = list(pool.map(ask, TEXTS * ROUNDS))
        exposition = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert together == one_at_a_time * ROUNDS
    # Some requests did share a batch: a batch of more than one text ran.
    batches = {
        sample.labels["le"]: sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.name == "loraserve_batch_size_bucket" and sample.labels["model"] == LLM
    }
    assert batches["+Inf"] > batches["1.0"]
