"""DISK_CACHE_ADMISSION=repeated, the default: the disk tier writes a text's answer from the
second time this process stores it, never a one-off's; every answer is the model's all the same."""

from __future__ import annotations

import math
import uuid
from pathlib import Path

from api.metrics import Metrics
from api.serving.cache.disk import DiskTier
from api.serving.cache.doorkeeper import Doorkeeper
from api.serving.cache.verify import AnswerShape
from tests.support.in_process import serving, spec_for
from tests.support.tiny_models import TinyModel

BITS, MARKS = 1 << 16, 1 << 12  # a generation: 65,536 bits, new after 4,096 marks
ENTRY = ((0.25, 0.75), (0.0, math.log(3)))  # softmax(0, ln 3) = (1/4, 3/4)


def fresh_keys(count: int) -> list[str]:
    return [uuid.uuid4().hex for _ in range(count)]


def test_a_key_offered_again_within_a_generation_is_always_admitted() -> None:
    # The reference is a set of the keys offered so far. Each round offers half a generation
    # of keys: the last round's new ones again, and as many never offered. A key in the set must
    # be admitted (no false negatives, a key whose first offer was a false positive
    # included); one not in it passes only as a false positive, at most an eighth of them.
    doorkeeper = Doorkeeper(BITS, MARKS)
    offered: set[str] = set()
    last_fresh: list[str] = []
    missed = passed_fresh = fresh = 0
    for _ in range(20):
        new_keys = fresh_keys(MARKS // 4)
        for key in last_fresh + new_keys:
            admitted = doorkeeper.admit(key)
            if key in offered:
                missed += not admitted
            else:
                fresh += 1
                passed_fresh += admitted
            offered.add(key)
        last_fresh = new_keys
    assert missed == 0
    assert passed_fresh / fresh <= 1 / 8


def test_few_first_offers_pass_for_repeats_and_old_ones_are_forgotten() -> None:
    doorkeeper = Doorkeeper(BITS, MARKS)
    first_offers = fresh_keys(50_000)  # twelve generations
    passed = sum(doorkeeper.admit(key) for key in first_offers)
    # At most an eighth of the bits are set across the two generations read.
    assert passed / len(first_offers) <= 1 / 8
    # Keys offered two generations ago are forgotten (but for the same false positives).
    early = first_offers[:1000]
    remembered = sum(doorkeeper.admit(key) for key in early)
    assert remembered / len(early) <= 1 / 8 + 0.05


async def test_the_disk_tier_writes_a_key_from_its_second_store_and_counts_the_first(
    tmp_path: Path,
) -> None:
    metrics = Metrics(latency_target_seconds=2.0)
    tier = DiskTier(tmp_path / "disk", 2**24, None, metrics, Doorkeeper(BITS, MARKS))
    tier.put_many(["once", "twice"], [ENTRY, ENTRY])
    tier.put_many(["twice"], [ENTRY])
    await tier.close()  # its writer finishes first
    reading = DiskTier(tmp_path / "disk", 2**24, None, Metrics(latency_target_seconds=2.0))
    try:
        found = await reading.get_many(["once", "twice"], AnswerShape(labels=2))
    finally:
        await reading.close()
    assert found == [None, ENTRY]
    assert metrics.cache_not_admitted.labels("disk")._value.get() == 2


def test_after_a_restart_the_disk_answers_the_repeated_text_alone(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    # The default admission (repeated); the LRU off, so that each request reaches the disk
    # tier and the model.
    settings = {"lru_cache_entries": 0}
    spec = spec_for(tiny_bert, adapters=("spam",))
    once, twice = {"inputs": "lunch tomorrow?"}, {"inputs": "win a free prize now"}
    with serving([spec], tmp_path / "cache", ready_within=30, **settings) as client:
        first = client.post("/predict", json=once)
        client.post("/predict", json=twice)
        repeated = client.post("/predict", json=twice)
        metrics = client.get("/metrics").text
    with serving([spec], tmp_path / "cache", ready_within=30, **settings) as client:
        once_after = client.post("/predict", json=once)
        twice_after = client.post("/predict", json=twice)
    with serving([spec], tmp_path / "reference", ready_within=30, lru_cache_entries=0) as client:
        reference = [client.post("/predict", json=body).json() for body in (once, twice)]
    assert repeated.headers["X-Cache"] == "lru=0,disk=0,model=1"  # not admitted the first time
    assert once_after.headers["X-Cache"] == "lru=0,disk=0,model=1"
    assert twice_after.headers["X-Cache"] == "lru=0,disk=1,model=0"
    assert [once_after.json(), twice_after.json()] == reference
    assert first.json() == reference[0] and repeated.json() == reference[1]
    assert 'loraserve_cache_not_admitted_total{tier="disk"} 2.0' in metrics
