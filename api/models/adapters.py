"""LoRA adapters: attaching them to a base, refusing any whose weights do not all fit."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

from api.models.checkpoint import CheckpointError, safetensors_tensor_names, sha256_of
from api.models.spec import AdapterSpec

# A run-time adapter's old version is detached while it may be peft's active adapter, which
# peft then warns about on every swap and eviction; the predictor sets its adapter per batch.
warnings.filterwarnings("ignore", message=r"Adapter .* was active which is now deleted")

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_SHOWN_KEYS = 3


class AdapterError(Exception):
    """An adapter that cannot be attached; names the file and the reason."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


@dataclass(frozen=True)
class AdapterDigests:
    """sha256 of an adapter's weights file and of its config (rank, alpha, rsLoRA... change
    every score with the same weights)."""

    weights: str
    config: str


@dataclass(frozen=True)
class CheckedAdapter:
    """An adapter read and checked against a loaded base (api.models.adapter_check), not yet
    attached: its config, its tensors on the CPU in peft's layout, and its digests."""

    folder: Path
    config: LoraConfig
    tensors: dict[str, torch.Tensor]
    digests: AdapterDigests
    rank: int


def read_adapter_config(folder: Path) -> LoraConfig:
    """Reads and checks `adapter_config.json`: it must exist and describe a LoRA adapter."""
    config_path = folder / ADAPTER_CONFIG
    if not config_path.is_file():
        raise AdapterError(config_path, "missing: not an adapter folder")
    try:
        config = PeftConfig.from_pretrained(str(folder))
    except Exception as exc:  # peft raises bare ValueError/TypeError/JSON errors here
        raise AdapterError(config_path, f"bad adapter config: {exc}") from None
    if not isinstance(config, LoraConfig):
        raise AdapterError(config_path, f"bad adapter config: {config.peft_type} is not LoRA")
    config.inference_mode = True
    return config


def check_head_covered(config: LoraConfig, missing_base_keys: list[str], path: Path) -> None:
    """A base without trained head weights is only servable when the adapter carries them."""
    saved = list(config.modules_to_save or [])
    uncovered = [
        key
        for key in missing_base_keys
        if not any(key == module or key.startswith(f"{module}.") for module in saved)
    ]
    if uncovered:
        raise AdapterError(
            path,
            "the base checkpoint lacks "
            f"{_few(uncovered)} and this adapter does not carry them (modules_to_save: {saved})",
        )


def attach_adapters(
    base: torch.nn.Module, adapters: list[AdapterSpec], missing_base_keys: list[str]
) -> tuple[PeftModel, dict[str, AdapterDigests]]:
    """Attaches every adapter under its name; returns the model and each one's digests."""
    model: PeftModel | None = None
    digests: dict[str, AdapterDigests] = {}
    for adapter in adapters:
        config = read_adapter_config(adapter.path)
        weights = adapter.path / ADAPTER_WEIGHTS
        check_head_covered(config, missing_base_keys, weights)
        try:
            given = safetensors_tensor_names(weights)
            digest = sha256_of(weights)
            config_digest = sha256_of(adapter.path / ADAPTER_CONFIG)
        except (CheckpointError, OSError) as exc:
            reason = exc.reason if isinstance(exc, CheckpointError) else str(exc)
            raise AdapterError(weights, reason) from None
        if adapter.sha256 is not None and digest != adapter.sha256:
            raise AdapterError(weights, f"sha256 {digest} does not match pinned {adapter.sha256}")
        try:
            if model is None:
                model = get_peft_model(base, config, adapter_name=adapter.name)
            else:
                model.add_adapter(adapter.name, config)
        except ValueError as exc:  # peft: "Target modules ... not found in the base model"
            raise AdapterError(weights, f"adapter does not fit this base: {exc}") from None
        expected = set(get_peft_model_state_dict(model, adapter_name=adapter.name))
        if given != expected:
            raise AdapterError(weights, _mismatch(expected, given))
        try:
            model.load_adapter(str(adapter.path), adapter_name=adapter.name)
        except RuntimeError as exc:  # torch: "size mismatch for ..."
            first_line = str(exc).strip().splitlines()[-1].strip()
            raise AdapterError(weights, f"adapter for another base: {first_line}") from None
        digests[adapter.name] = AdapterDigests(weights=digest, config=config_digest)
    if model is None:
        raise ValueError("attach_adapters needs at least one adapter")
    model.eval()
    return model, digests


def attach_checked(model: torch.nn.Module, name: str, checked: CheckedAdapter) -> None:
    """Attaches a checked adapter to a peft model under `name`. Refused, with nothing left
    attached, where peft lays it out with other tensor names or shapes than it carries."""
    weights = checked.folder / ADAPTER_WEIGHTS
    if not isinstance(model, PeftModel):
        raise AdapterError(weights, "the model is not served with peft: no adapter attaches")
    try:
        model.add_adapter(name, checked.config)
    except ValueError as exc:  # peft: "Target modules ... not found in the base model"
        raise AdapterError(weights, f"adapter does not fit this base: {exc}") from None
    try:
        # Not "auto": that asks the model hub whether the base's vocabulary changed.
        expected = get_peft_model_state_dict(model, adapter_name=name, save_embedding_layers=False)
        given = checked.tensors
        if set(expected) != set(given):
            raise AdapterError(weights, _mismatch(set(expected), set(given)))
        if wrong := [key for key in given if given[key].shape != expected[key].shape]:
            raise AdapterError(
                weights, f"tensors of another shape than peft expects: {_few(wrong)}"
            )
        set_peft_model_state_dict(model, given, adapter_name=name)
    except BaseException:
        model.delete_adapter(name)
        raise
    model.eval()


def detach(model: torch.nn.Module, name: str) -> None:
    """Removes the adapter `name` from a peft model (nothing when it is not attached)."""
    if isinstance(model, PeftModel) and name in model.peft_config:
        model.delete_adapter(name)


def _mismatch(expected: set[str], given: set[str]) -> str:
    parts = ["adapter weights do not match the base"]
    if missing := sorted(expected - given):
        parts.append(f"{len(missing)} expected tensors missing ({_few(missing)})")
    if unexpected := sorted(given - expected):
        parts.append(f"{len(unexpected)} tensors match nothing in the base ({_few(unexpected)})")
    return "; ".join(parts)


def _few(keys: list[str]) -> str:
    shown = ", ".join(keys[:_SHOWN_KEYS])
    return shown + (f", … {len(keys) - _SHOWN_KEYS} more" if len(keys) > _SHOWN_KEYS else "")
