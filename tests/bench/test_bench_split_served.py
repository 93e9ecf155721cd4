"""The split as bench.split_served starts it answers as the service in one process does: the
real server, and the split's two real processes (`loraserve` with SPLIT_SOCKET and
`loraserve front-end`), asked the same requests, give the same statuses, bodies and answer
headers: the scores, the cache tiers that answered, the refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from bench.frontend import split_server, write_models_file
from bench.throughput import server

ANSWER_HEADERS = ("x-model", "x-adapter", "x-answered-by", "x-cache")
LONG_TEXT = "free prize " * 200  # past the model's 128 tokens


def requests() -> list[dict[str, Any]]:
    return [
        {"inputs": "WINNER!! Claim your free prize now"},
        {"inputs": ["see you at lunch?", "URGENT: your account is locked, call now"]},
        {"inputs": "WINNER!! Claim your free prize now"},  # again: the LRU tier answers
        {"inputs": ["see you at lunch?", "a text not seen yet"], "raw_scores": True},
        {"inputs": "a text not seen yet", "cache": False},  # the model, whatever tiers hold
        {"inputs": LONG_TEXT, "truncate": False},  # 422: too long to score whole
        {"inputs": "hello", "model": "nobody"},  # 404: no such model
        {"inputs": "hello", "adapter": "nobody"},  # the simulated model has no adapters
    ]


def answers(url: str) -> list[tuple[int, Any, dict[str, str]]]:
    found = []
    with httpx.Client(base_url=url, timeout=30) as client:
        for body in requests():
            response = client.post("/predict", json=body)
            headers = {name: response.headers.get(name, "") for name in ANSWER_HEADERS}
            found.append((response.status_code, response.json(), headers))
    return found


def test_the_split_answers_every_request_as_one_process_does(tmp_path: Path) -> None:
    env = {"MODELS_FILE": str(write_models_file(tmp_path))}
    with server("test-split-served-one", env, threads=1) as one_process:
        expected = answers(one_process.url)
    with split_server("test-split-served", env, {}) as (url, _, _):
        found = answers(url)
    statuses = [status for status, _, _ in expected]
    assert statuses[:5] == [200] * 5
    assert 422 in statuses and 404 in statuses  # refusals are compared too
    assert expected[2][2]["x-cache"] == "lru=1,disk=0,model=0"
    assert found == expected
