"""The shared Redis tier, on a real redis-server on loopback: the value format, the breaker,
a hit across two app instances, a frozen Redis, and Redis killed under load."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import math
import struct
import threading
import time
from pathlib import Path

import diskcache
import httpx
import pytest
from fastapi.testclient import TestClient
from redis.asyncio.connection import DefaultParser
from redis.utils import HIREDIS_AVAILABLE

from api.metrics import Metrics
from api.serving.cache import ResultCache
from api.serving.cache.breaker import Breaker
from api.serving.cache.redis import FORMAT_VERSION, RedisTier, decode, encode
from api.serving.cache.verify import AnswerShape, Rejected
from api.settings import SettingsError, load_settings
from tests.support.in_process import serving, spec_for, wait_for
from tests.support.load_client import exposition_sum, metric, run_load, sms_texts
from tests.support.redis_server import RedisServer
from tests.support.server_process import run_server
from tests.support.tiny_models import TinyModel, tiny_models_file

TEXT = "win a free prize now"
PREFIX = "test:"
TTL_SECONDS = 3600.0
SECRET = "a secret the replicas share"


def redis_settings(server: RedisServer, **more: object) -> dict[str, object]:
    return {
        "redis_url": server.url,
        "redis_cache_secret": SECRET,
        "redis_key_prefix": PREFIX,
        "redis_ttl_seconds": TTL_SECONDS,
        **more,
    }


def expected_key(identity: str, text: str) -> str:
    """The Redis key of an answer, written out from its definition: prefix, format version,
    then the sha256 of the identity, the truncation flag and the text (NUL-separated)."""
    digest = hashlib.sha256(f"{identity}\x00t\x00{text}\x00".encode()).hexdigest()
    return f"{PREFIX}v{FORMAT_VERSION}:{digest}"


def spam_identity(client: TestClient) -> str:
    [model] = client.get("/models").json()["models"]
    return next(i["digest"] for i in model["identities"] if i["adapter"] == "spam")


# --- the value and the breaker, alone ---


def test_values_are_small_exact_versioned_and_signed() -> None:
    entry = ((0.25, 0.75), (-1.0986122886681098, 0.1))
    key, secret = "test:v2:k", SECRET.encode()
    raw = encode(entry, key, secret)
    # The layout, read with struct and hmac on their own: version, label count, the
    # float64s, then HMAC-SHA256 over the key's length, the key and all of that.
    assert len(raw) == 67
    assert struct.unpack("<BH4d", raw[:35]) == (2, 2, 0.25, 0.75, -1.0986122886681098, 0.1)
    signed = struct.pack("<I", len(key)) + key.encode() + raw[:35]
    assert raw[35:] == hmac.new(secret, signed, hashlib.sha256).digest()
    assert decode(raw, key, secret) == entry  # the very floats, not rounded
    assert encode(entry, key, None) == raw[:35]  # REDIS_TRUSTED_NETWORK: no MAC
    assert decode(raw[:35], key, None) == entry
    bad_format = (b"", raw[:-1], b"\x01" + raw[1:], raw.decode("latin-1"), raw[:35], raw + b"0")
    for bad in bad_format:
        with pytest.raises(Rejected) as caught:
            decode(bad, key, secret)
        assert caught.value.reason == "format"
    flipped = raw[:3] + bytes([raw[3] ^ 1]) + raw[4:]
    for bad, under, with_secret in (
        (raw, "test:v2:other", secret),  # copied to another key
        (raw, key, b"another secret"),
        (flipped, key, secret),  # a float changed
    ):
        with pytest.raises(Rejected) as caught:
            decode(bad, under, with_secret)
        assert caught.value.reason == "mac"
    with pytest.raises(ValueError):
        encode(((0.5, math.inf), (0.0, 0.0)), key, secret)


def test_breaker_skips_then_lets_one_probe_through_with_doubling_waits() -> None:
    now = [0.0]
    breaker = Breaker(first_wait=1.0, max_wait=3.0, clock=lambda: now[0])
    assert breaker.allow() and breaker.closed
    assert breaker.failed() is True  # opens: skipped for 1 s
    assert breaker.failed() is False  # a call already under way: the wait stays 1 s
    assert breaker.wait == 1.0 and not breaker.allow()
    now[0] = 1.0
    assert breaker.allow()  # the probe
    assert not breaker.allow()  # one probe at a time
    breaker.failed()
    assert breaker.wait == 2.0 and not breaker.allow()
    now[0] = 3.0
    assert breaker.allow()
    breaker.failed()
    assert breaker.wait == 3.0  # capped
    now[0] = 6.0
    assert breaker.allow()
    breaker.abandoned()  # the probe's request was cancelled: it tells nothing
    assert breaker.wait == 3.0 and breaker.allow()  # so another call probes
    assert breaker.succeeded() is True and breaker.closed and breaker.allow()
    assert breaker.succeeded() is False


def test_hiredis_parses_the_replies() -> None:
    assert HIREDIS_AVAILABLE
    assert DefaultParser.__name__ == "_AsyncHiredisParser"


# --- the tier in the app ---


def test_an_answer_one_instance_computed_is_a_redis_hit_on_another(
    tiny_bert: TinyModel, redis_server: RedisServer, tmp_path: Path
) -> None:
    spec = spec_for(tiny_bert, adapters=("spam",))
    # Every answer written to disk too, so that its key can be compared with Redis's.
    settings = redis_settings(redis_server, disk_cache_admission="every")
    redis = redis_server.client()
    with (
        serving([spec], tmp_path / "disk-a", **settings) as first,
        serving([spec], tmp_path / "disk-b", **settings) as second,
    ):
        computed = first.post("/predict", json={"inputs": TEXT})
        key = expected_key(spam_identity(first), TEXT)
        wait_for(lambda: redis.exists(key) == 1, 10, "the answer written to Redis")
        shared = second.post("/predict", json={"inputs": TEXT})
        again = second.post("/predict", json={"inputs": TEXT})
        fresh = second.post("/predict", json={"inputs": TEXT, "cache": False})
        metrics = second.get("/metrics").text
    assert computed.headers["X-Cache"] == "lru=0,disk=0,redis=0,model=1"
    assert shared.headers["X-Cache"] == "lru=0,disk=0,redis=1,model=0"
    assert again.headers["X-Cache"] == "lru=1,disk=0,redis=0,model=0"  # copied into the LRU
    assert computed.json() == shared.json() == fresh.json()
    assert exposition_sum(metrics, "loraserve_cache_lookups_total", tier="redis", result="hit") == 1
    assert exposition_sum(metrics, "loraserve_cache_tier_up", tier="redis") == 1
    # The same key as the disk tier, under the prefix; a small value that expires.
    with diskcache.Cache(str(tmp_path / "disk-a")) as disk:
        assert [PREFIX + f"v{FORMAT_VERSION}:" + k for k in disk] == [key]
    assert len(redis.get(key) or b"") == 67
    assert 0 < redis.pttl(key) <= TTL_SECONDS * 1000


async def test_non_finite_answers_never_reach_redis(redis_server: RedisServer) -> None:
    metrics = Metrics(latency_target_seconds=2.0)
    tier = RedisTier(redis_server.url, PREFIX, None, 1.0, Breaker(1.0, 1.0), metrics, None)
    cache = ResultCache([tier], shared=[tier.name])
    cache.store(
        ["good", "nan", "inf"], [((1.0,), (0.0,)), ((math.nan,), (0.0,)), ((1.0,), (math.inf,))]
    )
    await cache.close()  # finishes the pending write
    assert redis_server.client().keys("*") == [tier.key("good").encode()]


async def test_a_probe_cancelled_with_its_request_leaves_the_tier_to_probe_again(
    redis_server: RedisServer,
) -> None:
    """A client that goes away cancels its request, and with it the probe it carried: the
    tier must not wait for that probe's answer for ever."""
    metrics = Metrics(latency_target_seconds=2.0)
    tier = RedisTier(redis_server.url, PREFIX, None, 0.5, Breaker(0.01, 0.01), metrics, None)
    shape = AnswerShape(labels=2)
    redis_server.freeze()
    assert await tier.get_many(["a"], shape) == [None]  # times out: the breaker opens
    await asyncio.sleep(0.05)  # past its wait: the next call is the probe
    probe = asyncio.ensure_future(tier.get_many(["a"], shape))
    await asyncio.sleep(0.1)
    probe.cancel()
    with pytest.raises(asyncio.CancelledError):
        await probe
    redis_server.thaw()
    assert tier.breaker.allow()
    await tier.close()


def test_a_frozen_redis_is_skipped_within_its_timeout_and_tried_again(
    tiny_bert: TinyModel, redis_server: RedisServer, tmp_path: Path
) -> None:
    spec = spec_for(tiny_bert, adapters=("spam",))
    settings = redis_settings(
        redis_server,
        redis_timeout_seconds=0.2,
        redis_backoff_seconds=0.5,
        redis_backoff_max_seconds=1.0,
        lru_cache_entries=0,
        disk_cache_max_bytes=0,
    )
    redis = redis_server.client()

    def predict(client: TestClient, text: str) -> tuple[int, str, float]:
        started = time.monotonic()
        response = client.post("/predict", json={"inputs": text})
        return response.status_code, response.headers["X-Cache"], time.monotonic() - started

    with serving([spec], tmp_path / "disk", **settings) as client:
        identity = spam_identity(client)
        predict(client, TEXT)
        wait_for(lambda: redis.exists(expected_key(identity, TEXT)) == 1, 10, "written")
        redis_server.freeze()
        frozen = predict(client, TEXT)  # its MGET times out: answered by the model
        skipped = predict(client, "lunch tomorrow")  # the breaker is open: no call at all
        down = client.get("/metrics").text
        redis_server.thaw()
        time.sleep(0.5)  # the backoff: the next call is the probe
        back = predict(client, TEXT)
        up = client.get("/metrics").text
    assert frozen[:2] == (200, "lru=0,disk=0,redis=0,model=1")
    assert frozen[2] < 5.0, f"a frozen Redis held a request {frozen[2]:.1f} s (timeout 0.2 s)"
    assert skipped[:2] == (200, "lru=0,disk=0,redis=0,model=1")
    assert exposition_sum(down, "loraserve_cache_errors_total", tier="redis", op="read") == 1
    assert (
        exposition_sum(down, "loraserve_cache_lookups_total", tier="redis", result="skipped") == 1
    )
    assert exposition_sum(down, "loraserve_cache_tier_up", tier="redis") == 0
    assert back[:2] == (200, "lru=0,disk=0,redis=1,model=0")
    assert exposition_sum(up, "loraserve_cache_tier_up", tier="redis") == 1


def test_redis_killed_and_restarted_under_load_fails_no_request(
    tiny_bert: TinyModel, redis_server: RedisServer, tmp_path: Path
) -> None:
    """Every text goes to Redis (LRU and disk off); Redis is killed a third of the way in
    and started again, empty, later: every request is still answered 200, the outage is
    counted, and the tier fills and answers again."""
    env = {
        "MODELS_FILE": str(tiny_models_file(tmp_path, tiny_bert, adapters=("spam",))),
        "REDIS_URL": redis_server.url,
        "REDIS_CACHE_SECRET": SECRET,
        "REDIS_TIMEOUT_SECONDS": "0.5",  # loopback answers in well under 1 ms; CI is busy
        "REDIS_BACKOFF_SECONDS": "0.5",
        "REDIS_BACKOFF_MAX_SECONDS": "1",
        "LRU_CACHE_ENTRIES": "0",
        "DISK_CACHE_MAX_BYTES": "0",
        "ADMISSION_CONTROL": "false",  # a busy CI machine must not turn this into 429s
    }
    texts = sms_texts(40)
    with run_server(env, tmp_path) as server:
        server.wait_ready()

        def outage() -> None:
            time.sleep(3)
            redis_server.kill()
            time.sleep(2.5)
            redis_server.start()

        thread = threading.Thread(target=outage)
        thread.start()
        result = run_load(server.url, clients=4, seconds=9, texts=texts)
        thread.join()
        hits = metric(server.url, "loraserve_cache_lookups_total", tier="redis", result="hit")
        skipped = metric(
            server.url, "loraserve_cache_lookups_total", tier="redis", result="skipped"
        )
        faults = metric(server.url, "loraserve_cache_errors_total", tier="redis")

        def repeat_is_a_redis_hit() -> bool:
            first = httpx.post(f"{server.url}/predict", json={"inputs": TEXT}, timeout=30)
            again = httpx.post(f"{server.url}/predict", json={"inputs": TEXT}, timeout=30)
            assert first.status_code == again.status_code == 200
            return again.headers["X-Cache"] == "lru=0,disk=0,redis=1,model=0"

        # The restarted Redis is empty: once a probe finds it, answers are written and read.
        wait_for(repeat_is_a_redis_hit, 15, "a Redis hit after the restart")
        up = metric(server.url, "loraserve_cache_tier_up", tier="redis")
    summary = result.summary()
    assert result.statuses and set(result.statuses) == {200}, summary
    assert result.transport_errors == 0, summary
    assert hits > 0 and faults > 0 and skipped > 0, (hits, faults, skipped, summary)
    assert up == 1


def test_redis_settings_are_checked() -> None:
    with pytest.raises(SettingsError, match="REDIS_URL"):
        load_settings(_env_file=None, redis_url="http://127.0.0.1:6379")
    with pytest.raises(SettingsError, match="REDIS_BACKOFF_MAX_SECONDS"):
        load_settings(_env_file=None, redis_backoff_seconds=5, redis_backoff_max_seconds=1)
    url = "redis://127.0.0.1:6379/0"
    with pytest.raises(SettingsError, match=r"REDIS_CACHE_SECRET.*REDIS_TRUSTED_NETWORK=true"):
        load_settings(_env_file=None, redis_url=url)
    with pytest.raises(SettingsError, match=r"REDIS_CACHE_SECRET: .*at least 16"):
        load_settings(_env_file=None, redis_url=url, redis_cache_secret="short")
    assert load_settings(_env_file=None, redis_url=url, redis_cache_secret=SECRET).redis_url
    assert load_settings(_env_file=None, redis_url=url, redis_trusted_network=True).redis_url
    assert load_settings(_env_file=None).redis_cache_secret is None  # no Redis, no secret
