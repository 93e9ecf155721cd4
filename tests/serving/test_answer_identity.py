"""No cache answers what the model as configured now would not: each change that moves the
numbers gives a new answer identity, so a disk cache that survives a restart misses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from api.models.spec import AdapterSpec, ModelSpec
from tests.support.in_process import serving, spec_for
from tests.support.tiny_models import TinyModel

TEXT = {"inputs": "win a free prize now", "raw_scores": True}


def answer(specs: list[ModelSpec], cache_dir: Path, **body: object) -> tuple[object, str]:
    """The scores and X-Cache of one request to a freshly started server."""
    with serving(specs, cache_dir) as client:
        response = client.post("/predict", json={**TEXT, **body})
    assert response.status_code == 200, response.text
    return response.json(), response.headers["X-Cache"]


def one_adapter(tiny: TinyModel, folder: Path, **fields: object) -> ModelSpec:
    """The tiny BERT with one adapter read from `folder`."""
    spec = spec_for(tiny, adapters=("spam",), **fields)
    return spec.model_copy(update={"adapters": [AdapterSpec(name="spam", path=folder)]})


@pytest.fixture
def adapter_copy(tiny_bert: TinyModel, tmp_path: Path) -> Path:
    folder = tmp_path / "adapter"
    shutil.copytree(tiny_bert.adapters["spam"], folder)
    return folder


def test_a_changed_adapter_config_with_the_same_weights_misses(
    tiny_bert: TinyModel, adapter_copy: Path, tmp_path: Path
) -> None:
    spec = one_adapter(tiny_bert, adapter_copy)
    old, _ = answer([spec], tmp_path / "cache")
    config_file = adapter_copy / "adapter_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["lora_alpha"] = config["lora_alpha"] * 4  # same weights, a 4× larger LoRA delta
    config_file.write_text(json.dumps(config), encoding="utf-8")

    new, tier = answer([spec], tmp_path / "cache")
    reference, _ = answer([spec], tmp_path / "fresh-cache")

    assert tier == "lru=0,disk=0,model=1"
    assert new == reference and new != old


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ({"quantization": "none"}, {"quantization": "dynamic-int8"}),
        ({"dtype": "float32"}, {"dtype": "bfloat16"}),
    ],
    ids=["quantization", "dtype"],
)
def test_a_changed_numerics_choice_misses(
    tiny_bert: TinyModel,
    tmp_path: Path,
    before: dict[str, object],
    after: dict[str, object],
) -> None:
    first = one_adapter(tiny_bert, tiny_bert.adapters["spam"], **before)
    second = one_adapter(tiny_bert, tiny_bert.adapters["spam"], **after)
    old, _ = answer([first], tmp_path / "cache")
    new, tier = answer([second], tmp_path / "cache")
    reference, _ = answer([second], tmp_path / "fresh-cache")
    assert tier == "lru=0,disk=0,model=1"
    assert new == reference and new != old


def test_two_models_over_the_same_base_and_adapter_never_share_answers(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    # An A/B of two quantizations of one base and adapter, served side by side.
    full = one_adapter(tiny_bert, tiny_bert.adapters["spam"], name="full")
    int8 = one_adapter(tiny_bert, tiny_bert.adapters["spam"], name="int8")
    int8 = int8.model_copy(update={"quantization": "dynamic-int8"})
    with serving([full, int8], tmp_path / "cache") as client:
        from_full = client.post("/predict", json={**TEXT, "model": "full"})
        from_int8 = client.post("/predict", json={**TEXT, "model": "int8"})
        listed = client.get("/models").json()["models"]
    assert from_int8.headers["X-Cache"] == "lru=0,disk=0,model=1"
    assert from_full.json() != from_int8.json()
    digests = [model["identities"][0]["digest"] for model in listed]
    assert len(set(digests)) == 2
    components = listed[1]["identities"][0]["components"]
    assert components["quantization"] == "dynamic-int8"
    assert components["adapter_config"] and components["adapter_weights"]
    assert set(components["versions"]) == {"torch", "transformers", "peft", "bitsandbytes"}


def test_the_cascade_caches_under_its_models_default_adapters(
    tiny_bert: TinyModel, adapter_copy: Path, tmp_path: Path
) -> None:
    first = one_adapter(tiny_bert, adapter_copy, name="first")
    second = one_adapter(tiny_bert, tiny_bert.adapters["promo"], name="second")
    body = {"model": "cascade"}
    # Threshold 0.5: two labels always reach it, so the first model answers every text.
    with serving([first, second], tmp_path / "cache", cascade_threshold=0.5) as client:
        old = client.post("/predict", json={**TEXT, **body}).json()
        # The same servable asked directly, naming its adapter: one identity, one entry.
        direct = client.post("/predict", json={**TEXT, "model": "first", "adapter": "spam"})
    assert direct.headers["X-Cache"] == "lru=1,disk=0,model=0" and direct.json() == old

    # A retrained adapter copied over the first model's: same path, same name, new weights.
    shutil.copy(tiny_bert.adapters["promo"] / "adapter_model.safetensors", adapter_copy)
    with serving([first, second], tmp_path / "cache", cascade_threshold=0.5) as client:
        response = client.post("/predict", json={**TEXT, **body})
    with serving([first, second], tmp_path / "fresh-cache", cascade_threshold=0.5) as client:
        reference = client.post("/predict", json={**TEXT, **body}).json()
    assert response.headers["X-Cache"] == "lru=0,disk=0,model=1"
    assert response.json() == reference and response.json() != old
