"""The simulated device: declared only in a models file, served through the real server's
batcher, cache, admission and metrics, with scores that depend on the text alone."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from api.models.simulated import SimulatedPredictor, hashed_logits, load_simulated
from api.models.spec import ModelsFileError, load_models_file
from api.settings import load_settings
from tests.support.load_client import metric
from tests.support.server_process import ServerProcess, run_server
from tests.support.tiny_models import SIMULATED, TinyModel, simulated_entry, write_models_file


def predict(server: ServerProcess, texts: list[str], **fields: object) -> httpx.Response:
    return httpx.post(f"{server.url}/predict", json={"inputs": texts, **fields}, timeout=30)


def by_label(answer: list[dict[str, object]]) -> dict[object, object]:
    return {entry["label"]: entry["score"] for entry in answer}


def test_a_simulated_model_uses_the_embedded_bases_tokenizer(tmp_path: Path) -> None:
    (spec,) = load_models_file(write_models_file(tmp_path / "m.yaml", [simulated_entry()]))
    embedded = load_models_file(None)[0]
    assert spec.simulated is not None and spec.base is None
    assert spec.tokenizer == embedded.base  # the same resolved folder


def test_tokenizer_names_another_folder_and_its_ids_are_the_ones_scored(
    tiny_bert: TinyModel,
) -> None:
    # Relative to the models file, as every path in it.
    models = tiny_bert.base.parent / "simulated-models.yaml"
    write_models_file(models, [simulated_entry(tokenizer=f"./{tiny_bert.base.name}")])
    (spec,) = load_models_file(models)
    assert spec.tokenizer == str(tiny_bert.base.resolve())
    predictor = SimulatedPredictor(load_simulated(spec))
    texts = ["win a free prize now", "see you at lunch"]
    reference = AutoTokenizer.from_pretrained(str(tiny_bert.base))(texts)["input_ids"]
    assert predictor.encode(texts) == reference
    scores = predictor.predict(texts)
    assert [s.logits for s in scores] == [  # every row finite: Scores
        pytest.approx(hashed_logits(ids, 2), rel=1e-6) for ids in reference
    ]


@pytest.mark.parametrize(
    ("entry", "reason"),
    [
        # A real model with the costs in another key: the key is not one a model has.
        (
            {"name": "real", "base": "some/model", "device": SIMULATED, "labels": ["a", "b"]},
            "device",
        ),
        # Costs at the top level of the entry are no declaration either.
        ({"name": "real", "base": "some/model", **SIMULATED}, "seconds_per_batch"),
        # `simulated` is the costs, never a switch.
        ({"name": "sim", "simulated": True, "labels": ["a", "b"]}, "simulated"),
        ({"name": "sim", "simulated": "yes", "labels": ["a", "b"]}, "simulated"),
        ({"name": "sim", "simulated": {"seconds_per_batch": 0.1}, "labels": ["a", "b"]}, "token"),
        # Simulated and real at once: it loads no weights, so a base cannot apply.
        (simulated_entry(base="some/model"), "base cannot apply"),
        (simulated_entry(adapters=[{"name": "spam", "path": "x"}]), "adapters cannot apply"),
        (simulated_entry(quantization="nf4"), "quantization cannot apply"),
        ({"name": "sim", "simulated": dict(SIMULATED)}, "needs its labels"),
        # A tokenizer of its own is a simulated model's only: a real one uses its base's.
        ({"name": "real", "base": "some/model", "tokenizer": "other"}, "tokenizer"),
        # Neither base nor simulated: nothing to serve.
        ({"name": "real", "labels": ["a", "b"]}, "base is required"),
        (simulated_entry(simulated={**SIMULATED, "seconds_per_batch": -1}), "seconds_per_batch"),
    ],
)
def test_only_an_explicit_simulated_declaration_makes_a_simulated_model(
    tmp_path: Path, entry: dict[str, object], reason: str
) -> None:
    with pytest.raises(ModelsFileError, match=reason):
        load_models_file(write_models_file(tmp_path / "m.yaml", [entry]))


def test_no_setting_declares_a_simulated_model(
    monkeypatch: pytest.MonkeyPatch, tiny_bert: TinyModel, tmp_path: Path
) -> None:
    # Settings read the environment and .env; none of them names a simulated device, and an
    # unknown variable changes nothing about the models the file declares.
    real = {"name": "real", "base": str(tiny_bert.base), "labels": ["ham", "spam"]}
    models = write_models_file(tmp_path / "m.yaml", [real])
    monkeypatch.setenv("SIMULATED", "true")
    monkeypatch.setenv("MODELS_FILE", str(models))
    settings = load_settings()
    assert not any("simulat" in name for name in type(settings).model_fields)
    (spec,) = load_models_file(settings.models_file)
    assert spec.simulated is None


@pytest.fixture
def sim_server(tmp_path: Path) -> Iterator[ServerProcess]:
    models = write_models_file(tmp_path / "models.yaml", [simulated_entry()])
    with run_server({"MODELS_FILE": str(models), "MAX_BATCH_WAIT_SECONDS": "0.05"}, tmp_path) as s:
        s.wait_ready()
        yield s


def test_models_says_simulated_and_the_identity_holds_its_costs(sim_server: ServerProcess) -> None:
    (info,) = httpx.get(f"{sim_server.url}/models", timeout=10).json()["models"]
    assert info["simulated"] == SIMULATED
    assert info["base"] is None and info["weight_bytes"] == 0 and info["adapters"] == []
    assert info["batch_max_logit_difference"] == 0.0
    # The declared cost's own overhead: 0.002 s a batch over 1 µs a token.
    assert info["batch_overhead_tokens"] == pytest.approx(2000)
    (identity,) = info["identities"]
    assert identity["components"]["simulated"] == SIMULATED
    assert identity["components"]["device_type"] == "meta"


def test_scores_depend_on_the_text_alone(sim_server: ServerProcess) -> None:
    texts = [f"message number {n} about a free prize" for n in range(12)]
    together = predict(sim_server, texts, cache=False, raw_scores=True)
    assert together.status_code == 200, together.text
    alone = [predict(sim_server, [text], cache=False, raw_scores=True) for text in texts[:4]]

    async def concurrently() -> list[httpx.Response]:
        # One text each from many clients at once: the batcher puts them in shared batches.
        async with httpx.AsyncClient(base_url=sim_server.url, timeout=30) as client:
            return list(
                await asyncio.gather(
                    *(client.post("/predict", json={"inputs": [t], "cache": False}) for t in texts)
                )
            )

    mixed = asyncio.run(concurrently())
    logits = [by_label(answer) for answer in together.json()]
    assert [by_label(r.json()[0]) for r in alone] == logits[:4]
    assert len({tuple(sorted(answer.items())) for answer in logits}) == len(texts)  # all differ
    for answer, response in zip(logits, mixed, strict=True):
        probabilities = by_label(response.json()[0])
        ham, spam = float(answer["ham"]), float(answer["spam"])  # type: ignore[arg-type]
        # The softmax of the logits, computed here: the probabilities are a model's.
        expected_spam = 1 / (1 + math.exp(ham - spam))
        assert probabilities["spam"] == pytest.approx(expected_spam, rel=1e-5)
        assert probabilities["ham"] == pytest.approx(1 - expected_spam, rel=1e-5)
    batches = metric(sim_server.url, "loraserve_batch_size_count", model="sim")
    rows = metric(sim_server.url, "loraserve_batch_size_sum", model="sim")
    assert rows > batches  # some batch held several texts


def test_concurrent_requests_get_their_own_ids_and_refusals(sim_server: ServerProcess) -> None:
    """Requests that arrive together are tokenized together (api/serving/gathered_encoding):
    each is still scored on the ids transformers gives its own texts, and a text refused for
    its length fails only its own request, naming its index there."""
    embedded = load_models_file(None)[0]  # whose tokenizer a simulated model uses
    reference = AutoTokenizer.from_pretrained(embedded.base)
    texts = [f"claim your prize number {n} now " * (1 + n % 3) for n in range(15)]
    too_long = "word " * 200  # over max_length (128) once tokenized
    # Sent the moment the server is ready: admission judges them on the declared cost.

    async def together() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=sim_server.url, timeout=30) as client:
            calls = [
                client.post(
                    "/predict",
                    json={"inputs": [text], "cache": False, "raw_scores": True, "truncate": False},
                )
                for text in texts
            ]
            refused = {"inputs": ["ok", too_long], "cache": False, "truncate": False}
            calls.insert(7, client.post("/predict", json=refused))
            return list(await asyncio.gather(*calls))

    responses = asyncio.run(together())
    refusal = responses.pop(7)
    assert refusal.status_code == 422, refusal.text
    assert "inputs[1]" in refusal.text
    ids = reference(texts)["input_ids"]
    for row, response in zip(ids, responses, strict=True):
        assert response.status_code == 200, response.text
        logits = by_label(response.json()[0])
        assert [logits["ham"], logits["spam"]] == pytest.approx(hashed_logits(row, 2), rel=1e-6)


def test_the_cache_answers_repeats_on_it(sim_server: ServerProcess) -> None:
    first = predict(sim_server, ["call now to claim"])
    hits_before = metric(sim_server.url, "loraserve_cache_lookups_total", result="hit")
    again = predict(sim_server, ["call now to claim"])
    assert again.json() == first.json()
    assert first.headers["x-cache"].endswith("model=1")
    assert again.headers["x-cache"].startswith("lru=1")
    hits = metric(sim_server.url, "loraserve_cache_lookups_total", result="hit")
    assert hits == hits_before + 1


def test_admission_refuses_when_its_cost_makes_the_target_unreachable(tmp_path: Path) -> None:
    slow = simulated_entry(simulated={"seconds_per_batch": 0.3, "seconds_per_token": 0.0})
    models = write_models_file(tmp_path / "models.yaml", [slow])
    env = {
        "MODELS_FILE": str(models),
        "LATENCY_TARGET_SECONDS": "0.5",
        "MAX_BATCH_SIZE": "2",
        "LRU_CACHE_ENTRIES": "0",
        "DISK_CACHE_MAX_BYTES": "0",
    }
    with run_server(env, tmp_path) as server:
        server.wait_ready()  # and no batch served: the fit starts from the declared cost

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                return list(
                    await asyncio.gather(
                        *(client.post("/predict", json={"inputs": [f"t{n}"]}) for n in range(12))
                    )
                )

        statuses = [response.status_code for response in asyncio.run(burst())]
        refused = statuses.count(429)
        # Three batches of 0.3 s cannot finish within 3/4 of a 0.5 s target: most are refused.
        assert refused >= 6 and statuses.count(200) >= 1, statuses
        assert set(statuses) == {200, 429}
        assert metric(server.url, "loraserve_admission_refusals_total", model="sim") == refused
