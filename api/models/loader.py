"""Loading one declared model: base weights, quantization and LoRA adapters, timed by phase."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from api.models.adapters import AdapterError, attach_adapters
from api.models.checkpoint import CheckpointError, folder_fingerprint, verify_files, weight_files
from api.models.convert.exaone import ExaoneError, convert_exaone, is_exaone
from api.models.convert.exaone_adapter import convert_exaone_adapter
from api.models.quantization import (
    QuantizationRefused,
    bitsandbytes_config,
    check_supported,
    quantize_dynamic_int8,
    torch_dtype,
)
from api.models.spec import AdapterSpec, ModelSpec
from api.settings import Settings

logger = logging.getLogger(__name__)

PHASES = ("resolve", "weights", "quantize", "adapters", "warmup")


class LoadError(Exception):
    """A model that cannot be served; the message names the model, the file and the reason."""

    def __init__(self, model: str, path: Path | str, reason: str) -> None:
        super().__init__(f"model {model!r}: {path}: {reason}")
        self.model = model
        self.path = str(path)
        self.reason = reason


@dataclass
class LoadedModel:
    """A model ready to run, with what the service reports about it."""

    spec: ModelSpec
    model: torch.nn.Module
    tokenizer: Any
    device: torch.device
    folder: Path
    labels: list[str]
    problem_type: str
    architecture: str
    base_fingerprint: str
    adapter_fingerprints: dict[str, str]
    dtype: str
    weight_bytes: int
    revision: str | None
    merged: bool = False
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    @property
    def adapters(self) -> list[str]:
        """Names of the adapters attached, in declaration order."""
        return list(self.adapter_fingerprints)

    @property
    def load_seconds(self) -> float:
        """Total load time, every phase included."""
        return sum(self.phases.values())


@contextmanager
def timed(phases: dict[str, float], phase: str) -> Iterator[None]:
    """Adds the block's wall time to `phases[phase]`."""
    start = time.perf_counter()
    try:
        yield
    finally:
        phases[phase] += time.perf_counter() - start


def pick_device(setting: str) -> torch.device:
    """`auto` is the first GPU when CUDA is present, else the CPU."""
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise LoadError("*", "DEVICE", "DEVICE=cuda but no CUDA device is available")
        return torch.device("cuda", 0)
    return torch.device("cpu")


def max_memory_map(settings: Settings, device: torch.device) -> dict[int | str, str] | None:
    """`MAX_MEMORY_GB` as accelerate's per-device map (each GPU and the CPU)."""
    if settings.max_memory_gb is None:
        return None
    cap = f"{settings.max_memory_gb}GiB"
    gpus: dict[int | str, str] = {}
    if device.type == "cuda":
        gpus = dict.fromkeys(range(torch.cuda.device_count()), cap)
    return {**gpus, "cpu": cap}


def resolve_folder(spec: ModelSpec, settings: Settings) -> tuple[Path, str | None]:
    """The local folder of the base: a path, a GGUF conversion, or the Hugging Face cache."""
    if spec.gguf is not None:
        return converted_folder(spec, settings), spec.gguf.sha256[:12]
    local = Path(spec.base)
    if local.is_absolute():
        if not local.is_dir():
            raise LoadError(spec.name, local, "base folder does not exist")
        return local, spec.revision
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache_dir = str(settings.hf_home / "hub") if settings.hf_home else None
    try:
        folder = snapshot_download(
            spec.base,
            revision=spec.revision,
            cache_dir=cache_dir,
            local_files_only=settings.offline,
        )
    except LocalEntryNotFoundError:
        raise LoadError(
            spec.name,
            spec.base,
            f"not in the Hugging Face cache ({cache_dir or 'default HF_HOME'}) and OFFLINE=true",
        ) from None
    return Path(folder), Path(folder).name


def converted_folder(spec: ModelSpec, settings: Settings) -> Path:
    """The safetensors folder made from the spec's GGUF, converting it on first use."""
    assert spec.gguf is not None
    folder = settings.model_cache_folder / spec.base
    if (folder / "config.json").is_file():
        return folder
    from api.models.convert.gguf import GgufError, convert_gguf

    logger.info("model %s: converting %s into %s (once)", spec.name, spec.gguf.file, folder)
    try:
        return convert_gguf(Path(spec.gguf.file), spec.gguf.sha256, folder)
    except GgufError as exc:
        raise LoadError(spec.name, spec.gguf.file, str(exc)) from None


def exaone_as_llama(
    spec: ModelSpec, folder: Path, files: list[Path], settings: Settings
) -> tuple[Path, list[AdapterSpec]]:
    """An EXAONE base and its adapters in the Llama layout, converted into the model cache
    on first use. An adapter's pinned sha256 is checked against its original file, before
    conversion; the converted copy then loads unpinned."""
    cache = settings.model_cache_folder
    try:
        converted = convert_exaone(folder, files, spec.weights_sha256, cache)
        adapters = [
            adapter.model_copy(
                update={
                    "path": convert_exaone_adapter(adapter.path, adapter.sha256, cache),
                    "sha256": None,
                }
            )
            for adapter in spec.adapters
        ]
    except ExaoneError as exc:
        raise LoadError(spec.name, exc.path, exc.reason) from None
    return converted, adapters


def load_model(spec: ModelSpec, settings: Settings) -> LoadedModel:
    """Loads a declared model, its quantization and adapters; every failure is a LoadError."""
    phases = dict.fromkeys(PHASES, 0.0)
    device = pick_device(settings.device)
    try:
        check_supported(spec, device, len(spec.adapters))
        quant_config = bitsandbytes_config(spec, device)
    except QuantizationRefused as exc:
        raise LoadError(spec.name, "quantization", str(exc)) from None

    with timed(phases, "resolve"):
        folder, revision = resolve_folder(spec, settings)
        try:
            files = weight_files(folder, settings.use_safetensors)
            verify_files(files, spec.weights_sha256)
            pinned, adapters = spec.weights_sha256, spec.adapters
            if is_exaone(folder):  # served as the Llama it is, without its remote code
                folder, adapters = exaone_as_llama(spec, folder, files, settings)
                pinned = {}  # the pins named the EXAONE files, checked just above
            base_fingerprint = folder_fingerprint(folder, pinned)
        except CheckpointError as exc:
            raise LoadError(spec.name, exc.path, exc.reason) from None
        config = _read_config(spec, folder)
        tokenizer = _read_tokenizer(spec, folder)

    dtype = torch_dtype(spec.dtype, device)
    with timed(phases, "weights"):
        model, missing_keys = _load_base(
            spec, settings, folder, config, dtype, quant_config, device
        )
    _fit_pad_token(model, tokenizer)
    architecture = type(model).__name__

    adapter_fingerprints: dict[str, str] = {}
    if spec.adapters:
        with timed(phases, "adapters"):
            try:
                model, adapter_fingerprints = attach_adapters(model, adapters, missing_keys)
            except AdapterError as exc:
                raise LoadError(spec.name, exc.path, exc.reason) from None
    elif missing_keys:
        raise LoadError(
            spec.name,
            folder,
            f"the checkpoint lacks {missing_keys[:3]} and no adapter provides them: its "
            "classification head would be random",
        )

    # One adapter on a full-precision base: fold it into the weights, so serving costs no
    # LoRA matmuls. bitsandbytes bases stay unmerged: merging re-quantizes, and loses.
    merged = len(spec.adapters) == 1 and (
        spec.quantization == "dynamic-int8"
        or (spec.quantization == "none" and settings.merge_single_adapter)
    )
    if merged:
        with timed(phases, "adapters"):
            model = cast(Any, model).merge_and_unload()
    if spec.quantization == "dynamic-int8":
        with timed(phases, "quantize"):
            model = quantize_dynamic_int8(model)
    if settings.torch_compile:
        with timed(phases, "quantize"):
            model.forward = torch.compile(model.forward, dynamic=True)
    model.eval()
    return LoadedModel(
        spec=spec,
        model=model,
        tokenizer=tokenizer,
        device=device,
        folder=folder,
        labels=[config.id2label[index] for index in range(config.num_labels)],
        problem_type=config.problem_type or "single_label_classification",
        architecture=architecture,
        base_fingerprint=base_fingerprint,
        adapter_fingerprints=adapter_fingerprints,
        dtype=str(dtype).removeprefix("torch."),
        weight_bytes=module_bytes(model),
        revision=revision,
        merged=merged,
        phases=phases,
    )


def _read_config(spec: ModelSpec, folder: Path) -> Any:
    try:
        config = AutoConfig.from_pretrained(
            str(folder), trust_remote_code=spec.trust_remote_code, local_files_only=True
        )
    except (OSError, ValueError) as exc:
        raise LoadError(spec.name, folder / "config.json", f"unreadable config: {exc}") from None
    if spec.labels is not None:
        config.num_labels = len(spec.labels)
        config.id2label = dict(enumerate(spec.labels))
        config.label2id = {label: index for index, label in enumerate(spec.labels)}
    return config


def _read_tokenizer(spec: ModelSpec, folder: Path) -> Any:
    try:
        return AutoTokenizer.from_pretrained(
            str(folder), trust_remote_code=spec.trust_remote_code, local_files_only=True
        )
    except (OSError, ValueError) as exc:
        raise LoadError(spec.name, folder, f"unreadable tokenizer: {exc}") from None


def _load_base(
    spec: ModelSpec,
    settings: Settings,
    folder: Path,
    config: Any,
    dtype: torch.dtype,
    quant_config: Any,
    device: torch.device,
) -> tuple[torch.nn.Module, list[str]]:
    memory = max_memory_map(settings, device)
    kwargs: dict[str, Any] = {
        "config": config,
        "dtype": dtype,
        "use_safetensors": settings.use_safetensors,
        # transformers 5 always builds the model empty and ignores this; older releases
        # still use it, and the setting is reported as given.
        "low_cpu_mem_usage": settings.low_cpu_mem_usage,
        "device_map": "auto" if memory and device.type == "cuda" else {"": str(device)},
        "trust_remote_code": spec.trust_remote_code,
        "local_files_only": True,
        "output_loading_info": True,
        "attn_implementation": settings.attn_implementation,
    }
    if memory is not None:
        kwargs["max_memory"] = memory
    if quant_config is not None:
        kwargs["quantization_config"] = quant_config
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(str(folder), **kwargs)
    except Exception as exc:  # transformers raises many types; each becomes one clear error
        raise LoadError(spec.name, folder, f"cannot load weights: {_one_line(exc)}") from None
    if info.get("mismatched_keys"):
        raise LoadError(spec.name, folder, f"weights of the wrong shape: {info['mismatched_keys']}")
    return model, sorted(info.get("missing_keys", []))


def _fit_pad_token(model: torch.nn.Module, tokenizer: Any) -> None:
    """Decoder LLMs ship without a pad token; batching needs one, and the head must know it."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = tokenizer.pad_token_id


def module_bytes(model: torch.nn.Module) -> int:
    """Bytes held by parameters and buffers (quantized weights counted as stored)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(b.numel() * b.element_size() for b in model.buffers())
    for module in model.modules():  # dynamic-int8 keeps packed weights outside parameters
        if isinstance(module, torch.ao.nn.quantized.dynamic.Linear):
            weight, bias = module.weight(), module.bias()
            total += weight.numel() * weight.element_size()
            total += 0 if bias is None else bias.numel() * bias.element_size()
    return total


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:500]
