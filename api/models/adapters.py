"""LoRA adapters: attaching them to a base, refusing any whose weights do not all fit."""

from __future__ import annotations

import copy
import hashlib
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.tuners.tuners_utils import delete_adapter as delete_peft_adapter
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load as load_safetensors

from api.models.adapter_config import ConfigRefused, parse_adapter_config
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


def read_adapter_config(folder: Path) -> tuple[LoraConfig, str]:
    """Reads `adapter_config.json` once: the config its bytes describe (checked field by field,
    api.models.adapter_config) and the sha256 of those same bytes, so a file changing
    meanwhile cannot give the weights served one config and the answers' identity another."""
    config_path = folder / ADAPTER_CONFIG
    if not config_path.is_file():
        raise AdapterError(config_path, "missing: not an adapter folder")
    data = _read(config_path)
    try:
        config = parse_adapter_config(data)
    except ConfigRefused as exc:
        raise AdapterError(config_path, f"bad adapter config: {exc}") from None
    return config, hashlib.sha256(data).hexdigest()


def read_adapter_weights(path: Path) -> tuple[dict[str, torch.Tensor], str]:
    """Reads `adapter_model.safetensors` once: its tensors (on the CPU) and the sha256 of the
    bytes they were parsed from."""
    data = _read(path)
    try:
        tensors = load_safetensors(data)
    except Exception as exc:  # safetensors raises its own SafetensorError, and others
        raise AdapterError(
            path, f"truncated or corrupt, not a readable safetensors file: {exc}"
        ) from None
    return tensors, hashlib.sha256(data).hexdigest()


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise AdapterError(path, f"cannot read: {exc.strerror or exc}") from None


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
        config, config_digest = read_adapter_config(adapter.path)
        weights = adapter.path / ADAPTER_WEIGHTS
        check_head_covered(config, missing_base_keys, weights)
        given, digest = read_adapter_weights(weights)
        if adapter.sha256 is not None and digest != adapter.sha256:
            raise AdapterError(weights, f"sha256 {digest} does not match pinned {adapter.sha256}")
        try:
            if model is None:
                model = get_peft_model(base, config, adapter_name=adapter.name)
            else:
                model.add_adapter(adapter.name, config)
        except ValueError as exc:  # peft: "Target modules ... not found in the base model"
            raise AdapterError(weights, f"adapter does not fit this base: {exc}") from None
        expected = get_peft_model_state_dict(
            model, adapter_name=adapter.name, save_embedding_layers=False
        )
        if set(given) != set(expected):
            raise AdapterError(weights, _mismatch(set(expected), set(given)))
        if wrong := [key for key in given if given[key].shape != expected[key].shape]:
            raise AdapterError(weights, f"adapter for another base: {_few(wrong)} differ in shape")
        # The tensors read (and hashed) above, not the file again: peft's load_adapter would
        # read it a second time.
        set_peft_model_state_dict(model, given, adapter_name=adapter.name)
        digests[adapter.name] = AdapterDigests(weights=digest, config=config_digest)
    if model is None:
        raise ValueError("attach_adapters needs at least one adapter")
    model.eval()
    return model, digests


def attach_checked(model: torch.nn.Module, name: str, checked: CheckedAdapter) -> None:
    """Attaches a checked adapter to a peft model under `name`. Refused, with nothing of it
    left in the model, where peft lays it out with other tensor names or shapes than it
    carries, or where anything at all fails on the way."""
    weights = checked.folder / ADAPTER_WEIGHTS
    if not isinstance(model, PeftModel):
        raise AdapterError(weights, "the model is not served with peft: no adapter attaches")
    try:
        # A copy: peft adds the head's names to the modules_to_save of the config it is given,
        # and this one is attached again after every eviction.
        model.add_adapter(name, copy.deepcopy(checked.config))
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
    except BaseException as exc:
        remove_adapter(model, name)
        if isinstance(exc, AdapterError) or not isinstance(exc, Exception):
            raise
        reason = f"{type(exc).__name__}: {str(exc).strip() or 'no message'}".splitlines()[0]
        raise AdapterError(weights, f"adapter does not fit this base: {reason}") from None
    model.eval()


def detach(model: torch.nn.Module, name: str) -> None:
    """Removes the adapter `name` from a peft model (nothing when it is not attached)."""
    if isinstance(model, PeftModel) and name in model.peft_config:
        remove_adapter(model, name)


def remove_adapter(model: PeftModel, name: str) -> None:
    """Removes every layer, weight and setting peft holds for adapter `name`, also after an
    attach that failed half-way (peft then forgets the adapter's config, not its layers);
    raises when any is left."""
    if name in model.peft_config:
        model.delete_adapter(name)
    else:
        inner = cast(torch.nn.Module, model.base_model.model)
        delete_peft_adapter(inner, name, prefix="lora_", layer_cls=BaseTunerLayer)
    _unwrap_empty_layers(cast(torch.nn.Module, model.base_model.model))
    if left := leftovers(model, name):
        raise RuntimeError(f"adapter {name!r} could not be removed: {_few(left)} remain")


def _unwrap_empty_layers(model: torch.nn.Module) -> None:
    """Puts each base layer back in place of a LoRA layer left holding no adapter (one the
    removed adapter alone had wrapped): the model's layout is again what it was before."""
    for module_name, module in list(model.named_modules()):
        if not isinstance(module, BaseTunerLayer) or any(
            getattr(module, table) for table in module.adapter_layer_names
        ):
            continue
        parent_name, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, module.get_base_layer())


def leftovers(model: torch.nn.Module, name: str) -> list[str]:
    """What `model` still holds for adapter `name`: its weights, and its entries in peft's
    per-adapter tables (ranks, scalings, dropouts), by module."""
    found = [key for key in model.state_dict() if f".{name}." in key or key.endswith(f".{name}")]
    for module_name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer):
            for table in (*module.adapter_layer_names, *module.other_param_names):
                if name in (getattr(module, table, None) or {}):
                    found.append(f"{module_name}.{table}[{name}]")
    if name in getattr(model, "peft_config", {}):
        found.append(f"peft_config[{name}]")
    return found


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
