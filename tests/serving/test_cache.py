"""The two-tier cache: eviction, restarts, changed weights, corrupt entries, opting out."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import diskcache
import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from api.metrics import Metrics
from api.models.spec import AdapterSpec
from api.serving.cache import ResultCache, disk
from api.serving.cache.disk import DiskTier
from api.serving.cache.entry import Entry
from api.serving.cache.lru import LruTier
from api.serving.cache.signing import default_key_file, load_key
from api.serving.cache.text_disk import TextOnlyDisk
from api.serving.cache.verify import NOT_AN_ANSWER, AnswerShape, Rejected
from tests.support.in_process import make_settings, spec_for
from tests.support.in_process import serving as serve
from tests.support.tiny_models import TinyModel

TEXT = {"inputs": "win a free prize now"}


@contextmanager
def serving(
    tiny: TinyModel, cache_dir: Path, adapter_path: Path | None = None, **settings: object
) -> Iterator[TestClient]:
    spec = spec_for(tiny, adapters=("spam",))
    if adapter_path is not None:
        spec = spec.model_copy(update={"adapters": [AdapterSpec(name="spam", path=adapter_path)]})
    with serve([spec], cache_dir, ready_within=30, **settings) as client:
        yield client


def test_lru_evicts_the_least_recently_used() -> None:
    lru = LruTier(max_entries=2, metrics=Metrics(latency_target_seconds=2.0))
    a, b, c = ((0.1,), (0.1,)), ((0.2,), (0.2,)), ((0.3,), (0.3,))
    lru.put("a", a)
    lru.put("b", b)
    assert lru.get("a") == a  # a is now the most recent
    lru.put("c", c)
    assert lru.get("b") is None and lru.get("a") == a and lru.get("c") == c
    assert len(lru) == 2


def test_second_request_is_a_hit_and_opting_out_skips_the_cache(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    with serving(tiny_bert, tmp_path / "cache") as client:
        first = client.post("/predict", json=TEXT)
        second = client.post("/predict", json=TEXT)
        opted_out = client.post("/predict", json={**TEXT, "cache": False})
    assert first.headers["X-Cache"] == "lru=0,disk=0,model=1"
    assert second.headers["X-Cache"] == "lru=1,disk=0,model=0"
    assert opted_out.headers["X-Cache"] == "lru=0,disk=0,model=1"
    assert first.json() == second.json() == opted_out.json()


def test_batch_mixes_hits_and_misses_in_order(tiny_bert: TinyModel, tmp_path: Path) -> None:
    with serving(tiny_bert, tmp_path / "cache") as client:
        one = client.post("/predict", json={"inputs": ["lunch tomorrow"]}).json()
        both = client.post("/predict", json={"inputs": ["win a prize", "lunch tomorrow"]})
        fresh = client.post("/predict", json={"inputs": ["win a prize"], "cache": False}).json()
    assert both.headers["X-Cache"] == "lru=1,disk=0,model=1"
    assert both.json() == [fresh[0], one[0]]


def test_disk_tier_survives_a_restart(tiny_bert: TinyModel, tmp_path: Path) -> None:
    # Every answer written, so that one request leaves its answer on disk.
    with serving(tiny_bert, tmp_path / "cache", disk_cache_admission="every") as client:
        before = client.post("/predict", json=TEXT)
    with serving(tiny_bert, tmp_path / "cache") as client:
        after = client.post("/predict", json=TEXT)
    assert before.headers["X-Cache"].endswith("model=1")
    assert after.headers["X-Cache"] == "lru=0,disk=1,model=0"
    assert after.json() == before.json()


def test_changed_adapter_file_never_serves_the_old_answer(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    adapter = tmp_path / "adapter"
    shutil.copytree(tiny_bert.adapters["spam"], adapter)
    with serving(tiny_bert, tmp_path / "cache", adapter) as client:
        old = client.post("/predict", json=TEXT).json()
    # Same path, same name, new weights: as when a retrained adapter is copied over the old.
    shutil.copy(tiny_bert.adapters["promo"] / "adapter_model.safetensors", adapter)
    with serving(tiny_bert, tmp_path / "cache", adapter) as client:
        new = client.post("/predict", json=TEXT)
    with serving(tiny_bert, tmp_path / "other-cache", tiny_bert.adapters["promo"]) as client:
        promo = client.post("/predict", json=TEXT).json()
    assert new.headers["X-Cache"] == "lru=0,disk=0,model=1"
    assert new.json() == promo and new.json() != old


def test_corrupt_disk_entry_is_served_from_the_model_and_counted(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    with serving(tiny_bert, tmp_path / "cache", disk_cache_admission="every") as client:
        good = client.post("/predict", json=TEXT).json()
    with diskcache.Cache(str(tmp_path / "cache")) as raw:
        (key,) = list(raw)
        raw.set(key, "{not json")  # without the HMAC that every value carries: "mac"
    with serving(tiny_bert, tmp_path / "cache") as client:
        response = client.post("/predict", json=TEXT)
        metrics = client.get("/metrics").text
    assert response.status_code == 200 and response.json() == good
    assert response.headers["X-Cache"] == "lru=0,disk=0,model=1"
    assert 'loraserve_cache_rejected_total{reason="mac",tier="disk"} 1.0' in metrics
    assert "loraserve_cache_errors_total{" not in metrics  # a bad value is no fault


def test_unwritable_disk_cache_degrades_to_the_model(tiny_bert: TinyModel, tmp_path: Path) -> None:
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the cache folder should be", encoding="utf-8")
    with serving(tiny_bert, blocked) as client:
        response = client.post("/predict", json=TEXT)
        metrics = client.get("/metrics").text
    assert response.status_code == 200
    assert 'loraserve_cache_errors_total{op="open",tier="disk"} 1.0' in metrics


def test_both_tiers_can_be_turned_off(tiny_bert: TinyModel, tmp_path: Path) -> None:
    with serving(
        tiny_bert, tmp_path / "cache", lru_cache_entries=0, disk_cache_max_bytes=0
    ) as client:
        client.post("/predict", json=TEXT)
        again = client.post("/predict", json=TEXT)
    assert again.headers["X-Cache"] == "lru=0,disk=0,model=1"
    assert not (tmp_path / "cache").exists()


async def test_disk_reads_never_wait_for_a_write(tmp_path: Path) -> None:
    # The event loop reads the disk tier inline; a writer (the tier's own thread, another
    # replica sharing the folder) holding sqlite's write lock must not stall it. Under a
    # least-recently-used policy every read, a miss included, wrote an access time and
    # waited for that lock: held here for 3 s, a read took 3 s.
    tier = DiskTier(tmp_path / "disk", 2**24, None, Metrics(latency_target_seconds=2.0))
    stored = ((0.25, 0.75), (0.0, math.log(3)))  # softmax(0, ln 3) = (1/4, 3/4)
    tier._write([("stored", stored)])
    holding, release = threading.Event(), threading.Event()

    def writer() -> None:
        other = diskcache.Cache(str(tmp_path / "disk"))
        with other.transact():
            other.set("being-written", "[[0.5, 0.5], [0.0, 0.0]]")
            holding.set()
            release.wait(3)
        other.close()

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        assert holding.wait(10)
        started = time.monotonic()
        found = await tier.get_many(["stored", "missing"], AnswerShape(labels=2))
        took = time.monotonic() - started
    finally:
        release.set()
        thread.join()
        await tier.close()
    assert found == [stored, None]
    assert took < 1.5, f"a read waited {took:.2f} s for the writer's lock"


async def test_disk_reads_agree_with_diskcaches_own_get(tmp_path: Path) -> None:
    # The tier reads diskcache's table with a query of its own (a turn's keys at once); what
    # it finds must be what diskcache's `get`, through the tier's own text-only serializer,
    # finds for each key: a stored entry, nothing for a key never stored or expired, and a
    # refusal for a row holding a pickle.
    folder = tmp_path / "disk"
    stored = ((0.25, 0.75), (0.0, math.log(3)))
    other = ((0.5, 0.5), (1.0, 1.0))
    tier = DiskTier(folder, 2**24, None, Metrics(latency_target_seconds=2.0))
    tier._write([("kept", stored), ("also kept", other)])
    short = DiskTier(folder, 2**24, 0.05, Metrics(latency_target_seconds=2.0))
    short._write([("expired", stored)])
    await short.close()
    with diskcache.Cache(str(folder)) as plain:  # diskcache's own Disk pickles a dict
        plain.set("pickled", {"scores": [0.5, 0.5]})
    time.sleep(0.1)  # "expired" is past its 50 ms
    keys = ["kept", "never stored", "expired", "pickled", "also kept"]
    metrics = Metrics(latency_target_seconds=2.0)
    reading = DiskTier(folder, 2**24, None, metrics)
    try:
        found = await reading.get_many(keys, AnswerShape(labels=2))
    finally:
        await reading.close()
        await tier.close()
    with diskcache.Cache(str(folder), disk=TextOnlyDisk) as reference:
        expected: list[Entry | None] = []
        for key in keys:
            try:
                raw = reference.get(key)
            except Rejected:
                raw = None  # a refusal is a miss to the caller, counted as rejected
            body = None if raw is None else json.loads(raw[disk.MAC_CHARS :])
            expected.append(None if body is None else tuple(map(tuple, body)))
    assert found == expected == [stored, None, None, None, other]
    rejected = metrics.cache_rejected.labels("disk", "format")._value.get()
    assert rejected == 1


async def test_disk_writes_are_what_diskcaches_own_get_reads(tmp_path: Path) -> None:
    # The tier writes a transaction's entries into diskcache's table in one statement of its
    # own; diskcache itself, through the tier's text-only serializer, must read back each
    # entry as written: new keys, a key overwritten, a row that held a pickle overwritten
    # with text, a key stored twice in one transaction, and an entry with a time to live,
    # which expires for diskcache too. Its count of entries (kept by its triggers) must agree.
    folder = tmp_path / "disk"
    first = ((0.25, 0.75), (0.0, math.log(3)))
    second = ((0.5, 0.5), (1.0, 1.0))
    with diskcache.Cache(str(folder)) as plain:
        plain.set("held a pickle", {"scores": [0.5, 0.5]})
    tier = DiskTier(folder, 2**24, None, Metrics(latency_target_seconds=2.0))
    tier._write([("a", first), ("b", first), ("held a pickle", first)])
    # "c" stored twice before one commit: its latest entry is the one written.
    tier._write([("b", second), ("held a pickle", second), ("c", first), ("c", second)])
    await tier.close()
    short = DiskTier(folder, 2**24, 0.05, Metrics(latency_target_seconds=2.0))
    short._write([("expires", first)])
    await short.close()
    with diskcache.Cache(str(folder), disk=TextOnlyDisk) as reference:
        read = {key: reference.get(key) for key in ("a", "b", "held a pickle", "c", "expires")}
        counted = len(reference)
        time.sleep(0.1)  # "expires" is past its 50 ms
        expired = reference.get("expires")
        removed = reference.expire()
        left = len(reference)
    written = {"a": first, "b": second, "held a pickle": second, "c": second, "expires": first}
    secret = load_key(default_key_file(folder))  # the tiers' key, made beside the folder
    assert read == {key: disk.value_text(entry, key, secret) for key, entry in written.items()}
    assert (counted, expired, removed, left) == (5, None, 1, 4)


def statements(connection: sqlite3.Connection) -> list[str]:
    """The SQL statements `connection` runs from now on."""
    ran: list[str] = []
    connection.set_trace_callback(ran.append)
    return ran


async def test_the_disk_reads_of_one_turn_are_one_query(tmp_path: Path) -> None:
    # Each statement lets the GIL go, and the event loop then waits to take it back: the
    # requests that look up in one turn of the loop share one query.
    tier = DiskTier(tmp_path / "disk", 2**24, None, Metrics(latency_target_seconds=2.0))
    entry = ((0.25, 0.75), (0.0, math.log(3)))
    tier.put_many([f"text-{index}" for index in range(0, 20, 2)], [entry] * 10)
    await tier.close()
    tier = DiskTier(tmp_path / "disk", 2**24, None, Metrics(latency_target_seconds=2.0))
    ran = statements(tier._reader())
    try:
        found = await asyncio.gather(
            *(tier.get_many([f"text-{index}"], AnswerShape(labels=2)) for index in range(20))
        )
        later = await tier.get_many(["text-0", "text-1"], AnswerShape(labels=2))
    finally:
        await tier.close()
    assert found == [[entry] if index % 2 == 0 else [None] for index in range(20)]
    assert later == [entry, None]
    assert len(ran) == 2, ran  # the gathered turn's, then the later one's


async def test_a_disk_read_that_fails_is_a_miss_for_each_key_counted(tmp_path: Path) -> None:
    folder = tmp_path / "disk"
    metrics = Metrics(latency_target_seconds=2.0)
    tier = DiskTier(folder, 2**24, None, metrics)
    tier._write([("stored", ((0.25, 0.75), (0.0, math.log(3))))])
    with sqlite3.connect(folder / "cache.db") as broken:  # the table the reads query, gone
        broken.execute("ALTER TABLE Cache RENAME TO Elsewhere")
    try:
        found = await asyncio.gather(
            tier.get_many(["stored", "other"], AnswerShape(labels=2)),
            tier.get_many(["third"], AnswerShape(labels=2)),
        )
    finally:
        await tier.close()
    assert found == [[None, None], [None]]
    assert metrics.cache_errors.labels("disk", "read")._value.get() == 3
    assert metrics.cache_lookups.labels("disk", "error")._value.get() == 3


def commit_sizes(tier: DiskTier) -> list[int]:
    """The number of entries in each of the tier's write transactions, from now on."""
    sizes: list[int] = []
    write = tier._write

    def counted(pending: list[tuple[str, Entry]]) -> None:
        sizes.append(len(pending))
        write(pending)

    tier._write = counted  # type: ignore[method-assign]
    return sizes


async def read_back(folder: Path, keys: list[str]) -> list[Entry | None]:
    """What a new tier on `folder` holds for `keys`: what the closed one wrote."""
    reopened = DiskTier(folder, 2**24, None, Metrics(latency_target_seconds=2.0))
    try:
        return await reopened.get_many(keys, AnswerShape(labels=2))
    finally:
        await reopened.close()


async def test_entries_stored_while_a_commit_waits_go_into_one_next_transaction(
    tmp_path: Path,
) -> None:
    # Another connection holds sqlite's write lock, so the tier's first transaction waits:
    # what 40 more requests store meanwhile must all land, in one more transaction, not 40.
    folder = tmp_path / "disk"
    tier = DiskTier(folder, 2**24, None, Metrics(latency_target_seconds=2.0))
    holding, release = threading.Event(), threading.Event()
    commits = commit_sizes(tier)

    def locker() -> None:
        other = diskcache.Cache(str(folder))
        with other.transact():
            holding.set()
            release.wait(5)
        other.close()

    thread = threading.Thread(target=locker)
    thread.start()
    entry = ((0.25, 0.75), (0.0, math.log(3)))
    try:
        assert holding.wait(10)
        tier.put_many(["first"], [entry])
        time.sleep(0.2)  # the writer thread is in its transaction, waiting for the lock
        for index in range(40):
            tier.put_many([f"text-{index}"], [entry])
    finally:
        release.set()
        thread.join()
    await tier.close()  # waits for the writer to drain
    keys = ["first"] + [f"text-{index}" for index in range(40)]
    assert await read_back(folder, keys) == [entry] * len(keys)
    assert commits == [1, 40]


async def test_answers_stored_within_the_gather_window_share_one_transaction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A batch's requests store their answers a few at a time, milliseconds apart: the writer
    # lets them gather before it commits, since a commit of one entry costs ~2.7 times the
    # CPU an entry costs among 64. The window is widened here so that a slow machine
    # still stores all 40 inside it.
    monkeypatch.setattr(disk, "WRITE_GATHER_SECONDS", 0.5)
    folder = tmp_path / "disk"
    tier = DiskTier(folder, 2**24, None, Metrics(latency_target_seconds=2.0))
    commits = commit_sizes(tier)
    entry = ((0.25, 0.75), (0.0, math.log(3)))
    keys = [f"text-{index}" for index in range(40)]
    for key in keys:
        tier.put_many([key], [entry])
        await asyncio.sleep(0.001)  # the next request's answer, a moment later
    await tier.close()  # waits for the writer to drain
    assert await read_back(folder, keys) == [entry] * len(keys)
    assert commits == [40]


async def test_the_disk_tier_stays_within_its_bytes_and_keeps_the_latest_entries(
    tmp_path: Path,
) -> None:
    # Culled once per transaction rather than on every write: still bounded, the least
    # recently stored going first. Measured with diskcache's own accounting, from a second
    # connection to the folder.
    limit = 256 * 1024
    folder = tmp_path / "disk"
    tier = DiskTier(folder, limit, None, Metrics(latency_target_seconds=2.0))
    entry = ((0.25, 0.75), (0.0, math.log(3)))
    keys = [f"text {index} " + "x" * 200 for index in range(4000)]  # ~1 MB of rows in all
    for start in range(0, len(keys), 100):
        tier.put_many(keys[start : start + 100], [entry] * 100)
        await asyncio.sleep(0.01)  # requests come over time: several transactions
    await tier.close()
    reader = diskcache.Cache(str(folder))
    try:
        volume, stored = reader.volume(), len(reader)
    finally:
        reader.close()
    assert volume <= limit, (volume, stored)
    reopened = DiskTier(folder, limit, None, Metrics(latency_target_seconds=2.0))
    latest = await reopened.get_many(keys[-50:], AnswerShape(labels=2))
    oldest = await reopened.get_many(keys[:50], AnswerShape(labels=2))
    await reopened.close()
    assert latest == [entry] * 50 and oldest == [None] * 50, stored


async def test_every_rejection_series_of_each_tier_is_there_from_the_start(
    tmp_path: Path,
) -> None:
    """A dashboard's panel on loraserve_cache_rejected_total reads 0, not "No data", until
    the first refusal: each tier's reasons are exported at 0 as the cache opens."""
    settings = make_settings(disk_cache_dir=tmp_path / "disk")
    metrics = Metrics(settings.latency_target_seconds)
    cache = ResultCache.from_settings(settings, metrics)
    try:
        exported = {
            (sample.labels["tier"], sample.labels["reason"]): sample.value
            for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
            for sample in family.samples
            if sample.name == "loraserve_cache_rejected_total"
        }
    finally:
        await cache.close()
    expected = {("lru", reason) for reason in NOT_AN_ANSWER}
    expected |= {("disk", reason) for reason in ("format", "mac", *NOT_AN_ANSWER)}
    assert exported == dict.fromkeys(expected, 0.0)
