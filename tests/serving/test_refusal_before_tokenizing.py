"""A request under overload is refused on its texts' lengths estimated from their characters,
before they are tokenized; the estimate is learnt from the texts the model tokenizes."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from api.batch.local import started_service
from api.service.contract import ClassifyRequest
from api.serving.errors import Overloaded
from api.serving.token_estimate import TokenEstimate
from tests.support.in_process import make_settings, spec_for
from tests.support.load_client import exposition_sum
from tests.support.tiny_models import TinyModel


def test_nothing_is_estimated_before_a_text_was_tokenized() -> None:
    assert TokenEstimate(max_length=128).lengths(["free prize"]) is None


def test_the_estimate_is_shorter_than_most_texts_are() -> None:
    # Texts of 0.2 to 0.4 tokens a character, evenly: the lower quartile is 0.25.
    rng = random.Random(7)
    estimate = TokenEstimate(max_length=512)
    texts = ["x" * rng.randint(40, 400) for _ in range(2000)]
    real = [max(1, round(len(text) * rng.uniform(0.2, 0.4))) for text in texts]
    estimate.observe(texts, [[0] * length for length in real])
    estimated = estimate.lengths(texts)
    assert estimated is not None
    # Each text's estimate is its characters at the learnt ratio: compare them one by one.
    shorter = sum(
        (single := estimate.lengths([text])) is not None and next(iter(single)) <= length
        for text, length in zip(texts, real, strict=True)
    )
    assert 0.6 <= shorter / len(texts) <= 0.9, shorter / len(texts)
    assert sum(estimated.values()) == len(texts)


def test_an_estimate_is_at_least_one_token_and_at_most_the_models_length() -> None:
    estimate = TokenEstimate(max_length=32)
    estimate.observe(["a" * 100], [[0] * 50])  # half a token a character
    assert estimate.lengths(["", "a" * 10_000]) == {1: 1, 32: 1}


@pytest.mark.parametrize("texts_per_request", [1, 8])
async def test_a_request_that_would_wait_past_the_target_is_refused_untokenized(
    tiny_bert: TinyModel, tmp_path: Path, texts_per_request: int
) -> None:
    settings = make_settings(
        disk_cache_dir=tmp_path / "cache",
        lru_cache_entries=0,
        disk_cache_max_bytes=0,
        # Any wait at all is past it: a request with rows queued ahead is refused.
        latency_target_seconds=0.001,
        # A batch that is not full waits this long for more: the first request's row stays
        # queued while the second comes.
        max_batch_wait_seconds=1.0,
        refusal_delay_seconds=0.0,
    )
    async with started_service(settings, [spec_for(tiny_bert)]) as service:
        # A full batch runs at once (nothing queued ahead: admitted however long it takes),
        # and teaches the estimate what these texts tokenize to.
        full = [f"win a free prize now {i}" for i in range(32)]
        await service.classify(ClassifyRequest(full))
        waiting = asyncio.ensure_future(service.classify(ClassifyRequest(["queued text"])))
        await asyncio.sleep(0.2)  # queued: the batch waits for more
        texts = [f"claim your reward today {i}" for i in range(texts_per_request)]
        with pytest.raises(Overloaded, match="model is busy"):
            await service.classify(ClassifyRequest(texts))
        await waiting  # run once its wait is over: it was queued with nothing ahead
        exposition = generate_latest(service.metrics.registry).decode()
    refused = "loraserve_admission_refusals_total"
    assert exposition_sum(exposition, refused, model="tiny", judged_on="estimate") == 1
    assert exposition_sum(exposition, refused, model="tiny", judged_on="tokens") == 0
