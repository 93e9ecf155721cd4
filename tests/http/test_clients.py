"""Real clients, unmodified, against the real server process on loopback: Hugging Face's
InferenceClient (sync and async) at the server's base URL and at /predict, and curl."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import subprocess
from collections.abc import Iterator

import httpx
import pytest
from huggingface_hub import AsyncInferenceClient, InferenceClient

from tests.support.server_process import ServerProcess, run_server
from tests.support.tiny_models import embedded_encoder_file

# The examples of docs/api.md.
SPAM = "WINNER!! Claim your £900 prize now"
HAM = "Lunch tomorrow?"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("clients")
    env = {"MODELS_FILE": str(embedded_encoder_file(folder)), "DISK_CACHE_MAX_BYTES": "0"}
    with run_server(env, folder) as process:
        process.wait_ready()
        yield process


def raw_logits(server: ServerProcess, text: str) -> dict[str, float]:
    response = httpx.post(f"{server.url}/predict", json={"inputs": text, "raw_scores": True})
    return {item["label"]: item["score"] for item in response.json()}


@pytest.mark.parametrize("path", ["", "/predict"], ids=["base-url", "predict"])
def test_inference_client_text_classification(server: ServerProcess, path: str) -> None:
    client = InferenceClient(f"{server.url}{path}")
    spam = client.text_classification(SPAM)
    ham = client.text_classification(HAM)
    assert spam[0].label == "spam" and spam[0].score > 0.5
    assert ham[0].label == "ham" and ham[0].score > 0.5
    assert math.isclose(sum(item.score for item in spam), 1.0, rel_tol=1e-6)

    (best,) = client.text_classification(SPAM, top_k=1)
    assert best.label == "spam" and best.score == spam[0].score

    logits = raw_logits(server, SPAM)
    sigmoid = client.text_classification(SPAM, function_to_apply="sigmoid")
    for item in sigmoid:
        assert math.isclose(item.score, 1 / (1 + math.exp(-logits[item.label])), rel_tol=1e-6)
    untouched = client.text_classification(SPAM, function_to_apply="none")
    assert {item.label: item.score for item in untouched} == logits


def test_async_inference_client(server: ServerProcess) -> None:
    async def classify() -> list[str]:
        client = AsyncInferenceClient(server.url)
        answers = await asyncio.gather(
            client.text_classification(SPAM, top_k=1), client.text_classification(HAM, top_k=1)
        )
        return [answer[0].label for answer in answers]

    assert asyncio.run(classify()) == ["spam", "ham"]


def test_unknown_parameters_and_left_truncation_are_refused_by_name(
    server: ServerProcess,
) -> None:
    unknown = httpx.post(server.url, json={"inputs": HAM, "parameters": {"temperature": 0.5}})
    assert unknown.status_code == 422
    assert "parameters.temperature" in unknown.json()["error"]["message"]
    left = httpx.post(server.url, json={"inputs": HAM, "truncation_direction": "Left"})
    assert left.status_code == 422
    assert "truncation_direction" in left.json()["error"]["message"]


def test_info_has_the_fields_tei_gives_a_classifier(server: ServerProcess) -> None:
    info = httpx.get(f"{server.url}/info").json()
    assert info["model_type"] == {
        "classifier": {"id2label": {"0": "ham", "1": "spam"}, "label2id": {"ham": 0, "spam": 1}}
    }
    assert info["max_input_length"] == 128 and info["model_id"].endswith("model")
    assert info["max_client_batch_size"] == 32 and info["max_batch_requests"] == 32
    assert info["max_batch_tokens"] == 2048 and info["model_dtype"] == "float32"  # CPU default


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl (Debian package curl)")
def test_the_documented_curl_example_answers_a_list(server: ServerProcess) -> None:
    body = json.dumps({"inputs": [SPAM, HAM], "top_k": 1}, ensure_ascii=False)
    output = subprocess.run(
        ["curl", "-s", f"{server.url}/predict", "-H", "Content-Type: application/json", "-d", body],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    answers = json.loads(output)
    assert [answer[0]["label"] for answer in answers] == ["spam", "ham"]
