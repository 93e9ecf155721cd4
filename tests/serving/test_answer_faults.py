"""What never leaves the service: non-finite scores, answers to empty texts, a model hidden by
a colliding name, a cascade running past its request's deadline."""

from __future__ import annotations

import asyncio
import math
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import diskcache
import pytest
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from api.models.loader import load_model
from api.models.predictor import NonFiniteScores, Predictor, Scores
from api.models.spec import ModelsFileError, load_models_file
from api.serving.batching import Batcher, BatchLimits
from tests.support.in_process import make_settings, serving, spec_for
from tests.support.tiny_models import TinyModel, write_models_file

POISON = "cash"  # one word of the tiny vocabulary whose embedding is NaN


@pytest.fixture(scope="module")
def poisoned(tiny_bert: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """The tiny BERT with NaN as the embedding of one word: texts with it score NaN."""
    base = tmp_path_factory.mktemp("poisoned") / "base"
    shutil.copytree(tiny_bert.base, base)
    weights = load_file(base / "model.safetensors")
    vocab = (base / "tokenizer.json").read_text(encoding="utf-8")
    assert f'"{POISON}"' in vocab
    token = AutoTokenizer.from_pretrained(base).convert_tokens_to_ids(POISON)
    name = next(key for key in weights if key.endswith("word_embeddings.weight"))
    weights[name][token] = float("nan")
    save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
    return TinyModel(base=base, adapters=tiny_bert.adapters)


def test_a_nan_row_fails_alone_in_its_batch(poisoned: TinyModel) -> None:
    predictor = Predictor(load_model(spec_for(poisoned), make_settings()))
    rows = predictor.encode([f"{POISON} now", "see you at lunch tomorrow", "ok"])

    async def run() -> list[Scores | BaseException]:
        with ThreadPoolExecutor(1) as pool:
            batcher: Batcher[Scores] = Batcher(predictor.forward, BatchLimits(), pool)
            batcher.start()
            try:
                return await asyncio.gather(
                    *(batcher.submit([row], ["spam"], timeout=30) for row in rows),
                    return_exceptions=True,
                )
            finally:
                await batcher.stop()

    bad, *good = asyncio.run(run())
    assert isinstance(bad, NonFiniteScores)
    for result in good:
        assert isinstance(result, list) and all(map(math.isfinite, result[0].logits))


def test_non_finite_scores_are_an_error_never_cached(poisoned: TinyModel, tmp_path: Path) -> None:
    spec = spec_for(poisoned, adapters=("spam",))
    # Every answer written: the finite one must reach the disk, the others never.
    with serving([spec], tmp_path / "cache", disk_cache_admission="every") as client:
        first = client.post("/predict", json={"inputs": f"win {POISON} now"})
        again = client.post("/predict", json={"inputs": f"win {POISON} now"})
        fine = client.post("/predict", json={"inputs": "see you at lunch tomorrow"})
        metrics = client.get("/metrics").text
    for response in (first, again):  # computed again, not served from a cache
        assert response.status_code == 500
        assert response.json()["error"]["code"] == "non_finite_scores"
    assert fine.status_code == 200
    assert 'loraserve_non_finite_rows_total{model="tiny"} 2.0' in metrics
    with diskcache.Cache(str(tmp_path / "cache")) as disk:
        assert len(disk) == 1  # the finite answer alone


@pytest.mark.parametrize("inputs", ["", "   ", ["ok", "\t\n"]], ids=["empty", "spaces", "list"])
def test_a_text_with_no_tokens_is_refused(
    tiny_bert: TinyModel, tmp_path: Path, inputs: object
) -> None:
    with serving([spec_for(tiny_bert)], tmp_path / "cache") as client:
        response = client.post("/predict", json={"inputs": inputs})
    assert response.status_code == 422
    index = 1 if isinstance(inputs, list) else 0
    assert f"inputs[{index}] has no tokens" in response.json()["error"]["message"]


def test_names_that_collide_as_adapter_settings_stop_start_up(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    entries = [
        {"name": name, "base": str(tiny_bert.base), "adapters": []}
        for name in ("spam-filter", "spam_filter")
    ]
    path = write_models_file(tmp_path / "models.yaml", entries)
    with pytest.raises(ModelsFileError) as refused:
        load_models_file(path)
    message = str(refused.value)
    assert "'spam-filter'" in message and "'spam_filter'" in message
    assert "SPAM_FILTER_ADAPTER_DIR" in message


def test_one_deadline_covers_both_cascade_stages(tiny_bert: TinyModel, tmp_path: Path) -> None:
    first = spec_for(tiny_bert, name="first", adapters=("spam",))
    second = spec_for(tiny_bert, name="second", adapters=("promo",))
    # Each stage waits 0.6 s for batch-mates; a 1 s deadline fits one stage, not two. The
    # threshold 1.0 sends every text on to the second model.
    with serving(
        [first, second],
        tmp_path / "cache",
        cascade_threshold=1.0,
        max_batch_wait_seconds=0.6,
        request_timeout_seconds=1.0,
    ) as client:
        started = time.monotonic()
        response = client.post("/predict", json={"inputs": "win now", "model": "cascade"})
        elapsed = time.monotonic() - started
        one_stage = client.post("/predict", json={"inputs": "win now", "model": "first"})
    assert response.status_code == 504, response.text
    assert elapsed < 1.0 + 0.3
    assert one_stage.status_code == 200  # the first stage alone fits (and was cached)
