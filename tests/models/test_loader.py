"""The real loader on tiny real checkpoints: quantization, adapters, refusals."""

from __future__ import annotations

import gc
import json
import shutil
import time
import weakref
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from api.models.loader import (
    LoadError,
    check_placement,
    load_model,
    max_memory_map,
    placement,
)
from api.models.predictor import Predictor
from api.models.registry import Registry
from api.models.spec import AdapterSpec
from tests.support.in_process import make_settings, spec_for
from tests.support.tiny_models import TinyModel

TEXTS = ["win a free prize now call", "are we still meeting for lunch tomorrow"]
# How far each choice may move a probability on a tiny random model; 4-bit moves most.
CPU_QUANTIZATIONS = {"none": 1e-6, "int8": 0.05, "dynamic-int8": 0.05, "nf4": 0.1, "fp4": 0.1}


def probabilities(predictor: Predictor, adapter: str | None) -> torch.Tensor:
    return torch.tensor([s.probabilities for s in predictor.predict(TEXTS, adapter)])


@pytest.mark.parametrize("kind", ["bert", "llama"])
@pytest.mark.parametrize("quantization", sorted(CPU_QUANTIZATIONS))
def test_each_cpu_quantization_loads_and_classifies_like_fp32(
    kind: str, quantization: str, request: pytest.FixtureRequest
) -> None:
    tiny: TinyModel = request.getfixturevalue(f"tiny_{kind}")
    adapters = ("spam",) if quantization == "dynamic-int8" else ("spam", "promo")
    reference = Predictor(load_model(spec_for(tiny, adapters=adapters), make_settings()))
    spec = spec_for(tiny, adapters=adapters, quantization=quantization)
    loaded = load_model(spec, make_settings())
    predictor = Predictor(loaded)

    got, want = probabilities(predictor, "spam"), probabilities(reference, "spam")
    assert got.shape == (2, 2)
    assert torch.allclose(got.sum(dim=1), torch.ones(2), atol=1e-5)
    assert torch.allclose(got, want, atol=CPU_QUANTIZATIONS[quantization]), (got, want)
    assert torch.equal(got.argmax(dim=1), want.argmax(dim=1))
    assert loaded.labels == ["ham", "spam"]
    if quantization != "none":
        assert loaded.weight_bytes < reference.loaded.weight_bytes


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_two_adapters_on_one_base_answer_differently(
    kind: str, request: pytest.FixtureRequest
) -> None:
    tiny: TinyModel = request.getfixturevalue(f"tiny_{kind}")
    predictor = Predictor(load_model(spec_for(tiny), make_settings()))

    spam, promo = probabilities(predictor, "spam"), probabilities(predictor, "promo")
    assert (spam - promo).abs().max() > 0.05


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_mixed_adapter_batch_matches_one_adapter_at_a_time(
    kind: str, request: pytest.FixtureRequest
) -> None:
    tiny: TinyModel = request.getfixturevalue(f"tiny_{kind}")
    predictor = Predictor(load_model(spec_for(tiny), make_settings()))
    rows = predictor.encode(TEXTS + TEXTS)

    mixed = predictor.forward(rows, ["spam", "spam", "promo", "promo"])
    alone = predictor.forward(rows[:2], ["spam"] * 2) + predictor.forward(rows[2:], ["promo"] * 2)

    for a, b in zip(mixed, alone, strict=True):
        assert a.probabilities == pytest.approx(b.probabilities, abs=1e-5)


def test_llama_without_pad_token_batches_texts_of_different_lengths(
    tiny_llama: TinyModel,
) -> None:
    predictor = Predictor(load_model(spec_for(tiny_llama), make_settings()))
    together = predictor.predict(["win", "are we still meeting for lunch tomorrow ok"], "spam")
    alone = predictor.predict(["win"], "spam")

    assert together[0].probabilities == pytest.approx(alone[0].probabilities, abs=1e-5)


def test_adapter_with_mismatched_keys_is_refused(tiny_bert: TinyModel, tmp_path: Path) -> None:
    broken = tmp_path / "renamed"
    shutil.copytree(tiny_bert.adapters["spam"], broken)
    from safetensors.torch import load_file, save_file

    tensors = load_file(broken / "adapter_model.safetensors")
    renamed = {key.replace("layer.0.", "layer.7."): value for key, value in tensors.items()}
    save_file(renamed, broken / "adapter_model.safetensors")
    spec = spec_for(tiny_bert, adapters=()).model_copy(
        update={"adapters": [AdapterSpec(name="spam", path=broken, sha256=None)]}
    )

    with pytest.raises(LoadError) as error:
        load_model(spec, make_settings())
    message = str(error.value)
    assert "'tiny'" in message and "adapter_model.safetensors" in message
    assert "match nothing in the base" in message and "missing" in message


def test_adapter_for_another_base_is_refused(tiny_bert: TinyModel, tiny_llama: TinyModel) -> None:
    spec = spec_for(tiny_bert, adapters=()).model_copy(
        update={"adapters": [AdapterSpec(name="spam", path=tiny_llama.adapters["spam"])]}
    )
    with pytest.raises(LoadError, match=r"adapter_model.safetensors: adapter does not fit"):
        load_model(spec, make_settings())


def test_bad_adapter_config_is_refused(tiny_bert: TinyModel, tmp_path: Path) -> None:
    broken = tmp_path / "bad-config"
    shutil.copytree(tiny_bert.adapters["spam"], broken)
    (broken / "adapter_config.json").write_text("{not json", encoding="utf-8")
    spec = spec_for(tiny_bert, adapters=()).model_copy(
        update={"adapters": [AdapterSpec(name="spam", path=broken)]}
    )
    with pytest.raises(LoadError, match=r"adapter_config.json: bad adapter config"):
        load_model(spec, make_settings())


def test_truncated_base_weights_are_refused_naming_the_file(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    base = tmp_path / "base"
    shutil.copytree(tiny_bert.base, base)
    weights = base / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])

    with pytest.raises(LoadError) as error:
        load_model(spec_for(tiny_bert, base=str(base)), make_settings())
    assert str(weights) in str(error.value) and "truncated" in str(error.value)


def test_truncated_adapter_weights_are_refused_naming_the_file(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    broken = tmp_path / "adapter"
    shutil.copytree(tiny_bert.adapters["spam"], broken)
    weights = broken / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    spec = spec_for(tiny_bert, adapters=()).model_copy(
        update={"adapters": [AdapterSpec(name="spam", path=broken)]}
    )
    with pytest.raises(LoadError, match=r"adapter_model.safetensors: truncated"):
        load_model(spec, make_settings())


def test_pinned_sha256_mismatch_is_refused(tiny_bert: TinyModel) -> None:
    spec = spec_for(tiny_bert, weights_sha256={"model.safetensors": "0" * 64})
    with pytest.raises(LoadError, match="does not match pinned"):
        load_model(spec, make_settings())


def test_base_without_head_and_no_adapter_is_refused(tiny_bert: TinyModel) -> None:
    with pytest.raises(LoadError, match="classification head would be random"):
        load_model(spec_for(tiny_bert, adapters=()), make_settings())


def test_pickle_only_base_is_refused_when_safetensors_are_required(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    base = tmp_path / "pickled"
    shutil.copytree(tiny_bert.base, base)
    torch.save(load_file(base / "model.safetensors"), base / "pytorch_model.bin")
    (base / "model.safetensors").unlink()

    with pytest.raises(LoadError, match="USE_SAFETENSORS=true"):
        load_model(spec_for(tiny_bert, base=str(base)), make_settings(use_safetensors=True))
    loaded = load_model(spec_for(tiny_bert, base=str(base)), make_settings(use_safetensors=False))
    assert Predictor(loaded).predict(TEXTS, "spam")


def test_dynamic_int8_with_two_adapters_is_refused_with_the_reason(tiny_bert: TinyModel) -> None:
    with pytest.raises(LoadError, match="serves one adapter, not 2"):
        load_model(spec_for(tiny_bert, quantization="dynamic-int8"), make_settings())


def test_hub_id_resolves_from_hf_home_offline(tiny_bert: TinyModel, tmp_path: Path) -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf" / "hub" / "models--acme--tiny-bert"
    shutil.copytree(tiny_bert.base, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit, encoding="utf-8")
    settings = make_settings(hf_home=tmp_path / "hf", offline=True)

    loaded = load_model(spec_for(tiny_bert, base="acme/tiny-bert", revision=commit), settings)
    assert loaded.revision == commit
    with pytest.raises(LoadError, match="not in the Hugging Face cache"):
        load_model(spec_for(tiny_bert, base="acme/other"), settings)


GIB = 1024**3


def test_max_memory_gb_is_one_budget_per_device_that_later_models_share() -> None:
    """The users' card: MAX_MEMORY_GB=16 for EXAONE in nf4, then KoELECTRA, on one GPU."""
    assert max_memory_map(None, 1, {}) is None
    # First: the whole budget, on the GPU and for what accelerate would put on the CPU.
    assert max_memory_map(16, 1, {}) == {0: 16 * GIB, "cpu": 16 * GIB}
    exaone = {0: 1_700_000_000}  # docs/loading.md's arithmetic: 4-bit layers and bf16 embeddings
    assert max_memory_map(16, 1, exaone) == {0: 16 * GIB - 1_700_000_000, "cpu": 16 * GIB}
    # A third model after both gets what both left; a budget spent gives nothing, not less.
    both = {0: 1_700_000_000 + 30_000_000}
    assert max_memory_map(16, 1, both) == {0: 16 * GIB - 1_730_000_000, "cpu": 16 * GIB}
    assert max_memory_map(1, 1, exaone) == {0: 0, "cpu": GIB}
    # Per device: what a model holds on GPU 0 leaves GPU 1's budget whole.
    assert max_memory_map(14.5, 2, exaone) == {
        0: int(14.5 * GIB) - 1_700_000_000,
        1: int(14.5 * GIB),
        "cpu": int(14.5 * GIB),
    }


def test_models_loaded_in_turn_are_given_what_the_earlier_ones_left(
    tiny_bert: TinyModel, tiny_llama: TinyModel
) -> None:
    """The registry's turn-taking (how it loads on a GPU with MAX_MEMORY_GB), run on the CPU,
    where the budget is measured and handed on the same way (accelerate uses it on GPUs)."""
    specs = [spec_for(tiny_llama, name="first"), spec_for(tiny_bert, name="second")]
    registry = Registry(specs, make_settings(max_memory_gb=1, warmup=False))
    try:
        registry._load_in_turn()
        first, second = (registry.models[name].loaded for name in ("first", "second"))
        assert first.device_bytes == {"cpu": first.weight_bytes} and first.weight_bytes > 0
        assert first.max_memory == {"cpu": GIB}
        assert second.max_memory == {"cpu": GIB - first.weight_bytes}
        assert registry.held_bytes() == {"cpu": first.weight_bytes + second.weight_bytes}
    finally:
        registry.close()


# What accelerate's device_map="auto" gives a 30-layer decoder on a GPU its budget cannot
# hold: the last layers on the CPU, the head on the disk.
OFFLOADED = {
    "transformer.wte": 0,
    **{f"transformer.h.{layer}": 0 for layer in range(27)},
    **{f"transformer.h.{layer}": "cpu" for layer in range(27, 30)},
    "transformer.ln_f": "cpu",
    "lm_head": "disk",
}


def test_a_model_placed_partly_off_the_gpu_is_refused_naming_its_modules() -> None:
    with pytest.raises(LoadError) as error:
        check_placement("exaone", OFFLOADED, {0: 1_000_000_000, "cpu": 16 * GIB})
    message = str(error.value)
    assert message.startswith("model 'exaone': MAX_MEMORY_GB: 5 of its 33 modules")
    assert "transformer.h.27 on cpu" in message and "lm_head on disk" in message
    assert "GPU 0: 0.93 GiB" in message
    with pytest.raises(
        LoadError, match=r"1 of its 1 modules would run off the GPU \(\(all\) on cpu"
    ):
        check_placement("koelectra", {"": "cpu"}, {0: 0, "cpu": 16 * GIB})
    # Wholly on GPUs (by index, as accelerate places them): served.
    check_placement("exaone", dict.fromkeys(OFFLOADED, 0), None)
    check_placement("exaone", {"": 0}, {0: 16 * GIB, "cpu": 16 * GIB})
    check_placement("exaone", {"transformer": 0, "lm_head": 1}, None)


def test_a_model_auto_placed_wholly_on_the_cpu_is_found_off_the_gpu(tiny_llama: TinyModel) -> None:
    """transformers 5 sets no `hf_device_map` when `device_map="auto"` puts the whole model on
    one device: what a spent GPU budget does (seen on an H200: served on the CPU, unrefused).
    Here the CPU is the only device, so accelerate places it as it would there."""
    model = AutoModelForSequenceClassification.from_pretrained(
        str(tiny_llama.base), device_map="auto", max_memory={"cpu": GIB}
    )
    assert getattr(model, "hf_device_map", None) is None  # what the check cannot rely on
    assert placement(model) == {"": "cpu"}
    with pytest.raises(
        LoadError, match=r"1 of its 1 modules would run off the GPU \(\(all\) on cpu"
    ):
        check_placement("tiny", placement(model), {0: 0, "cpu": GIB})
    # Weights on several devices and no map: each weight named where it is.
    model.score.weight = torch.nn.Parameter(model.score.weight.detach().to("meta"))
    where = placement(model)
    assert where["score.weight"] == "meta" and set(where.values()) == {"cpu", "meta"}
    with pytest.raises(LoadError, match=r"modules would run off the GPU \(\S+ on cpu"):
        check_placement("tiny", where, {0: 0, "cpu": GIB})
    model.hf_device_map = {"model": 0, "score": "cpu"}  # accelerate's map, where it made one
    assert placement(model) == {"model": 0, "score": "cpu"}


def test_load_records_every_phase(tiny_bert: TinyModel) -> None:
    loaded = load_model(spec_for(tiny_bert), make_settings())
    phases = "resolve weights quantize save_quantized adapters warmup forward_processes"
    assert set(loaded.phases) == set(phases.split())
    assert loaded.phases["weights"] > 0 and loaded.phases["adapters"] > 0
    assert json.dumps(loaded.phases)


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_single_adapter_is_merged_and_answers_as_unmerged(
    kind: str, request: pytest.FixtureRequest
) -> None:
    tiny: TinyModel = request.getfixturevalue(f"tiny_{kind}")
    spec = spec_for(tiny, adapters=("spam",))
    merged = load_model(spec, make_settings())
    unmerged = load_model(spec, make_settings(merge_single_adapter=False))
    assert merged.merged and not unmerged.merged
    assert not any("lora" in name for name, _ in merged.model.named_parameters())
    assert torch.allclose(
        probabilities(Predictor(merged), "spam"),
        probabilities(Predictor(unmerged), "spam"),
        atol=1e-5,
    )


def test_quantized_base_keeps_its_single_adapter_unmerged(tiny_llama: TinyModel) -> None:
    loaded = load_model(
        spec_for(tiny_llama, adapters=("spam",), quantization="nf4"), make_settings()
    )
    assert not loaded.merged


@pytest.mark.parametrize(
    "options",
    [
        {"attn_implementation": "eager"},
        {"pad_to_multiple_of": 8},
        {"torch_compile": True},
    ],
    ids=["eager-attention", "length-buckets", "torch-compile"],
)
def test_speed_options_answer_like_the_default(
    tiny_bert: TinyModel, options: dict[str, object]
) -> None:
    spec = spec_for(tiny_bert, adapters=("spam",))
    settings = make_settings(**options)
    reference = probabilities(Predictor(load_model(spec, make_settings())), "spam")
    predictor = Predictor(load_model(spec, settings), settings.pad_to_multiple_of)
    assert torch.allclose(probabilities(predictor, "spam"), reference, atol=1e-4)


def test_dynamic_int8_of_bfloat16_weights_is_refused_with_the_reason(tiny_bert: TinyModel) -> None:
    spec = spec_for(tiny_bert, adapters=("spam",), quantization="dynamic-int8", dtype="bfloat16")
    with pytest.raises(LoadError, match="quantizes float32 weights, not bfloat16"):
        load_model(spec, make_settings())


def test_forward_overhead_is_its_fixed_time_over_its_time_per_token(
    tiny_bert: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    predictor = Predictor(load_model(spec_for(tiny_bert), make_settings()))

    def forward_of_known_cost(batch: list[list[int]], adapters: list[str | None]) -> list[None]:
        time.sleep(0.020 + 0.0001 * sum(map(len, batch)))  # 20 ms + 0.1 ms a token
        return [None] * len(batch)

    monkeypatch.setattr(predictor, "forward", forward_of_known_cost)
    overhead = predictor.overhead_tokens()
    assert overhead is not None and 150 < overhead < 250  # 0.020 / 0.0001 = 200 tokens

    # No cost per token (as on a GPU at small shapes): None, or so large that it is no limit.
    monkeypatch.setattr(predictor, "forward", lambda batch, adapters: time.sleep(0.05))
    flat = predictor.overhead_tokens(repeats=3)
    assert flat is None or flat > 5000


def test_a_bf16_model_keeps_its_head_and_logits_in_float32(tiny_bert: TinyModel) -> None:
    spec = spec_for(tiny_bert, adapters=("spam",), dtype="bfloat16")
    loaded = load_model(spec, make_settings())
    heads = [m for n, m in loaded.model.named_modules() if n.endswith("classifier")]
    assert heads and all(p.dtype == torch.float32 for h in heads for p in h.parameters())
    encoder = next(p for n, p in loaded.model.named_parameters() if "encoder" in n)
    assert encoder.dtype == torch.bfloat16
    # Not merged: bf16 weights would round away part of the LoRA delta.
    assert not loaded.merged
    predictor = Predictor(loaded)
    rows = predictor.encode(TEXTS)
    logits = predictor._logits(rows, ["spam"] * len(rows))
    assert logits.dtype == torch.float32


def test_classifier_forwards_build_no_kv_cache(tiny_llama: TinyModel) -> None:
    loaded = load_model(spec_for(tiny_llama, adapters=("spam",)), make_settings())
    predictor = Predictor(loaded)
    ids = torch.tensor(predictor.encode(["win a prize"]))
    output = loaded.model(input_ids=ids)
    assert getattr(output, "past_key_values", None) is None
    assert loaded.model.config.use_cache is False


def test_release_memory_frees_what_only_a_reference_cycle_holds(tiny_bert: TinyModel) -> None:
    """What the batcher calls before retrying the halves of an out-of-memory batch (on a GPU
    it then empties the allocator's cache, which can only give back what is freed)."""
    predictor = Predictor(load_model(spec_for(tiny_bert, adapters=("spam",)), make_settings()))

    class Frame:  # stands for a failed forward's frame caught in a cycle with its exception
        cycle: object = None

    held = Frame()
    held.cycle = held
    alive = weakref.ref(held)
    del held
    gc.disable()  # the collector must not run by chance before release_memory does
    try:
        assert alive() is not None
        predictor.release_memory()
        assert alive() is None
    finally:
        gc.enable()


def test_models_loaded_in_parallel_leave_torch_init_as_it_was(
    tiny_bert: TinyModel, tiny_llama: TinyModel
) -> None:
    # transformers swaps torch.nn.init for no-ops while it builds a model; two builds at once
    # once left the no-ops in place, and later models came out of uninitialised memory.
    originals = {name: getattr(torch.nn.init, name) for name in ("normal_", "kaiming_uniform_")}
    specs = [
        spec_for(tiny, name=f"m{index}", adapters=("spam",))
        for index, tiny in enumerate([tiny_bert, tiny_llama, tiny_bert, tiny_llama])
    ]
    for _ in range(3):
        registry = Registry(specs, make_settings(warmup=False))
        registry.load_all()
        registry.close()
        for name, function in originals.items():
            assert getattr(torch.nn.init, name) is function, name
    fresh = torch.nn.Linear(64, 64)  # initialised, not left as whatever memory held
    assert fresh.weight.abs().max().item() <= 1 / 8 + 1e-6 and fresh.weight.std().item() > 0
