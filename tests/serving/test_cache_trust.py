"""What a cache tier holds is not trusted: a shared Redis and a shared disk folder can be
written by others. On the real servers, a real redis-server and the real diskcache folder:
values that are garbage, swapped between texts, of another label count or not a softmax are
misses, computed again, overwritten and counted; a pickled disk row is never unpickled, and
one written without the disk tier's secret is never served; and a Redis without
REDIS_CACHE_SECRET is refused at start unless the network is declared trusted.
The check itself never rejects a genuine answer of the real tiny models (hypothesis)."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import random
import sqlite3
import struct
import subprocess
import sys
import time
from pathlib import Path

import diskcache
import httpx
import pytest
import torch
from diskcache.core import MODE_RAW
from hypothesis import given, settings
from hypothesis import strategies as st

from api.models.loader import load_model
from api.models.predictor import NoTokens, Predictor, Scores
from api.serving.cache.redis import FORMAT_VERSION
from api.serving.cache.verify import AnswerShape, rejection
from tests.support.in_process import make_settings, spec_for, wait_for
from tests.support.load_client import metric
from tests.support.redis_server import RedisServer
from tests.support.replicas import replicas
from tests.support.server_process import REPO_ROOT, run_server
from tests.support.tiny_models import LABELS, TinyModel, tiny_models_file

SECRET = b"a secret the replicas share"  # what tests.support.replicas.replicas sets
TEXTS = [
    "win a free prize now",
    "are we still meeting for lunch tomorrow",
    "URGENT your account is blocked call 0800",
    "see you at the station at six",
    "claim your cash reward txt WIN to 80086",
    "can you pick up milk on the way home",
    "congratulations you won a holiday",
    "running late, start without me",
    "your parcel is waiting, pay the fee at this link",
]
EMPTY = bytes([FORMAT_VERSION, 0, 0])  # 3 bytes: a value of no labels at all


def cache_digest(identity: str, text: str) -> str:
    """The cache key of a text, from its definition: sha256 of the identity, the truncation
    flag and the text, NUL-separated (the Redis key ends with it)."""
    return hashlib.sha256(f"{identity}\x00t\x00{text}\x00".encode()).hexdigest()


def signed_value(redis_key: bytes, probabilities: list[float], logits: list[float]) -> bytes:
    """A value written by the documented layout with the replicas' secret: what a replica
    with the secret (or a bug in one) could write. Version 2, label count, the float64s,
    HMAC-SHA256 over the key's length, the key and the rest."""
    values = [*probabilities, *logits]
    body = struct.pack(f"<BH{len(values)}d", FORMAT_VERSION, len(probabilities), *values)
    signed = struct.pack("<I", len(redis_key)) + redis_key + body
    return body + hmac.new(SECRET, signed, hashlib.sha256).digest()


def spam_identity(url: str) -> str:
    [model] = httpx.get(f"{url}/models", timeout=10).json()["models"]
    return next(i["digest"] for i in model["identities"] if i["adapter"] == "spam")


def predict(url: str, text: str, cache: bool = True) -> httpx.Response:
    return httpx.post(f"{url}/predict", json={"inputs": text, "cache": cache}, timeout=30)


def test_a_poisoned_redis_gives_another_replica_the_right_answers(
    tiny_bert: TinyModel, redis_server: RedisServer, tmp_path: Path
) -> None:
    redis = redis_server.client()
    # A busy test machine must not time a Redis call out: a lost write or a skipped read
    # would change what is counted.
    patient = {"REDIS_TIMEOUT_SECONDS": "5"}
    with replicas(2, tiny_bert, redis_server, tmp_path, **patient) as (first, second):
        # Each text alone (a batch of one, as every answer below), so equal means equal.
        for text in TEXTS:
            assert predict(first.url, text).status_code == 200
        wait_for(lambda: redis.dbsize() == len(TEXTS), 10, "every answer in Redis")
        identity = spam_identity(first.url)
        stored = {key: redis.get(key) for key in redis.keys("*")}
        key = {
            text: next(k for k in stored if k.decode().endswith(cache_digest(identity, text)))
            for text in TEXTS
        }
        good = {text: stored[key[text]] for text in TEXTS}

        poison = {
            TEXTS[0]: EMPTY,
            TEXTS[1]: b"abc",
            TEXTS[2]: b"",
            TEXTS[3]: struct.pack("<BH", FORMAT_VERSION, 2) + random.Random(0).randbytes(64),
            TEXTS[4]: good[TEXTS[5]],  # two texts' valid values swapped
            TEXTS[5]: good[TEXTS[4]],
            TEXTS[6]: signed_value(key[TEXTS[6]], [0.2, 0.3, 0.5], [0.0, 0.4, 0.9]),
            TEXTS[7]: signed_value(key[TEXTS[7]], [0.9, 0.1], [0.0, 0.0]),  # not a softmax
        }
        for text, value in poison.items():
            redis.set(key[text], value)

        answers = {text: predict(second.url, text) for text in TEXTS}
        reference = {text: predict(second.url, text, cache=False).json() for text in TEXTS}

        def left_poisoned() -> list[str]:
            return [text for text in poison if redis.get(key[text]) != good[text]]

        deadline = time.monotonic() + 10  # the writes are in the background
        while left_poisoned() and time.monotonic() < deadline:
            time.sleep(0.05)
        not_overwritten = left_poisoned()

        def rejected(reason: str) -> float:
            return metric(second.url, "loraserve_cache_rejected_total", tier="redis", reason=reason)

        counts = {reason: rejected(reason) for reason in ("format", "mac", "labels", "softmax")}
        hits = metric(second.url, "loraserve_cache_lookups_total", tier="redis", result="hit")
    assert reference[TEXTS[4]] != reference[TEXTS[5]]  # a swap would show
    assert {text: r.status_code for text, r in answers.items()} == dict.fromkeys(TEXTS, 200)
    assert {text: r.json() for text, r in answers.items()} == reference
    assert {text: answers[text].headers["X-Cache"] for text in TEXTS} == {
        **dict.fromkeys(poison, "lru=0,disk=0,redis=0,model=1"),
        TEXTS[8]: "lru=0,disk=0,redis=1,model=0",  # untouched: still shared
    }
    # A random tail of the right length fails the MAC (the header passes): "mac".
    assert counts == {"format": 3, "mac": 3, "labels": 1, "softmax": 1}
    assert not_overwritten == []
    assert hits == 1


def test_redis_without_a_secret_is_refused_at_start_unless_the_network_is_trusted(
    tiny_bert: TinyModel, redis_server: RedisServer, tmp_path: Path
) -> None:
    env = {
        "MODELS_FILE": str(tiny_models_file(tmp_path, tiny_bert, adapters=("spam",))),
        "REDIS_URL": redis_server.url,
    }
    refused = subprocess.run(
        [sys.executable, "-m", "api.cli"],
        cwd=tmp_path,
        env={**os.environ, **env, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2, refused.stderr
    assert "REDIS_CACHE_SECRET" in refused.stderr and "REDIS_TRUSTED_NETWORK" in refused.stderr
    # Declared trusted, it starts. What it reads is still checked: a value of no labels
    # (valid without a MAC) is a miss, computed again and counted.
    trusted = {**env, "REDIS_TRUSTED_NETWORK": "true", "LRU_CACHE_ENTRIES": "0"}
    trusted["REDIS_TIMEOUT_SECONDS"] = "5"  # a busy machine: no timed-out write or read
    with run_server({**trusted, "DISK_CACHE_MAX_BYTES": "0"}, tmp_path) as server:
        server.wait_ready()
        first = predict(server.url, TEXTS[0])
        redis = redis_server.client()
        wait_for(lambda: redis.dbsize() == 1, 10, "the answer in Redis")
        [key] = redis.keys("*")
        redis.set(key, EMPTY)
        again = predict(server.url, TEXTS[0])
        rejected = metric(
            server.url, "loraserve_cache_rejected_total", tier="redis", reason="labels"
        )
    assert first.status_code == again.status_code == 200
    assert again.headers["X-Cache"] == "lru=0,disk=0,redis=0,model=1"
    assert again.json() == first.json()
    assert rejected == 1


class Canary:
    """Unpickling it creates the file `path`: what a planted pickle could do, harmlessly."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return open, (str(self.path), "w")


def holds_text(folder: Path) -> bool:
    """Whether the disk tier's one row holds text (diskcache's MODE_RAW), read from sqlite
    directly: through the tier, a planted row would be read (and rejected) again."""
    with sqlite3.connect(folder / "cache.db") as database:
        modes = [mode for (mode,) in database.execute("SELECT mode FROM Cache")]
    return modes == [MODE_RAW]


def test_a_pickled_disk_row_is_never_unpickled_nor_its_file_deleted(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    folder, canary = tmp_path / "disk", tmp_path / "unpickled"
    victim = tmp_path / "elsewhere" / "a file the server may delete"
    victim.parent.mkdir()
    victim.write_text("still here", encoding="utf-8")
    env = {
        "MODELS_FILE": str(tiny_models_file(tmp_path, tiny_bert, adapters=("spam",))),
        "DISK_CACHE_DIR": str(folder),
        "LRU_CACHE_ENTRIES": "0",  # every read goes to the disk tier
    }
    with run_server(env, tmp_path) as server:
        server.wait_ready()

        def disk_answers() -> bool:
            return predict(server.url, TEXTS[0]).headers["X-Cache"] == "lru=0,disk=1,model=0"

        computed = predict(server.url, TEXTS[0])
        wait_for(disk_answers, 10, "the disk tier answers")
        answers = []
        # Someone who can write the folder replaces the row with a pickle: kept in the row
        # (diskcache's default for small values), then in a file of its own.
        for min_file_size in (2**15, 0):
            with diskcache.Cache(str(folder), disk_min_file_size=min_file_size) as planted:
                [key] = list(planted)
                planted.set(key, Canary(canary))
            if min_file_size == 0:  # the row names its file: make it one outside the folder
                with sqlite3.connect(folder / "cache.db") as database:
                    database.execute("UPDATE Cache SET filename = ?", (str(victim),))
            answers.append(predict(server.url, TEXTS[0]))
            # The answer is written after the writer's gathering wait: until then a read
            # would meet the planted row again (and count one more rejection).
            wait_for(lambda: holds_text(folder), 10, "the row overwritten with the answer")
            assert disk_answers()
        rejected = metric(server.url, "loraserve_cache_rejected_total", tier="disk")
        reference = predict(server.url, TEXTS[0], cache=False).json()
    assert not canary.exists(), "the server unpickled a row of its disk cache"
    assert victim.read_text(encoding="utf-8") == "still here"  # not deleted on overwrite
    assert [a.status_code for a in answers] == [200, 200]
    assert [a.headers["X-Cache"] for a in answers] == ["lru=0,disk=0,model=1"] * 2
    assert [a.json() for a in answers] == [computed.json()] * 2 == [reference] * 2
    assert rejected == 2


def disk_rows(folder: Path) -> list[tuple[str, str]]:
    """The disk tier's rows, each key and value, read from sqlite directly."""
    with sqlite3.connect(folder / "cache.db") as database:
        return list(database.execute("SELECT key, value FROM Cache"))


def disk_value(key: str, body: str, secret: bytes) -> str:
    """A disk row's value by the documented layout: HMAC-SHA256 (in hex) over the key's
    length, the key and the body, then the body (the entry as JSON text)."""
    signed = struct.pack("<I", len(key)) + key.encode() + body.encode()
    return hmac.new(secret, signed, hashlib.sha256).hexdigest() + body


def test_a_disk_row_written_without_the_secret_is_refused_and_counted(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    """Whoever can write the folder, but not read the key kept beside it, plants a
    well-formed answer of its choosing for a text: the other label's (a true softmax of the
    logits, the right label count), as a value of the format before values were signed, as
    one signed with another secret, and behind the genuine value's HMAC. None is served."""
    folder = tmp_path / "disk"
    env = {
        "MODELS_FILE": str(tiny_models_file(tmp_path, tiny_bert, adapters=("spam",))),
        "DISK_CACHE_DIR": str(folder),
        "DISK_CACHE_ADMISSION": "every",  # the first answer on disk
        "LRU_CACHE_ENTRIES": "0",  # every read goes to the disk tier
    }
    with run_server(env, tmp_path) as server:
        server.wait_ready()
        computed = predict(server.url, TEXTS[0])
        wait_for(lambda: len(disk_rows(folder)) == 1, 10, "the answer on disk")
        [(key, genuine)] = disk_rows(folder)
        signature, body = genuine[: genuine.index("[")], genuine[genuine.index("[") :]
        probabilities, logits = json.loads(body)
        flipped = (tuple(probabilities[::-1]), tuple(logits[::-1]))  # the other label wins
        chosen = json.dumps(flipped)
        planted = {
            "unsigned": chosen,
            "another secret": disk_value(key, chosen, b"a secret the service never had"),
            "the genuine HMAC": signature + chosen,
        }
        answers: dict[str, httpx.Response] = {}
        for name, value in planted.items():
            with diskcache.Cache(str(folder)) as attacker:  # diskcache's own writes
                attacker.set(key, value)
            answers[name] = predict(server.url, TEXTS[0])
            # Answered by the model, whose answer the tier then writes over the planted row.
            assert answers[name].headers["X-Cache"] == "lru=0,disk=0,model=1", name
            wait_for(lambda: disk_rows(folder) == [(key, genuine)], 10, "the row overwritten")
        disk_again = predict(server.url, TEXTS[0])

        def rejected(reason: str) -> float:
            return metric(server.url, "loraserve_cache_rejected_total", tier="disk", reason=reason)

        counts = {reason: rejected(reason) for reason in ("format", "mac", "labels", "softmax")}
    assert rejection(flipped, AnswerShape(len(LABELS))) is None  # an answer the model could give
    assert flipped != (tuple(probabilities), tuple(logits))
    assert {name: a.status_code for name, a in answers.items()} == dict.fromkeys(planted, 200)
    assert {name: a.json() for name, a in answers.items()} == dict.fromkeys(
        planted, computed.json()
    )
    assert counts == {"format": 0, "mac": 3, "labels": 0, "softmax": 0}
    # Overwritten with the service's own value, which it serves again.
    assert disk_again.headers["X-Cache"] == "lru=0,disk=1,model=0"
    assert disk_again.json() == computed.json()


# --- the check alone: genuine answers always pass, others never ---

ALPHABET = st.sampled_from("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,!?£$-")


@pytest.fixture(scope="module")
def predictors(tiny_bert: TinyModel, tiny_llama: TinyModel) -> list[Predictor]:
    """The tiny encoder (plain, and with a decision threshold that moves its second logit)
    and the tiny causal LM (label-token logits), as the service loads them."""
    specs = [
        spec_for(tiny_bert),
        spec_for(tiny_bert, decision_threshold=0.97),
        spec_for(tiny_llama),
    ]
    return [Predictor(load_model(spec, make_settings())) for spec in specs]


@settings(max_examples=20, deadline=None)
@given(texts=st.lists(st.text(ALPHABET, min_size=1, max_size=120), min_size=1, max_size=8))
def test_genuine_answers_of_the_real_tiny_models_are_never_rejected(
    predictors: list[Predictor], texts: list[str]
) -> None:
    for predictor in predictors:
        shape = AnswerShape(len(LABELS))
        for adapter in (None, "promo"):
            try:
                scores = predictor.predict(texts, adapter)
            except NoTokens:
                continue
            for one in scores:
                assert isinstance(one, Scores)
                assert rejection((one.probabilities, one.logits), shape) is None


FLOAT32 = st.floats(-1e4, 1e4, width=32)


@settings(max_examples=500, deadline=None)
@given(logits=st.lists(FLOAT32, min_size=1, max_size=300), multi_label=st.booleans())
def test_float32_softmax_and_sigmoid_of_any_logits_pass(
    logits: list[float], multi_label: bool
) -> None:
    """The predictor's own arithmetic (torch, float32) on logits far wider than a model's."""
    tensor = torch.tensor([logits], dtype=torch.float32)
    probabilities = torch.sigmoid(tensor) if multi_label else torch.softmax(tensor, dim=-1)
    entry = tuple(probabilities[0].tolist()), tuple(tensor[0].tolist())
    assert rejection(entry, AnswerShape(len(logits), multi_label)) is None


def test_anything_but_an_answer_of_the_shape_is_rejected() -> None:
    two = AnswerShape(2)
    cases = {
        "labels": ((1.0,), (0.0,)),
        "non_finite": ((0.5, float("nan")), (0.0, 0.0)),
        "range": ((1.5, -0.5), (0.0, 0.0)),
        "softmax": ((0.5, 0.5), (0.0, 1.0)),
    }
    for reason, entry in cases.items():
        found = rejection(entry, two)
        assert found is not None and found.reason == reason
    # The sigmoid of each logit is a multi-label answer, not a single-label one.
    sigmoid = ((0.5, 0.7310585786300049), (0.0, 1.0))
    assert rejection(sigmoid, AnswerShape(2, multi_label=True)) is None
    assert rejection(sigmoid, two) is not None
    # Off by a thousandth: no float32 rounding comes near.
    entry = ((0.2689414213699951 + 1e-3, 0.7310585786300049 - 1e-3), (0.0, 1.0))
    assert rejection(entry, two) is not None
