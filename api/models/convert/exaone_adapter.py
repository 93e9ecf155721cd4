"""LoRA adapters trained on EXAONE's module names, renamed once for its Llama conversion.

A LoRA adapter names the modules it changes twice: in `adapter_config.json`
(`target_modules`, `modules_to_save`, `layers_pattern`, ...) and in its tensors' keys
(`base_model.model.transformer.h.0.attn.attention.q_proj.lora_A.weight`). Both are renamed
the way `api.models.convert.exaone` renames the base; the tensors themselves are copied
bit for bit, so the adapter computes what it did. A sequence classifier's head (`score`,
saved by peft as `...score.weight`) keeps its name, which Llama shares.

The converted adapter lives under MODEL_CACHE_DIR/exaone-llama/adapters/<digest>, the
digest taken over the original files' sha256 digests. A sha256 pinned in the models file
means the original weights file: it is checked here, before anything is converted.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from api.models.checkpoint import CheckpointError, read_safetensors_header, sha256_of
from api.models.convert.exaone import (
    BLOCK_MODULES,
    CACHE_FOLDER,
    CONVERSION_VERSION,
    MANIFEST,
    MODULE_NAMES,
    ExaoneError,
    llama_key,
    llama_module,
    read_json_object,
    write_json,
)
from api.models.convert.staging import staged_folder

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTERS_FOLDER = "adapters"
PEFT_PREFIX = "base_model.model."
# peft puts "classifier" beside "score" in a sequence classifier's modules_to_save; it names
# no module in either layout, so it stays as it is.
_NAMES_IN_NEITHER = frozenset({"classifier"})
_LAYERS_PATTERNS = {"h": "layers"}
# Fields naming modules by list (or, for the first, the special value "all-linear").
_MODULE_LISTS = ("target_modules", "modules_to_save", "exclude_modules")
# Fields keyed by module name.
_MODULE_KEYED = ("rank_pattern", "alpha_pattern", "trainable_token_indices")


def convert_exaone_adapter(folder: Path, pinned_sha256: str | None, cache_root: Path) -> Path:
    """The Llama-named copy of the EXAONE adapter in `folder`, converting it on first use.

    Returns MODEL_CACHE_DIR/exaone-llama/adapters/<digest>; raises ExaoneError naming the
    file and the reason (a pin the original does not match included).
    """
    config_path, weights_path = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    if not config_path.is_file():
        raise ExaoneError(config_path, "missing: not an adapter folder")
    if not weights_path.is_file():
        raise ExaoneError(weights_path, "missing: EXAONE adapters are converted from safetensors")
    try:
        read_safetensors_header(weights_path)
    except CheckpointError as exc:
        raise ExaoneError(exc.path, exc.reason) from None
    weights_sha256 = sha256_of(weights_path)
    if pinned_sha256 is not None and weights_sha256 != pinned_sha256:
        raise ExaoneError(
            weights_path, f"sha256 {weights_sha256} does not match pinned {pinned_sha256}"
        )
    config = read_json_object(config_path, "bad adapter config")
    renamed_config = llama_adapter_config(config, config_path)

    sources = {ADAPTER_CONFIG: sha256_of(config_path), ADAPTER_WEIGHTS: weights_sha256}
    text = json.dumps({"version": CONVERSION_VERSION, "files": sources}, sort_keys=True)
    out = cache_root / CACHE_FOLDER / ADAPTERS_FOLDER / hashlib.sha256(text.encode()).hexdigest()
    if (out / MANIFEST).is_file():
        return out
    tensors = llama_adapter_tensors(load_file(str(weights_path)), weights_path)
    logger.info("converting EXAONE adapter %s into the Llama layout at %s (once)", folder, out)
    try:
        with staged_folder(out, MANIFEST) as staging:
            save_file(tensors, str(staging / ADAPTER_WEIGHTS), metadata={"format": "pt"})
            write_json(staging / ADAPTER_CONFIG, renamed_config)
            manifest = {
                "converted_by": "loraserve api.models.convert.exaone_adapter",
                "version": CONVERSION_VERSION,
                "source": str(folder),
                "source_sha256": sources,
            }
            write_json(staging / MANIFEST, manifest)  # last: marks a finished folder
    except OSError as exc:
        raise ExaoneError(out, f"cannot write the converted adapter: {exc}") from None
    return out


def llama_adapter_tensors(tensors: dict[str, Any], path: Path) -> dict[str, Any]:
    """The adapter's tensors under Llama's names; refuses a key under no known module."""
    renamed = {}
    for key, tensor in tensors.items():
        llama = llama_key(key.removeprefix(PEFT_PREFIX)) if key.startswith(PEFT_PREFIX) else None
        if llama is None:
            raise ExaoneError(
                path, f"tensor {key!r} is under no EXAONE module the conversion knows"
            )
        renamed[PEFT_PREFIX + llama] = tensor
    return renamed


def llama_adapter_config(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """`adapter_config.json` with every module name in it renamed to Llama's."""
    renamed = dict(config)
    for field in _MODULE_LISTS:
        value = config.get(field)
        if value is None or (field == "target_modules" and value == "all-linear"):
            continue
        if isinstance(value, str):
            # peft reads a string as a regular expression over module paths: renaming its
            # parts could change what it matches, so it is not attempted.
            raise ExaoneError(path, f"{field} is a regular expression ({value!r}): list names")
        renamed[field] = [_module_name(name, field, path) for name in value]
    for field in _MODULE_KEYED:
        value = config.get(field)
        if isinstance(value, dict):
            renamed[field] = {_module_name(name, field, path): v for name, v in value.items()}
    pattern = config.get("layers_pattern")
    if pattern is not None:
        patterns = [pattern] if isinstance(pattern, str) else list(pattern)
        unknown = [name for name in patterns if name not in _LAYERS_PATTERNS]
        if unknown:
            raise ExaoneError(path, f"layers_pattern {unknown} is not EXAONE's block list 'h'")
        mapped = [_LAYERS_PATTERNS[name] for name in patterns]
        renamed["layers_pattern"] = mapped[0] if isinstance(pattern, str) else mapped
    # layers_to_transform holds block indexes, the same in both layouts.
    if config.get("target_parameters"):
        raise ExaoneError(path, "target_parameters is not converted")
    return renamed


def _module_name(name: str, field: str, path: Path) -> str:
    """A module name as peft matches it (last component, block-relative or full path)."""
    llama = MODULE_NAMES.get(name) or BLOCK_MODULES.get(name) or llama_module(name)
    if llama is not None:
        return llama
    if name in _NAMES_IN_NEITHER:
        return name
    raise ExaoneError(path, f"{field}: {name!r} is not an EXAONE module the conversion knows")
