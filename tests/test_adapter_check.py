"""An adapter checked against the loaded base before it serves: each refusal names the file
and the reason; what passes attaches, and what peft would lay out otherwise is refused with
nothing left attached."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import BertConfig, BertModel

from api.models.adapter_check import check_adapter
from api.models.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterError
from api.models.loader import LoadedModel, load_model
from api.models.predictor import Predictor
from api.models.spec import ModelsFileError, load_models_file
from tests.conftest import make_settings, spec_for
from tests.tiny_models import TinyModel, build_adapter, build_bert, tiny_models_file

MAX_RANK = 8


@pytest.fixture(scope="module")
def loaded(tiny_bert: TinyModel) -> LoadedModel:
    spec = spec_for(tiny_bert, adapters=("spam",), runtime_adapters=True, base_name="org/tiny")
    return load_model(spec, make_settings(warmup=False))


@pytest.fixture(scope="module")
def good(tiny_bert: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("good")
    return build_adapter(tiny_bert.base, root / "good", ["query", "value", "key"], seed=21)


def edit_config(folder: Path, **changes: object) -> None:
    path = folder / ADAPTER_CONFIG
    config = json.loads(path.read_text(encoding="utf-8"))
    config.update(changes)
    path.write_text(json.dumps(config), encoding="utf-8")


def edit_tensors(folder: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(folder / ADAPTER_WEIGHTS)
    change(tensors)
    save_file(tensors, folder / ADAPTER_WEIGHTS)


def other_shapes(folder: Path, tmp: Path, tiny: TinyModel) -> None:
    """An adapter trained on a narrower BERT, its config claiming the served base."""
    narrow = build_bert(tmp / "narrow-bert", seed=4)
    config = json.loads((narrow / "config.json").read_text(encoding="utf-8"))
    config.update(hidden_size=32, intermediate_size=64)
    (narrow / "config.json").write_text(json.dumps(config), encoding="utf-8")
    BertModel(BertConfig(**config)).save_pretrained(narrow, safe_serialization=True)
    shutil.rmtree(folder)
    build_adapter(narrow, folder, ["query", "value"], seed=4)
    edit_config(folder, base_model_name_or_path=str(tiny.base))


def nan_in_one(tensors: dict[str, torch.Tensor]) -> None:
    key = sorted(tensors)[0]
    tensors[key] = torch.full_like(tensors[key], float("nan"))


def no_head(folder: Path) -> None:
    edit_config(folder, modules_to_save=None)
    edit_tensors(folder, lambda t: [t.pop(k) for k in list(t) if ".classifier." in k])


def higher_rank(folder: Path, tmp: Path, tiny: TinyModel) -> None:
    shutil.rmtree(folder)
    build_adapter(tiny.base, folder, ["query", "value"], seed=5, rank=MAX_RANK * 2)


# (what is done to a good adapter's copy, the file the message names, what it says)
DAMAGES: dict[str, tuple[Callable[[Path, Path, TinyModel], None], str, str]] = {
    "no folder": (lambda f, t, m: shutil.rmtree(f), "", "no such adapter folder"),
    "no config": (
        lambda f, t, m: (f / ADAPTER_CONFIG).unlink(),
        ADAPTER_CONFIG,
        "not an adapter folder",
    ),
    "not LoRA": (
        lambda f, t, m: edit_config(f, peft_type="IA3", feedforward_modules=[]),
        ADAPTER_CONFIG,
        "is not LoRA",
    ),
    "truncated": (
        lambda f, t, m: (f / ADAPTER_WEIGHTS).write_bytes((f / ADAPTER_WEIGHTS).read_bytes()[:999]),
        ADAPTER_WEIGHTS,
        "not a readable safetensors file",
    ),
    "another base by name": (
        lambda f, t, m: edit_config(f, base_model_name_or_path="google-bert/bert-base-cased"),
        ADAPTER_CONFIG,
        "adapter for another base: trained on 'google-bert/bert-base-cased'",
    ),
    "no base named": (
        lambda f, t, m: edit_config(f, base_model_name_or_path=None),
        ADAPTER_CONFIG,
        "names no base_model_name_or_path",
    ),
    "another base by shape": (other_shapes, ADAPTER_WEIGHTS, "the base layer maps 64 → 64"),
    "rank over the limit": (
        higher_rank,
        ADAPTER_WEIGHTS,
        f"rank 16 is over the limit of {MAX_RANK}",
    ),
    "NaN": (lambda f, t, m: edit_tensors(f, nan_in_one), ADAPTER_WEIGHTS, "NaN or infinity"),
    "a tensor for nothing": (
        lambda f, t, m: edit_tensors(
            f, lambda x: x.update({"base_model.model.bert.nowhere.weight": torch.ones(2)})
        ),
        ADAPTER_WEIGHTS,
        "matches nothing in the base",
    ),
    "no head for a headless base": (lambda f, t, m: no_head(f), ADAPTER_WEIGHTS, "classifier"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_bad_adapter_is_refused_naming_the_file_and_the_reason(
    damage: str, loaded: LoadedModel, good: Path, tiny_bert: TinyModel, tmp_path: Path
) -> None:
    folder = shutil.copytree(good, tmp_path / "adapter")
    do, file_name, reason = DAMAGES[damage]
    do(folder, tmp_path, tiny_bert)
    with pytest.raises(AdapterError) as refused:
        check_adapter(folder, loaded, None, MAX_RANK)
    assert refused.value.path == (folder / file_name if file_name else folder), refused.value
    assert reason in refused.value.reason, refused.value.reason


def test_a_good_adapter_passes_with_its_digests_and_rank(
    loaded: LoadedModel, good: Path, tmp_path: Path
) -> None:
    digest = hashlib.sha256((good / ADAPTER_WEIGHTS).read_bytes()).hexdigest()
    checked = check_adapter(good, loaded, digest, MAX_RANK)
    assert checked.digests.weights == digest
    assert (
        checked.digests.config == hashlib.sha256((good / ADAPTER_CONFIG).read_bytes()).hexdigest()
    )
    assert checked.rank == 4
    with pytest.raises(AdapterError, match=f"sha256 {digest} does not match the expected"):
        check_adapter(good, loaded, "0" * 64, MAX_RANK)
    # The base may also go by the hub id the models file declares as its base_name.
    by_hub_id = shutil.copytree(good, tmp_path / "hub")
    edit_config(by_hub_id, base_model_name_or_path="org/tiny")
    assert check_adapter(by_hub_id, loaded, None, MAX_RANK).rank == 4


def test_what_peft_would_lay_out_otherwise_is_refused_with_nothing_attached(
    loaded: LoadedModel, good: Path, tmp_path: Path
) -> None:
    """The config asks for `key` too, the file carries no `key` weights: every tensor there
    fits the base, so the check passes; attaching finds peft's layout has more."""
    folder = shutil.copytree(good, tmp_path / "partial")
    edit_tensors(folder, lambda t: [t.pop(k) for k in list(t) if ".key." in k])
    checked = check_adapter(folder, loaded, None, MAX_RANK)
    predictor = Predictor(loaded)
    before = predictor.predict(["win a free prize"], "spam")
    with pytest.raises(AdapterError, match="expected tensors missing"):
        predictor.attach_adapter("partial@1", checked)
    assert list(loaded.model.peft_config) == ["spam"]
    assert predictor.predict(["win a free prize"], "spam") == before


def test_models_taking_runtime_adapters_stay_unmerged_and_declare_one_adapter(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    settings = make_settings(warmup=False)
    one_adapter = spec_for(tiny_bert, adapters=("spam",))
    assert load_model(one_adapter, settings).merged  # fp32, one adapter: merged by default
    runtime = spec_for(tiny_bert, adapters=("spam",), runtime_adapters=True)
    assert not load_model(runtime, settings).merged
    for fields in ({"adapters": ()}, {"adapters": ("spam",), "quantization": "dynamic-int8"}):
        models = tiny_models_file(tmp_path, tiny_bert, runtime_adapters=True, **fields)
        with pytest.raises(ModelsFileError, match="runtime_adapters needs at least one adapter"):
            load_models_file(models)
