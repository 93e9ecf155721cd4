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
from tests.support.in_process import make_settings, spec_for
from tests.support.tiny_models import TinyModel, build_adapter, build_bert, tiny_models_file

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


# (field, value) a trainer may have saved, refused with the field named: each rewrites the
# base every adapter shares, or is not a LoRA delta this service serves (peft 0.21).
REFUSED_FIELDS: list[tuple[str, object]] = [
    ("init_lora_weights", "pissa"),
    ("init_lora_weights", "pissa_niter_4"),
    ("init_lora_weights", "olora"),
    ("init_lora_weights", "corda"),
    ("init_lora_weights", "loftq"),
    ("init_lora_weights", "mica"),
    ("init_lora_weights", "lora_ga"),
    ("layer_replication", [[0, 2], [1, 2]]),
    ("loftq_config", {"loftq_bits": 4}),
    ("corda_config", {"corda_method": "ipm"}),
    ("kasa_config", {"truncation_rank": 2}),
    ("kasa_config", {}),  # not null: peft makes it KaSA's default config, and truncates
    ("velora_config", {}),
    ("use_dora", 1),
    ("bias", "all"),
    ("bias", "lora_only"),
    ("use_dora", True),
    ("lora_bias", True),
    ("trainable_token_indices", [1, 2]),
    ("target_parameters", ["bert.encoder.layer.0.attention.self.query.weight"]),
    ("ensure_weight_tying", True),
    ("megatron_config", {"tensor_model_parallel_size": 1}),
    ("megatron_core", "os"),
    ("alora_invocation_tokens", [5]),
    ("use_qalora", True),
    ("modules_to_save", ["classifier", "embeddings"]),
    ("a_field_of_a_later_peft", 1),
]


@pytest.mark.parametrize(("field", "value"), REFUSED_FIELDS, ids=lambda v: str(v)[:24])
def test_a_config_field_that_is_not_a_plain_lora_delta_is_refused_naming_it(
    field: str, value: object, loaded: LoadedModel, good: Path, tmp_path: Path
) -> None:
    folder = shutil.copytree(good, tmp_path / "adapter")
    edit_config(folder, **{field: value})
    with pytest.raises(AdapterError) as refused:
        check_adapter(folder, loaded, None, MAX_RANK)
    assert refused.value.path == folder / ADAPTER_CONFIG, refused.value
    assert field in refused.value.reason, refused.value.reason


@pytest.mark.parametrize("init", ["gaussian", "orthogonal", "eva", True])
def test_a_plain_init_serves_exactly_what_the_weights_say(
    init: object, loaded: LoadedModel, good: Path, tmp_path: Path
) -> None:
    """Each plain init touches lora_A and lora_B only, which the file's weights replace: the
    answers are the bits of the same adapter saved with init_lora_weights false."""
    predictor = Predictor(loaded)
    answers = {}
    for name, fields in (("plain", {}), ("init", {"init_lora_weights": init})):
        folder = shutil.copytree(good, tmp_path / name)
        edit_config(folder, **fields)
        predictor.attach_adapter(f"{name}@1", check_adapter(folder, loaded, None, MAX_RANK))
        answers[name] = predictor.predict(["win a free prize", "see you at home"], f"{name}@1")
        predictor.detach_adapter(f"{name}@1")
    assert answers["init"] == answers["plain"]


def test_a_failure_half_way_through_an_attach_leaves_nothing_of_the_adapter_behind(
    loaded: LoadedModel, good: Path, tmp_path: Path
) -> None:
    """An alpha peft cannot divide by, for the last layer it adapts: peft has added the
    adapter to the layers before when it fails (a TypeError), and forgets only its config."""
    folder = shutil.copytree(good, tmp_path / "half")
    edit_config(folder, alpha_pattern={"layer.1.attention.self.value": "eight"})
    checked = check_adapter(folder, loaded, None, MAX_RANK)
    predictor = Predictor(loaded)
    texts = ["win a free prize", "see you at home", "txt stop to claim"]
    before = predictor.predict(texts, "spam")
    weights = {key: value.clone() for key, value in loaded.model.state_dict().items()}
    with pytest.raises(Exception) as failed:
        predictor.attach_adapter("half@1", checked)
    after = loaded.model.state_dict()
    assert [key for key in after if "half@1" in key] == []
    assert list(after) == list(weights)
    assert all(torch.equal(after[key], value) for key, value in weights.items())
    tables = ("lora_A", "lora_B", "lora_dropout", "scaling", "r", "lora_alpha", "use_dora")
    per_adapter = (dict, torch.nn.ModuleDict, torch.nn.ParameterDict)
    held = [
        (module_name, table)
        for module_name, module in loaded.model.named_modules()
        for table in tables
        if isinstance(found := getattr(module, table, None), per_adapter) and "half@1" in found
    ]
    assert held == []
    assert "half@1" not in loaded.model.peft_config
    assert predictor.predict(texts, "spam") == before
    assert isinstance(failed.value, AdapterError), failed.value
    assert "TypeError" in failed.value.reason
