"""The real `loraserve` process on loopback: start-up, predictions, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from api.models.spec import EMBEDDED_MODELS_FILE
from tests.support.server_process import run_server
from tests.support.tiny_models import TinyModel, tiny_models_file


def test_server_process_serves_a_tiny_llama_in_8bit_and_exits_0_on_sigterm(
    tiny_llama: TinyModel, tmp_path: Path
) -> None:
    models = tiny_models_file(tmp_path, tiny_llama, quantization="int8")
    with run_server({"MODELS_FILE": str(models)}, tmp_path) as server:
        statuses = server.wait_ready()
        assert set(statuses) <= {200, 503} and statuses[-1] == 200
        response = httpx.post(
            f"{server.url}/predict", json={"inputs": ["win a prize", "lunch"], "adapter": "promo"}
        )
        assert response.status_code == 200
        assert [len(row) for row in response.json()] == [2, 2]
        model = httpx.get(f"{server.url}/models").json()["models"][0]
        assert model["quantization"] == "int8" and model["adapters"] == ["spam", "promo"]
        assert server.stop() == 0


def test_server_exits_non_zero_when_a_model_fails_to_load(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    models = tiny_models_file(tmp_path, tiny_bert, weights_sha256={"model.safetensors": "0" * 64})
    with run_server({"MODELS_FILE": str(models)}, tmp_path) as server:
        code = server.process.wait(timeout=120)
        assert code == 1
        log = server.log()
        assert "model 'tiny'" in log and "model.safetensors" in log and "sha256" in log


def test_server_refuses_invalid_settings_naming_them(tmp_path: Path) -> None:
    with run_server({"MAX_TEXTS_PER_REQUEST": "many"}, tmp_path) as server:
        assert server.process.wait(timeout=60) == 2
        assert "MAX_TEXTS_PER_REQUEST" in server.log()


def chosen(model: str, *keys: str) -> object:
    """A value the model's training run wrote into its eval.json."""
    value: object = json.loads((EMBEDDED_MODELS_FILE.parent / model / "eval.json").read_text())
    for key in keys:
        value = value[key]  # type: ignore[index]
    return value


def threshold(model: str) -> object:
    """The decision threshold the model's training run chose; None before runs chose one."""
    report = chosen(model)
    assert isinstance(report, dict)
    return report.get("evaluation", {}).get("decision_threshold", {}).get("threshold")


SPAM = "WINNER!! Claim your free prize now, call 09061701461"
HAM = "Are we still meeting for lunch tomorrow?"


def test_embedded_default_models_tell_spam_from_ham(tmp_path: Path) -> None:
    with run_server({}, tmp_path) as server:
        server.wait_ready()
        for model in (None, "spam-minilm", "spam-smollm2", "cascade"):
            body = {"inputs": [SPAM, HAM], "cache": False} | ({"model": model} if model else {})
            response = httpx.post(f"{server.url}/predict", json=body, timeout=30)
            spam, ham = response.json()
            assert spam[0]["label"] == "spam" and spam[0]["score"] > 0.9, (model, spam)
            assert ham[0]["label"] == "ham" and ham[0]["score"] > 0.9, (model, ham)
        # Both sure of these: the cascade's encoder answered both, the LLM none.
        assert response.headers["X-Answered-By"] == "spam-minilm,spam-minilm"

        models = {m["name"]: m for m in httpx.get(f"{server.url}/models").json()["models"]}
        assert list(models) == ["spam-minilm", "spam-smollm2"]
        assert models["spam-minilm"]["packed_batches"]
        assert not models["spam-smollm2"]["packed_batches"]
        llm = models["spam-smollm2"]
        assert llm["architecture"] == "LlamaForSequenceClassification"
        assert llm["quantization"] == "nf4" and llm["adapter_mode"] == "unmerged"
        assert llm["adapters"] == ["spam"] and llm["load_seconds"]["warmup"] > 0
        info = httpx.get(f"{server.url}/info").json()
        # The thresholds the training runs chose (their eval.json), as the models file keeps them.
        assert info["cascade"] == {
            "first": "spam-minilm",
            "second": "spam-smollm2",
            "threshold": round(float(chosen("spam-smollm2", "cascade", "threshold")), 6),  # type: ignore[arg-type]
            "threshold_source": "models file",
        }
        assert info["decision_thresholds"] == {
            name: threshold(name) for name in ("spam-minilm", "spam-smollm2")
        }
        assert server.stop() == 0
