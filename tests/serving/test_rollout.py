"""A candidate adapter beside the default, on the real app: shadow answers nothing and changes
no answer; a canary answers its share by a hash of the text; the comparison's counts; the
guard; promotion and the way back; the admin key. Every expected count comes from asking
each adapter directly, on a server without a candidate."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from api.http.app import create_app
from api.models.spec import ModelSpec
from tests.support.in_process import make_settings, spec_for, wait_for, wait_ready
from tests.support.tiny_models import LABELS, TinyModel

ADMIN_KEY = "rollout-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
CANDIDATE_ROUTE = "/v1/adapters/tiny/candidate"


def fresh_texts(count: int, tag: str) -> list[str]:
    """Texts no test sent before (the caches hold none of them)."""
    words = ["win", "cash", "call", "now", "lunch", "meeting", "free", "prize", "mom", "bus"]
    return [
        f"{tag} {i} {words[i % 10]} {words[(i * 7) % 10]} {words[(i * 3) % 10]}"
        for i in range(count)
    ]


@contextmanager
def app_client(tiny: TinyModel, tmp_path: Path, **fields: object) -> Iterator[TestClient]:
    # Without admission by time: these tests are of answers, and on a busy machine a cold
    # server's first requests can be refused 429 (admission is measured in bench/).
    settings = make_settings(
        admin_api_key=ADMIN_KEY,
        disk_cache_dir=tmp_path / "cache",
        lru_cache_entries=0,
        admission_control=False,
    )
    app = create_app(settings, [spec_for(tiny, **fields)])
    with TestClient(app) as client:
        wait_ready(client)
        yield client


def scores_of(client: TestClient, texts: list[str], adapter: str | None = None) -> list[Any]:
    """The raw answers (label, score pairs as the server wrote them) and the X-Adapter."""
    body: dict[str, Any] = {"inputs": texts}
    if adapter is not None:
        body["adapter"] = adapter
    response = client.post("/predict", json=body)
    assert response.status_code == 200, response.text
    return [response.json(), response.headers["X-Adapter"]]


def label(answer: list[dict[str, Any]]) -> str:
    best: str = max(answer, key=lambda pair: pair["score"])["label"]
    return best


def spam_score(answer: list[dict[str, Any]]) -> float:
    score: float = next(pair["score"] for pair in answer if pair["label"] == "spam")
    return score


def assert_same(got: list[Any], want: list[Any]) -> None:
    """The same answers, to the 1e-5 every serving path keeps (RELIABILITY.md)."""
    assert len(got) == len(want)
    for mine, theirs in zip(got, want, strict=True):
        assert [pair["label"] for pair in mine] == [pair["label"] for pair in theirs]
        for a, b in zip(mine, theirs, strict=True):
            assert a["score"] == pytest.approx(b["score"], abs=1e-5)


def comparison_of(client: TestClient) -> dict[str, Any]:
    response = client.get(CANDIDATE_ROUTE)
    assert response.status_code == 200, response.text
    summary: dict[str, Any] = response.json()
    return summary


def direct(tiny: TinyModel, tmp_path: Path, texts: list[str]) -> dict[str, list[Any]]:
    """Each adapter's answers to `texts`, asked by name of a server without a candidate."""
    with app_client(tiny, tmp_path / "direct") as client:
        return {
            adapter: [
                answer for chunk in chunks(texts) for answer in scores_of(client, chunk, adapter)[0]
            ]
            for adapter in ("spam", "promo")
        }


def test_shadow_changes_no_answer_and_counts_what_each_adapter_says(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    texts = fresh_texts(120, "shadow")
    with app_client(tiny_bert, tmp_path / "plain") as plain:
        without = [
            plain.post("/predict", json={"inputs": chunk}).content for chunk in chunks(texts)
        ]
    answers = direct(tiny_bert, tmp_path, texts)
    candidate = {"adapter": "promo", "mode": "shadow", "share": 1.0}
    with app_client(tiny_bert, tmp_path / "shadow", candidate=candidate) as client:
        responses = [client.post("/predict", json={"inputs": chunk}) for chunk in chunks(texts)]
        # Identical to the bit, in the same order, answered by the default alone.
        assert [response.content for response in responses] == without
        assert {response.headers["X-Adapter"] for response in responses} == {"spam"}
        wait_for(lambda: comparison_of(client)["candidate"]["texts"] == len(texts), 20, "shadow")
        summary = comparison_of(client)
    served, tried = answers["spam"], answers["promo"]
    flips: dict[tuple[str, str], int] = {}
    for mine, theirs in zip(served, tried, strict=True):
        if label(mine) != label(theirs):
            key = (label(mine), label(theirs))
            flips[key] = flips.get(key, 0) + 1
    assert flips, "the two adapters must disagree somewhere for this test to mean anything"
    standing = summary["candidate"]
    assert summary["default_adapter"] == "spam"
    assert standing["adapter"] == "promo" and standing["served"] == "spam"
    assert standing["texts"] == len(texts)
    assert standing["agreements"] == len(texts) - sum(flips.values())
    assert {(f["from"], f["to"]): f["texts"] for f in standing["flips"]} == flips
    for side, answered in (("served", served), ("candidate", tried)):
        counted = {name: sum(label(a) == name for a in answered) for name in LABELS}
        assert standing["labels"][side] == counted
    differences = [spam_score(b) - spam_score(a) for a, b in zip(served, tried, strict=True)]
    assert standing["score_difference"]["texts"] == len(texts)
    assert standing["score_difference"]["mean"] == pytest.approx(
        sum(differences) / len(differences), abs=1e-5
    )
    below_zero = sum(d <= 0 for d in differences)
    bucket = next(b for b in standing["score_difference"]["buckets"] if b["le"] == 0.0)
    assert bucket["texts"] == below_zero


def chunks(texts: list[str], size: int = 8) -> list[list[str]]:
    return [texts[i : i + size] for i in range(0, len(texts), size)]


def test_canary_answers_its_share_by_the_text_and_the_same_text_alike(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    texts = fresh_texts(5000, "canary")
    candidate = {"adapter": "promo", "mode": "canary", "share": 0.2}
    with app_client(tiny_bert, tmp_path / "canary", candidate=candidate) as client:
        answered_by: list[str] = []
        answers: list[Any] = []
        for chunk in chunks(texts, 25):
            body, header = scores_of(client, chunk)
            names = header.split(",")
            assert len(names) in (1, len(chunk))
            answered_by += names if len(names) == len(chunk) else names * len(chunk)
            answers += body
        share = answered_by.count("promo") / len(texts)
        assert 0.18 <= share <= 0.22, share
        # The same text again, alone and among others: the same adapter, the same answer.
        again = [texts[i] for i in range(0, 200, 7)]
        body, header = scores_of(client, list(reversed(again)))
        names = header.split(",")
        names = names if len(names) == len(again) else names * len(again)
        index = {text: i for i, text in enumerate(texts)}
        for text, name in zip(reversed(again), names, strict=True):
            assert name == answered_by[index[text]]
        assert_same(body, [answers[index[text]] for text in reversed(again)])
        _, header = scores_of(client, [again[0]])
        assert header == answered_by[index[again[0]]]
    # Each answer is the adapter's it names, asked directly.
    sample = list(range(0, 5000, 25))
    truth = direct(tiny_bert, tmp_path, [texts[i] for i in sample])
    for position, i in enumerate(sample):
        assert_same([answers[i]], [truth[answered_by[i]][position]])


def test_a_guard_that_trips_rolls_the_canary_back_and_says_so(
    tiny_bert: TinyModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    texts = fresh_texts(300, "guard")
    candidate = {
        "adapter": "promo",
        "mode": "canary",
        "share": 0.5,
        "max_flip_rate": 0.0,
        "min_texts": 20,
    }
    with app_client(tiny_bert, tmp_path / "guard", candidate=candidate) as client:
        for chunk in chunks(texts, 10):
            scores_of(client, chunk)
            if comparison_of(client)["candidate"] is None:
                break
        wait_for(lambda: comparison_of(client)["candidate"] is None, 10, "the guard's rollback")
        summary = comparison_of(client)
        last = summary["last"]
        assert last["state"] == "rolled_back"
        assert last["reason"].startswith("guard: flip rate")
        assert last["texts"] >= 20 and last["flip_rate"] > 0
        metrics = client.get("/metrics").text
        assert 'loraserve_candidate_rollbacks_total{model="tiny",reason="guard"} 1.0' in metrics
        assert any("rolled back: guard" in record.getMessage() for record in caplog.records)
        # From then on the default answers every text.
        _, header = scores_of(client, fresh_texts(30, "after-guard"))
        assert header == "spam"


def test_promote_then_roll_back_serves_no_old_answer_from_a_cache(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    texts = fresh_texts(30, "promote")
    truth = direct(tiny_bert, tmp_path, texts)
    settings = make_settings(
        admin_api_key=ADMIN_KEY, disk_cache_dir=tmp_path / "cache", admission_control=False
    )
    candidate = {"adapter": "promo", "mode": "shadow", "share": 0.5}
    app = create_app(settings, [spec_for(tiny_bert, candidate=candidate)])
    with TestClient(app) as client:
        wait_ready(client)
        # The two adapters' answers are told apart on every text, well past the tolerance.
        for old, new in zip(truth["spam"], truth["promo"], strict=True):
            assert abs(spam_score(old) - spam_score(new)) > 1e-3
        before, header = scores_of(client, texts)  # now cached under the default
        assert header == "spam"
        assert_same(before, truth["spam"])
        assert client.post("/v1/adapters/tiny/promote").status_code == 401  # no admin key sent
        promoted = client.post("/v1/adapters/tiny/promote", headers=ADMIN)
        assert promoted.status_code == 200, promoted.text
        body = promoted.json()
        assert body["default_adapter"] == "promo" and body["previous_default"] == "spam"
        assert body["candidate"] is None and body["last"]["state"] == "promoted"
        after, header = scores_of(client, texts)
        assert header == "promo"
        assert_same(after, truth["promo"])  # the cache held the old default's: none served
        # The way back stays loaded, and cannot be set as a candidate of itself.
        models = client.get("/models").json()
        assert (
            next(m for m in models["models"] if m["name"] == "tiny")["default_adapter"] == "promo"
        )
        back = client.post("/v1/adapters/tiny/rollback", headers=ADMIN)
        assert back.status_code == 200, back.text
        assert back.json()["default_adapter"] == "spam"
        again, header = scores_of(client, texts)
        assert header == "spam"
        assert_same(again, truth["spam"])
        nothing = client.post("/v1/adapters/tiny/rollback", headers=ADMIN)
        assert nothing.status_code == 409, nothing.text


def test_candidates_set_through_the_admin_routes(tiny_bert: TinyModel, tmp_path: Path) -> None:
    with app_client(tiny_bert, tmp_path / "admin") as client:
        assert comparison_of(client)["candidate"] is None
        body = {"adapter": "promo", "mode": "shadow", "share": 0.25}
        assert client.put(CANDIDATE_ROUTE, json=body).status_code == 401
        started = client.put(CANDIDATE_ROUTE, json=body, headers=ADMIN)
        assert started.status_code == 200, started.text
        assert started.json()["candidate"]["share"] == 0.25
        for wrong, status in (
            ({"adapter": "nope", "mode": "shadow", "share": 0.1}, 404),
            ({"adapter": "spam", "mode": "shadow", "share": 0.1}, 409),
            ({"adapter": "promo", "mode": "shadow", "share": 1.5}, 422),
            ({"adapter": "promo", "mode": "mirror", "share": 0.1}, 422),
        ):
            response = client.put(CANDIDATE_ROUTE, json=wrong, headers=ADMIN)
            assert response.status_code == status, (wrong, response.text)
        assert comparison_of(client)["candidate"]["share"] == 0.25  # refusals changed nothing
        stopped = client.delete(CANDIDATE_ROUTE, headers=ADMIN)
        assert stopped.status_code == 200 and stopped.json()["last"]["state"] == "stopped"
        assert client.delete(CANDIDATE_ROUTE, headers=ADMIN).status_code == 404
        unknown = client.get("/v1/adapters/nosuch/candidate")
        assert unknown.status_code == 404


def test_rollout_changes_are_closed_without_an_admin_key(tiny_bert: TinyModel) -> None:
    settings = make_settings(admin_api_key=None)
    with TestClient(create_app(settings, [spec_for(tiny_bert)])) as client:
        wait_ready(client)
        body = {"adapter": "promo", "mode": "canary", "share": 0.5}
        for method, path in (
            ("PUT", CANDIDATE_ROUTE),
            ("DELETE", CANDIDATE_ROUTE),
            ("POST", "/v1/adapters/tiny/promote"),
            ("POST", "/v1/adapters/tiny/rollback"),
        ):
            refused = client.request(method, path, json=body, headers=ADMIN)
            assert refused.status_code == 403, (method, path, refused.text)
            assert "ADMIN_API_KEY" in refused.json()["error"]["message"]
        assert client.get(CANDIDATE_ROUTE).status_code == 200  # reading is no change
        assert comparison_of(client)["candidate"] is None


def test_a_merged_model_cannot_carry_a_candidate(tiny_bert: TinyModel) -> None:
    values = spec_for(tiny_bert).model_dump()
    values.update(
        quantization="dynamic-int8",
        candidate={"adapter": "promo", "mode": "shadow", "share": 0.1},
    )
    with pytest.raises(ValidationError, match="quantization: dynamic-int8"):
        ModelSpec.model_validate(values)


def test_disagreements_are_kept_only_where_the_operator_says(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    texts = fresh_texts(60, "samples")
    answers = direct(tiny_bert, tmp_path, texts)
    flipped = [
        text
        for text, mine, theirs in zip(texts, answers["spam"], answers["promo"], strict=True)
        if label(mine) != label(theirs)
    ]
    assert flipped
    folder = tmp_path / "samples"
    settings = make_settings(
        admin_api_key=ADMIN_KEY,
        lru_cache_entries=0,
        disk_cache_max_bytes=0,
        rollout_samples_dir=folder,
        rollout_samples_max=3,
        admission_control=False,
    )
    candidate = {"adapter": "promo", "mode": "shadow", "share": 1.0}
    with TestClient(create_app(settings, [spec_for(tiny_bert, candidate=candidate)])) as client:
        wait_ready(client)
        for chunk in chunks(texts):
            scores_of(client, chunk)
        wait_for(lambda: comparison_of(client)["candidate"]["texts"] == len(texts), 20, "shadow")
    lines = [
        json.loads(line) for line in (folder / "tiny" / "promo.jsonl").read_text().splitlines()
    ]
    assert len(lines) == min(3, len(flipped))
    for line in lines:
        assert line["text"] in flipped and line["served"] == "spam"
        assert line["served_label"] != line["candidate_label"]


def test_promote_and_roll_back_under_load(tiny_bert: TinyModel, tmp_path: Path) -> None:
    texts = fresh_texts(24, "load")
    truth = direct(tiny_bert, tmp_path, texts)
    answers = {adapter: dict(zip(texts, truth[adapter], strict=True)) for adapter in truth}
    settings = make_settings(
        admin_api_key=ADMIN_KEY, disk_cache_dir=tmp_path / "cache", admission_control=False
    )
    candidate = {"adapter": "promo", "mode": "canary", "share": 0.3}
    app = create_app(settings, [spec_for(tiny_bert, candidate=candidate)])
    seen: list[tuple[int, str, str, Any]] = []
    stop = threading.Event()

    def load(client: TestClient, worker: int) -> None:
        turn = 0
        while not stop.is_set():
            chunk = [texts[(worker * 5 + turn + i) % len(texts)] for i in range(3)]
            response = client.post("/predict", json={"inputs": chunk})
            names = response.headers.get("X-Adapter", "").split(",")
            names = names if len(names) == len(chunk) else names * len(chunk)
            body = response.json() if response.status_code == 200 else None
            for i, text in enumerate(chunk):
                answer = None if body is None else body[i]
                seen.append((response.status_code, text, names[i], answer))
            turn += 1

    with TestClient(app) as client:
        wait_ready(client)
        with ThreadPoolExecutor(4) as pool:
            workers = [pool.submit(load, client, worker) for worker in range(4)]
            steps = []
            for method, path, body in (
                ("POST", "/v1/adapters/tiny/promote", None),
                ("POST", "/v1/adapters/tiny/rollback", None),
                ("PUT", CANDIDATE_ROUTE, candidate),
                ("POST", "/v1/adapters/tiny/promote", None),
            ):
                time.sleep(0.4)
                steps.append(client.request(method, path, json=body, headers=ADMIN))
            time.sleep(0.4)
            stop.set()
            for worker in workers:
                worker.result()
        assert [step.status_code for step in steps] == [200] * 4, [s.text for s in steps]
        assert comparison_of(client)["default_adapter"] == "promo"
    assert len(seen) > 100
    assert {status for status, *_ in seen} == {200}
    assert {name for _, _, name, _ in seen} == {"spam", "promo"}
    for _, text, name, answer in seen:  # each answer is the one of the adapter it names
        assert_same([answer], [answers[name][text]])


def test_an_adapter_in_a_rollout_stays_loaded(tiny_bert: TinyModel, tmp_path: Path) -> None:
    settings = make_settings(
        admin_api_key=ADMIN_KEY,
        adapter_roots=[tiny_bert.adapters["promo"].parent],
        admission_control=False,
    )
    spec = spec_for(tiny_bert, adapters=("spam",), runtime_adapters=True)
    with TestClient(create_app(settings, [spec])) as client:
        wait_ready(client)
        body = {"lora_name": "fresh", "lora_path": str(tiny_bert.adapters["promo"])}
        assert client.post("/v1/load_lora_adapter", json=body, headers=ADMIN).status_code == 200
        candidate = {"adapter": "fresh", "mode": "shadow", "share": 0.5}
        assert client.put(CANDIDATE_ROUTE, json=candidate, headers=ADMIN).status_code == 200
        unload = {"lora_name": "fresh"}
        refused = client.post("/v1/unload_lora_adapter", json=unload, headers=ADMIN)
        assert refused.status_code == 409 and "rollout" in refused.json()["error"]["message"]
        assert client.post("/v1/adapters/tiny/promote", headers=ADMIN).status_code == 200
        _, header = scores_of(client, fresh_texts(4, "fresh"))
        assert header == "fresh"
        refused = client.post("/v1/unload_lora_adapter", json=unload, headers=ADMIN)
        assert refused.status_code == 409 and "default" in refused.json()["error"]["message"]
        assert client.post("/v1/adapters/tiny/rollback", headers=ADMIN).status_code == 200
        done = client.post("/v1/unload_lora_adapter", json=unload, headers=ADMIN)
        assert done.status_code == 200, done.text
