"""What start-up built is frozen out of the cyclic collector's walk while serving, and nothing
that serving later lets go of stays alive because of it."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import torch
from peft.tuners.lora import LoraLayer

from api.models.adapters import detach
from api.models.registry import Registry
from tests.conftest import make_settings, serving, spec_for
from tests.tiny_models import TinyModel


def tracked(obj: object) -> bool:
    """Whether the collector's generations hold `obj` (the frozen ones are not listed)."""
    return any(other is obj for other in gc.get_objects())


def test_the_loaded_model_is_frozen_while_serving_and_collectable_after(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    with serving([spec_for(tiny_bert)], tmp_path) as client:
        state = client.app.state.service  # type: ignore[attr-defined]
        model = state.registry.models["tiny"].loaded.model
        assert gc.get_freeze_count() > 0
        assert not tracked(model), "the model is walked by every full collection"
        response = client.post("/predict", json={"inputs": "win a free prize now"})
        assert response.status_code == 200, response.text
    assert gc.get_freeze_count() == 0, "shutdown leaves start-up's objects frozen"
    assert tracked(model)


def test_an_adapter_attached_before_the_freeze_is_freed_when_detached(
    tiny_bert: TinyModel,
) -> None:
    # Freezing keeps objects in reference cycles alive until unfrozen; an adapter attached
    # at start-up (the models file, the watched folder) and detached while serving must be
    # freed by reference counts alone.
    registry = Registry([spec_for(tiny_bert)], make_settings(warmup=False))
    registry.load_all()
    try:
        model = registry.models["tiny"].loaded.model
        layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
        assert layers, "the tiny model has no LoRA layer"
        promo: list[weakref.ref[torch.nn.Module]] = [
            weakref.ref(layer.lora_A["promo"]) for layer in layers
        ]
        gc.collect()
        gc.freeze()
        gc.disable()  # nothing may be freed by a collection, only by reference counts
        try:
            detach(model, "promo")
            assert all(ref() is None for ref in promo), "a detached adapter stayed alive"
        finally:
            gc.enable()
            gc.unfreeze()
    finally:
        registry.close()
