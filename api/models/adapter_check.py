"""Checking a LoRA adapter folder against a loaded base before it serves, attaching nothing:
its files, its pinned digest, the base it names, and every tensor against the base's layers."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig

from api.models.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterDigests,
    AdapterError,
    CheckedAdapter,
    check_head_covered,
    read_adapter_config,
    read_adapter_weights,
)
from api.models.loader import LoadedModel

# peft saves every tensor of a model it wraps under this prefix (adapter name left out).
PEFT_PREFIX = "base_model.model."
LORA_A, LORA_B = "lora_A.weight", "lora_B.weight"
# The heads peft's sequence-classification model copies for every adapter it adds.
CLASSIFIER_HEADS = ("classifier", "score")


def check_adapter(
    folder: Path, loaded: LoadedModel, sha256: str | None, max_rank: int
) -> CheckedAdapter:
    """Reads the adapter in `folder` and checks it fits `loaded`; an AdapterError names the
    file and the reason. Safe beside the model's forwards: it reads the model, never changes it.
    """
    if not folder.is_dir():
        raise AdapterError(folder, "no such adapter folder")
    config, config_digest = read_adapter_config(folder)
    config_path, weights = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    tensors, digest = read_adapter_weights(weights)
    if sha256 is not None and digest != sha256:
        raise AdapterError(weights, f"sha256 {digest} does not match the expected {sha256}")
    check_base_name(config, loaded, config_path)
    check_saved_modules(config, loaded.model, config_path)
    check_head_covered(config, loaded.missing_base_keys, weights)
    rank = check_tensors(tensors, loaded.model, max_rank, weights)
    return CheckedAdapter(folder, config, tensors, AdapterDigests(digest, config_digest), rank)


def base_names(loaded: LoadedModel) -> list[str]:
    """What an adapter for this base may give as `base_model_name_or_path`."""
    spec = loaded.spec
    names = [spec.base_name, spec.base, str(loaded.folder)]
    return list(dict.fromkeys(name for name in names if name))


def check_base_name(config: LoraConfig, loaded: LoadedModel, path: Path) -> None:
    """The base the adapter was trained on, by name: shapes alone do not tell two bases of one
    architecture apart (an uncased and a cased BERT), and answers would be quietly wrong."""
    named = config.base_model_name_or_path
    if not named:
        raise AdapterError(path, "names no base_model_name_or_path: its base cannot be checked")
    known = base_names(loaded)
    if named in known or _same_folder(named, loaded.folder):
        return
    raise AdapterError(
        path,
        f"adapter for another base: trained on {named!r}, model {loaded.spec.name!r} serves "
        f"{' = '.join(repr(name) for name in known)} (declare its hub id as base_name)",
    )


def check_saved_modules(config: LoraConfig, model: torch.nn.Module, path: Path) -> None:
    """A run-time adapter may carry its own head, as the model's adapters do, and nothing
    else whole: any other module in `modules_to_save` would be a copy of part of the base
    replaced for its rows, not a LoRA delta (and as large as that part)."""
    kept = set(getattr(model, "modules_to_save", None) or ()) | set(CLASSIFIER_HEADS)
    if extra := sorted(set(config.modules_to_save or ()) - kept):
        raise AdapterError(
            path,
            f"modules_to_save: {extra} would replace modules of the base; a run-time adapter "
            f"may carry only the head ({', '.join(sorted(kept))})",
        )


def _same_folder(named: str, folder: Path) -> bool:
    try:
        candidate = Path(named).expanduser()
        return candidate.is_dir() and candidate.resolve() == folder.resolve()
    except OSError:
        return False


def check_tensors(
    tensors: dict[str, torch.Tensor], model: torch.nn.Module, max_rank: int, path: Path
) -> int:
    """Every tensor against the layer of the base it adapts or replaces; returns the rank."""
    ranks: dict[str, int] = {}
    for key, tensor in sorted(tensors.items()):  # sorted: the same file, the same message
        if not key.startswith(PEFT_PREFIX):
            raise AdapterError(path, f"tensor {key} is not in peft's layout ({PEFT_PREFIX}…)")
        if not tensor.is_floating_point():
            raise AdapterError(path, f"tensor {key} holds {tensor.dtype}, not floating point")
        if not bool(torch.isfinite(tensor).all()):
            raise AdapterError(path, f"tensor {key} holds NaN or infinity")
        for suffix in (LORA_A, LORA_B):
            if key.endswith(f".{suffix}"):
                module = key[: -len(suffix) - 1]
                rank = _check_lora(tensor, model, module, suffix, key, path)
                if ranks.setdefault(module, rank) != rank:
                    raise AdapterError(path, f"{module}: lora_A and lora_B differ in rank")
                break
        else:
            _check_replaced(tensor, model, key, path)
    if not ranks:
        raise AdapterError(path, "no LoRA weights (lora_A/lora_B) in it")
    rank = max(ranks.values())
    if rank > max_rank:
        raise AdapterError(path, f"rank {rank} is over the limit of {max_rank} (MAX_ADAPTER_RANK)")
    return rank


def _check_lora(
    tensor: torch.Tensor, model: torch.nn.Module, module: str, suffix: str, key: str, path: Path
) -> int:
    """A lora_A [r, in] or lora_B [out, r] weight against the linear layer it adapts."""
    layer = _submodule(model, module)
    if layer is None:
        raise AdapterError(path, f"{key}: the base has no layer {module.removeprefix(PEFT_PREFIX)}")
    features = _linear_features(layer)
    if features is None:
        kind = type(getattr(layer, "base_layer", layer)).__name__
        raise AdapterError(path, f"{key}: adapts a {kind}; run-time adapters adapt linear layers")
    if tensor.dim() != 2:
        raise AdapterError(path, f"{key}: {tensor.dim()} dimensions, not 2")
    in_features, out_features = features
    rank = tensor.shape[0] if suffix == LORA_A else tensor.shape[1]
    expected = (rank, in_features) if suffix == LORA_A else (out_features, rank)
    if tuple(tensor.shape) != expected:
        raise AdapterError(
            path,
            f"{key} has shape {list(tensor.shape)}, the base layer maps {in_features} → "
            f"{out_features} features (adapter for another base?)",
        )
    return int(rank)


def _check_replaced(tensor: torch.Tensor, model: torch.nn.Module, key: str, path: Path) -> None:
    """A weight the adapter carries whole (a head in `modules_to_save`) against the base's."""
    module, _, name = key.rpartition(".")
    owner = _submodule(model, module)
    original = getattr(owner, "original_module", owner)  # peft's wrapper of a saved module
    own = getattr(original, name, None) if original is not None else None
    if not isinstance(own, torch.Tensor):
        raise AdapterError(path, f"tensor {key} matches nothing in the base")
    if own.shape != tensor.shape:
        raise AdapterError(
            path,
            f"{key} has shape {list(tensor.shape)}, the base's {list(own.shape)} "
            "(adapter for another base?)",
        )


def _submodule(model: torch.nn.Module, name: str) -> torch.nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _linear_features(layer: torch.nn.Module) -> tuple[int, int] | None:
    """(in, out) features of a linear layer, a peft wrapper of one, or a GPT-2 Conv1D."""
    if isinstance(layer, torch.nn.Embedding) or isinstance(
        getattr(layer, "base_layer", None), torch.nn.Embedding
    ):
        return None
    in_features = getattr(layer, "in_features", None)
    out_features = getattr(layer, "out_features", None)
    if isinstance(in_features, int) and isinstance(out_features, int):
        return in_features, out_features
    weight = getattr(layer, "weight", None)
    if type(layer).__name__ == "Conv1D" and isinstance(weight, torch.Tensor):
        return int(weight.shape[0]), int(weight.shape[1])  # stored [in, out]
    return None
