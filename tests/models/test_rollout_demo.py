"""artifacts/rollout.yaml, the rollout demo: the embedded encoder serving its previous adapter
with the current one as its shadow candidate, each adapter pinned to the file it names."""

from __future__ import annotations

import hashlib
import json

import yaml

from api.models.adapters import ADAPTER_WEIGHTS
from api.models.spec import ARTIFACTS_DIR, EMBEDDED_MODELS_FILE, load_models_file

ROLLOUT_FILE = ARTIFACTS_DIR / "rollout.yaml"
# What the demo copies from the embedded default's entry: the same base, scored the same way.
SHARED = ("base", "weights_sha256", "labels", "max_length", "decision_threshold")


def test_the_rollout_demo_pins_both_adapters_to_their_files() -> None:
    [spec] = load_models_file(ROLLOUT_FILE)
    for adapter in spec.adapters:
        digest = hashlib.sha256((adapter.path / ADAPTER_WEIGHTS).read_bytes()).hexdigest()
        assert adapter.sha256 == digest, adapter.name
    adapters = {adapter.name: adapter for adapter in spec.adapters}
    previous = json.loads((ARTIFACTS_DIR / "spam-minilm" / "previous.json").read_text())
    assert adapters["spam-v1"].sha256 == previous["adapter_sha256"]
    [embedded, *_] = load_models_file(EMBEDDED_MODELS_FILE)
    assert adapters["spam-v2"].path == embedded.adapters[0].path
    assert adapters["spam-v2"].sha256 == embedded.adapters[0].sha256


def test_the_rollout_demo_serves_the_previous_adapter_beside_the_current_in_shadow() -> None:
    [spec] = load_models_file(ROLLOUT_FILE)
    assert spec.quantization == "none"  # two adapters beside the base: never merged
    assert spec.active_default_adapter == "spam-v1"
    assert spec.candidate is not None
    assert (spec.candidate.adapter, spec.candidate.mode) == ("spam-v2", "shadow")
    [demo] = yaml.safe_load(ROLLOUT_FILE.read_text(encoding="utf-8"))["models"]
    embedded = next(
        entry
        for entry in yaml.safe_load(EMBEDDED_MODELS_FILE.read_text(encoding="utf-8"))["models"]
        if entry["name"] == demo["name"]
    )
    assert {key: demo[key] for key in SHARED} == {key: embedded[key] for key in SHARED}
