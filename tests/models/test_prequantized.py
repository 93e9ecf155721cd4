"""Pre-quantized checkpoints: written at the first start, read back at the next with the very
answers quantizing at start gives, rebuilt when damaged, and never served for other sources or
settings."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bitsandbytes.functional
import pytest
import torch
from safetensors.torch import load_file, save_file

from api.models.loader import LoadedModel, LoadError, load_model
from api.models.predictor import Predictor
from api.models.prequantized import CACHE_FOLDER, MANIFEST
from api.models.spec import ModelSpec
from tests.support.file_modes import modes_obeyed, readable
from tests.support.in_process import make_settings, serving, spec_for
from tests.support.tiny_models import TinyModel

TEXTS = [
    "win a free prize now call",
    "are we still meeting for lunch tomorrow",
    "ok",
    "urgent txt reply stop to claim your cash offer on mobile now",
]


def logits(loaded: LoadedModel, adapter: str) -> list[tuple[float, ...]]:
    """Each text's raw logits, as Python floats: compared with ==, to the bit."""
    return [scores.logits for scores in Predictor(loaded).predict(TEXTS, adapter)]


def entries(cache: Path) -> list[Path]:
    folder = cache / CACHE_FOLDER
    return sorted(path for path in folder.iterdir() if not path.name.startswith("."))


@pytest.mark.parametrize(
    ("kind", "quantization"),
    [("llama", "nf4"), ("llama", "int8"), ("bert", "fp4"), ("bert", "int8")],
)
def test_a_prequantized_checkpoint_answers_to_the_bit_as_quantizing_at_start(
    kind: str, quantization: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    tiny: TinyModel = request.getfixturevalue(f"tiny_{kind}")
    spec = spec_for(tiny, quantization=quantization)
    at_start = load_model(spec, make_settings(model_cache_dir=tmp_path, prequantized_cache=False))
    assert at_start.prequantized == "off" and not (tmp_path / CACHE_FOLDER).exists()

    settings = make_settings(model_cache_dir=tmp_path)
    first, second = load_model(spec, settings), load_model(spec, settings)

    assert (first.prequantized, second.prequantized) == ("written", "hit")
    assert len(entries(tmp_path)) == 1
    for adapter in ("spam", "promo"):
        want = logits(at_start, adapter)
        assert logits(first, adapter) == want  # saving left the served model as it was
        assert logits(second, adapter) == want
    assert second.weight_bytes == at_start.weight_bytes


def counting(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Counts calls of bitsandbytes' quantizing function `name` (the real one still runs)."""
    calls: list[int] = []
    real: Callable[..., Any] = getattr(bitsandbytes.functional, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(bitsandbytes.functional, name, counted)
    return calls


@pytest.mark.parametrize(
    ("quantization", "quantizer"), [("nf4", "quantize_4bit"), ("int8", "int8_vectorwise_quant")]
)
def test_the_second_start_quantizes_nothing(
    tiny_llama: TinyModel,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    quantization: str,
    quantizer: str,
) -> None:
    calls = counting(monkeypatch, quantizer)
    settings = make_settings(model_cache_dir=tmp_path)
    spec = spec_for(tiny_llama, quantization=quantization)

    first = load_model(spec, settings)
    quantized_at_first = len(calls)
    calls.clear()
    second = load_model(spec, settings)

    assert quantized_at_first >= 4  # every Linear of both layers but the head
    assert calls == []
    assert first.phases["save_quantized"] > 0 and second.phases["save_quantized"] == 0


def test_models_reports_the_cache_and_the_save_phase(tiny_llama: TinyModel, tmp_path: Path) -> None:
    spec = spec_for(tiny_llama, quantization="nf4")
    plain = spec_for(tiny_llama, name="plain")
    for expected in ("written", "hit"):
        with serving(
            [spec, plain], tmp_path / f"answers-{expected}", model_cache_dir=tmp_path / "models"
        ) as client:
            quantized, full = client.get("/models").json()["models"]
            assert quantized["prequantized_cache"] == expected
            assert (quantized["load_seconds"]["save_quantized"] > 0) == (expected == "written")
            assert full["prequantized_cache"] is None  # nothing for bitsandbytes to quantize


def rewrite_weights(folder: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_a_changed_source_or_setting_makes_a_new_entry(
    tiny_llama: TinyModel, tmp_path: Path
) -> None:
    base = tmp_path / "base"
    shutil.copytree(tiny_llama.base, base)
    cache = tmp_path / "models"
    settings = make_settings(model_cache_dir=cache)
    spec = spec_for(tiny_llama, quantization="nf4", base=str(base))
    before = logits(load_model(spec, settings), "spam")
    variants: list[ModelSpec] = [
        spec.model_copy(update={"quantization": "fp4"}),
        spec.model_copy(update={"quantization": "int8"}),
        spec.model_copy(update={"compute_dtype": "bfloat16"}),
        spec.model_copy(update={"labels": ["spam", "ham"]}),
    ]
    for variant in variants:
        assert load_model(variant, settings).prequantized == "written"
    assert len(entries(cache)) == 1 + len(variants)

    def flip_first_layer(tensors: dict[str, torch.Tensor]) -> None:
        for name in tensors:
            if name.startswith("model.layers.0.mlp."):
                tensors[name] = -tensors[name]

    rewrite_weights(base, flip_first_layer)  # same names, shapes and sizes: other values
    changed = load_model(spec, settings)
    at_start = load_model(spec, make_settings(model_cache_dir=cache, prequantized_cache=False))

    assert changed.prequantized == "written"
    assert len(entries(cache)) == 2 + len(variants)
    assert logits(changed, "spam") == logits(at_start, "spam") != before
    assert load_model(spec, settings).prequantized == "hit"


def truncate(entry: Path) -> None:
    path = entry / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def overwrite_middle(entry: Path) -> None:
    """Same size, header intact: only the digest can tell."""
    path = entry / "model.safetensors"
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(64)
    path.write_bytes(bytes(data))


def remove_manifest(entry: Path) -> None:
    (entry / MANIFEST).unlink()


def garble_manifest(entry: Path) -> None:
    (entry / MANIFEST).write_text("{not json", encoding="utf-8")


def garble_config_and_its_record(entry: Path) -> None:
    """An entry whose manifest matches its files, but transformers cannot read them."""
    (entry / "config.json").write_text("{}", encoding="utf-8")
    manifest = json.loads((entry / MANIFEST).read_text(encoding="utf-8"))
    manifest["files"]["config.json"] = {"bytes": 2, "sha256": hashlib.sha256(b"{}").hexdigest()}
    (entry / MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")


@pytest.mark.parametrize(
    "damage",
    [truncate, overwrite_middle, remove_manifest, garble_manifest, garble_config_and_its_record],
)
def test_a_damaged_entry_is_set_aside_and_rebuilt_never_served(
    tiny_llama: TinyModel, tmp_path: Path, damage: Callable[[Path], None]
) -> None:
    settings = make_settings(model_cache_dir=tmp_path)
    spec = spec_for(tiny_llama, quantization="nf4")
    want = logits(load_model(spec, settings), "spam")
    (entry,) = entries(tmp_path)

    for times in (1, 2):  # damaged twice: each copy set aside under a name of its own
        damage(entry)
        damaged = {p.name: p.read_bytes() for p in entry.iterdir() if p.is_file()}
        rebuilt = load_model(spec, settings)

        assert rebuilt.prequantized == "rebuilt"
        assert logits(rebuilt, "spam") == want
        assert entries(tmp_path) == [entry]  # written again
        asides = sorted((tmp_path / CACHE_FOLDER).glob(f".{entry.name}.broken-*"))
        assert len(asides) == times
        assert any(  # the damaged copy is kept, as it was, for whoever looks into it
            {p.name: p.read_bytes() for p in aside.iterdir() if p.is_file()} == damaged
            for aside in asides
        )
        assert load_model(spec, settings).prequantized == "hit"


def make_unreadable(path: Path) -> None:
    path.chmod(0)


@pytest.mark.parametrize("name", [MANIFEST, "model.safetensors", "config.json"])
def test_an_entry_that_cannot_be_read_now_is_left_in_place(
    tiny_llama: TinyModel, tmp_path: Path, name: str
) -> None:
    """A permission or I/O error proves nothing about an entry every replica shares: the
    start quantizes at start and leaves the entry as it is, for the next start to use."""
    spec = spec_for(tiny_llama, adapters=("spam",), quantization="nf4")
    settings = make_settings(model_cache_dir=tmp_path / "models")
    want = logits(load_model(spec, settings), "spam")
    (entry,) = entries(tmp_path / "models")
    before = {p.name: p.read_bytes() for p in entry.iterdir()}
    make_unreadable(entry / name)

    # As the service runs in its image: a user without root's right to read past a mode.
    with modes_obeyed():
        if readable(entry / name):
            pytest.skip("this process reads a file whatever its mode and cannot give that up")
        loaded = load_model(spec, settings)

    assert loaded.prequantized == "unreadable"
    assert logits(loaded, "spam") == want  # quantized at start: the very same answers
    (entry / name).chmod(0o644)
    assert {p.name: p.read_bytes() for p in entry.iterdir()} == before
    assert [p.name for p in (tmp_path / "models" / CACHE_FOLDER).iterdir()] == [entry.name]
    assert load_model(spec, settings).prequantized == "hit"


def test_an_unwritable_cache_still_serves(tiny_llama: TinyModel, tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder", encoding="utf-8")
    spec = spec_for(tiny_llama, quantization="nf4")
    at_start = load_model(spec, make_settings(prequantized_cache=False))

    loaded = load_model(spec, make_settings(model_cache_dir=blocked / "models"))

    assert loaded.prequantized == "unwritten"
    assert logits(loaded, "spam") == logits(at_start, "spam")


def test_a_base_without_its_head_is_refused_from_the_cache_too(
    tiny_llama: TinyModel, tmp_path: Path
) -> None:
    """The saved model holds a random head for the one the base lacks: its record of the
    missing head, not the head, decides, at every start."""
    settings = make_settings(model_cache_dir=tmp_path)
    spec = spec_for(tiny_llama, adapters=(), quantization="nf4")
    for _ in range(2):
        with pytest.raises(LoadError, match="classification head would be random"):
            load_model(spec, settings)
    assert len(entries(tmp_path)) == 1
