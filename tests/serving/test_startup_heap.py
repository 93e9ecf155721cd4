"""What start-up built is frozen out of the cyclic collector's walk while serving, the youngest
generation is collected as GC_GEN0_THRESHOLD says, and nothing that serving later lets go of
stays alive because of it; shutdown sets the collector back as it was."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import torch
from peft.tuners.lora import LoraLayer

from api.models.adapters import detach
from api.models.registry import Registry
from tests.support.in_process import make_settings, serving, spec_for
from tests.support.tiny_models import TinyModel


def tracked(obj: object) -> bool:
    """Whether the collector's generations hold `obj` (the frozen ones are not listed)."""
    return any(other is obj for other in gc.get_objects())


def test_the_loaded_model_is_frozen_while_serving_and_collectable_after(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    before = gc.get_threshold()
    with serving([spec_for(tiny_bert)], tmp_path, gc_gen0_threshold=4321) as client:
        state = client.app.state.service  # type: ignore[attr-defined]
        model = state.registry.models["tiny"].loaded.model
        assert gc.get_freeze_count() > 0
        assert not tracked(model), "the model is walked by every full collection"
        assert gc.get_threshold() == (4321, *before[1:])
        response = client.post("/predict", json={"inputs": "win a free prize now"})
        assert response.status_code == 200, response.text
    assert gc.get_freeze_count() == 0, "shutdown leaves start-up's objects frozen"
    assert gc.get_threshold() == before, "shutdown leaves the serving threshold set"
    assert tracked(model)


def test_a_reference_cycle_made_while_serving_is_still_collected(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    # The raised threshold delays the collector; it must not stop it: a cycle that serving
    # lets go of is freed once enough allocations follow it.
    class Node:
        partner: Node | None = None

    with serving([spec_for(tiny_bert)], tmp_path, gc_gen0_threshold=1000):
        first, second = Node(), Node()
        first.partner, second.partner = second, first
        gone = weakref.ref(first)
        del first, second
        assert gone() is not None, "a cycle is freed by reference counts alone"
        filler = [[index] for index in range(30_000)]  # allocations past the threshold, 30 times
        assert gone() is None, "the cycle outlived the young generation's collection"
        del filler


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
