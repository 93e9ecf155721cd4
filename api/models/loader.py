"""Loading one declared model: base weights, quantization and LoRA adapters, timed by phase."""

from __future__ import annotations

import importlib.metadata
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
)

from api.models.adapters import AdapterDigests, AdapterError, attach_adapters
from api.models.causal_lm import LabelWordsError, Prompt, first_token_ids
from api.models.checkpoint import CheckpointError, folder_fingerprint, verify_files, weight_files
from api.models.convert.exaone import ExaoneError, convert_exaone, is_exaone
from api.models.convert.exaone_adapter import convert_exaone_adapter
from api.models.faults import is_out_of_memory, one_line
from api.models.prequantized import EntryUnreadable, PrequantizedEntry, PrequantizedError
from api.models.quantization import (
    HEAD_MODULES,
    QuantizationRefused,
    bitsandbytes_config,
    check_supported,
    quantize_dynamic_int8,
    torch_dtype,
)
from api.models.spec import AdapterSpec, ModelSpec
from api.settings import Settings

logger = logging.getLogger(__name__)

# transformers builds a model with `torch.nn.init` (and its own `init_weights`) swapped for
# no-ops, and puts the originals back on the way out: global state, not thread-safe. Two
# models built at once (the registry loads them in parallel) can leave the no-ops in place
# for good, and every model or adapter built after that keeps uninitialised memory wherever
# a checkpoint does not fill it (seen here: NaN logits). So one model is built at a time;
# reading files, quantizing and warming up still overlap.
BUILD_LOCK = threading.Lock()

# save_quantized: writing the pre-quantized checkpoint, at the first start only.
PHASES = (
    "resolve",
    "weights",
    "quantize",
    "save_quantized",
    "adapters",
    "warmup",
    "forward_processes",
)
GIB = 1024**3


class LoadError(Exception):
    """A model that cannot be served; the message names the model, the file and the reason."""

    def __init__(self, model: str, path: Path | str, reason: str) -> None:
        super().__init__(f"model {model!r}: {path}: {reason}")
        self.model = model
        self.path = str(path)
        self.reason = reason


class UnreadableCheckpoint(LoadError):
    """A config or weights that transformers cannot read: the files' fault, not a memory or
    placement limit's."""


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
    adapter_digests: dict[str, AdapterDigests]
    dtype: str
    weight_bytes: int
    revision: str | None
    merged: bool = False
    # Weights the base checkpoint lacks (a head it never had): an adapter must carry them.
    missing_base_keys: list[str] = field(default_factory=list)
    # task causal-lm: the prompt each text is put in, and each label's word's first token.
    prompt: Prompt | None = None
    label_token_ids: list[int] | None = None
    # Every loading choice that changes the numbers a text gets (part of its answer identity).
    numerics: dict[str, object] = field(default_factory=dict)
    # Bytes of weights by device (a GPU's index, "cpu"), and the max_memory its load was given.
    device_bytes: dict[int | str, int] = field(default_factory=dict)
    max_memory: dict[int | str, int] | None = None
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    # The pre-quantized checkpoint (bitsandbytes only, else None): "hit" (loaded from it),
    # "written" (quantized at start and saved), "rebuilt" (an unusable entry set aside and
    # replaced), "unwritten" (quantized at start, the save failed), "unreadable" (the entry
    # could not be read now: quantized at start, the entry left as it is), "off"
    # (PREQUANTIZED_CACHE=false).
    prequantized: str | None = None

    @property
    def adapters(self) -> list[str]:
        """Names of the adapters attached, in declaration order."""
        return list(self.adapter_digests)

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


def max_memory_map(
    budget_gb: float | None, gpus: int, held: Mapping[int | str, int] | None = None
) -> dict[int | str, int] | None:
    """`MAX_MEMORY_GB` as accelerate's `max_memory`, in bytes: one budget per device shared by
    every model, so on each of `gpus` GPUs and on the CPU what it leaves after the bytes the
    models loaded before hold there (`held`, keyed as accelerate keys devices: a GPU's index,
    "cpu"); None without a budget."""
    if budget_gb is None:
        return None
    budget, held = int(budget_gb * GIB), held or {}
    devices: list[int | str] = [*range(gpus), "cpu"]
    return {device: max(0, budget - held.get(device, 0)) for device in devices}


def placement(model: torch.nn.Module) -> dict[str, object]:
    """Where `model`'s weights are, as `check_placement` reads it: accelerate's
    `hf_device_map` where it dispatched the model across devices, else each weight's own
    device, as one entry ("") when they all share one. transformers 5 sets no `hf_device_map`
    when `device_map="auto"` puts the whole model on one device, the CPU included: seen on an
    H200, where a spent MAX_MEMORY_GB loaded a model wholly on the CPU and nothing refused it."""
    mapped = getattr(model, "hf_device_map", None)
    if mapped:
        return dict(mapped)
    where = {name: str(weight.device) for name, weight in model.named_parameters()}
    devices = set(where.values())
    return {"": devices.pop()} if len(devices) == 1 else dict(where)


def check_placement(
    model: str, device_map: Mapping[str, object], max_memory: Mapping[int | str, int] | None
) -> None:
    """Refuses a model declared for the GPU that accelerate placed, wholly or in part, on the
    CPU or the disk (`hf_device_map`): it would serve, silently, many times slower."""
    off = [(module, str(where)) for module, where in device_map.items() if _off_gpu(where)]
    if not off:
        return
    named = ", ".join(f"{module or '(all)'} on {where}" for module, where in off[:5])
    more = f" and {len(off) - 5} more" if len(off) > 5 else ""
    left = ", ".join(
        f"GPU {device}: {available / GIB:.2f} GiB"
        for device, available in (max_memory or {}).items()
        if isinstance(device, int)
    )
    raise LoadError(
        model,
        "MAX_MEMORY_GB",
        f"{len(off)} of its {len(device_map)} modules would run off the GPU ({named}{more}); "
        f"the budget left it {left or 'no GPU'} after the models loaded before it: "
        "raise MAX_MEMORY_GB or load a smaller (quantized) model",
    )


def _off_gpu(where: object) -> bool:
    """accelerate places a module by GPU index, "cpu" or "disk" (or a device)."""
    if isinstance(where, int):
        return False
    name = str(where)
    return name in ("cpu", "disk", "meta") or name.startswith("cpu:")


def resolve_folder(spec: ModelSpec, settings: Settings) -> tuple[Path, str | None]:
    """The local folder of the base: a path, a GGUF conversion, or the Hugging Face cache."""
    assert spec.base is not None  # a simulated model resolves no folder
    if spec.gguf is not None:
        return converted_folder(spec, settings), spec.gguf.sha256[:12]
    local = Path(spec.base)
    if local.is_absolute():
        if not local.is_dir():
            raise LoadError(spec.name, local, "base folder does not exist")
        return local, spec.revision
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache_dir = str(settings.hub_cache) if settings.hub_cache else None
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
    """The safetensors folder made from the spec's GGUF (found by its pinned sha256),
    converting it on first use."""
    assert spec.gguf is not None
    from api.models.convert.gguf import GgufError, converted_gguf

    try:
        return converted_gguf(Path(spec.gguf.file), spec.gguf.sha256, settings.model_cache_folder)
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


def load_model(
    spec: ModelSpec, settings: Settings, held: Mapping[int | str, int] | None = None
) -> LoadedModel:
    """Loads a declared model, its quantization and adapters; every failure is a LoadError.

    `held`: bytes the models loaded before it hold by device, taken from `MAX_MEMORY_GB`.
    """
    phases = dict.fromkeys(PHASES, 0.0)
    device = pick_device(settings.device)
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    max_memory = max_memory_map(settings.max_memory_gb, gpus, held)
    try:
        check_supported(spec, device, len(spec.adapters))
        quant_config = bitsandbytes_config(spec, device)
    except QuantizationRefused as exc:
        raise LoadError(spec.name, "quantization", str(exc)) from None

    dtype = torch_dtype(spec.dtype, device)
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
        tokenizer = read_tokenizer(spec, folder)
        entry, recorded, prequantized = _find_prequantized(
            spec, settings, base_fingerprint, quant_config, dtype, device
        )

    model = None
    if entry is not None and recorded is not None:
        with BUILD_LOCK, timed(phases, "weights"):
            model = _load_prequantized(entry, spec, settings, folder, dtype, device, max_memory)
        missing_keys, prequantized = recorded, "hit" if model is not None else "rebuilt"
    if model is None:
        with BUILD_LOCK, timed(phases, "weights"):
            model, missing_keys = _load_base(
                spec, settings, folder, config, dtype, quant_config, device, max_memory
            )
        if entry is not None:  # quantized now, never run: saved for the next start
            with timed(phases, "save_quantized"):
                if not _save_prequantized(entry, spec, model, missing_keys, folder):
                    prequantized = "unwritten"
    _fit_pad_token(model, tokenizer)
    architecture = type(model).__name__
    prompt, label_token_ids = None, None
    if spec.task == "causal-lm":
        assert spec.label_words is not None
        try:
            prompt = Prompt.of(spec, tokenizer)
            label_token_ids = first_token_ids(tokenizer, spec.label_words)
        except LabelWordsError as exc:
            raise LoadError(spec.name, "label_words", str(exc)) from None
        # Padded on the left, every prompt ends at the last position: the one scored.
        tokenizer.padding_side = "left"

    adapter_digests: dict[str, AdapterDigests] = {}
    if spec.adapters:
        with BUILD_LOCK, timed(phases, "adapters"):
            try:
                model, adapter_digests = attach_adapters(model, adapters, missing_keys)
            except AdapterError as exc:
                raise LoadError(spec.name, exc.path, exc.reason) from None
    elif missing_keys:
        raise LoadError(
            spec.name,
            folder,
            f"the checkpoint lacks {missing_keys[:3]} and no adapter provides them: its "
            "classification head would be random",
        )

    # One adapter on a float32 base: fold it into the weights, so serving costs no LoRA
    # matmuls. bitsandbytes bases stay unmerged (merging re-quantizes, and loses), and so do
    # bf16/fp16 ones: their 8 or 11 bits of mantissa round away much of a small LoRA delta.
    # So does a model taking run-time adapters: they attach beside its own adapter, to the
    # base weights; merged, the base would carry its adapter into every other one's answers.
    merged = (
        len(spec.adapters) == 1
        and not spec.runtime_adapters
        and dtype == torch.float32
        and (
            spec.quantization == "dynamic-int8"
            or (spec.quantization == "none" and settings.merge_single_adapter)
        )
    )
    if merged:
        with timed(phases, "adapters"):
            model = cast(Any, model).merge_and_unload()
    if spec.quantization == "dynamic-int8":
        with timed(phases, "quantize"):
            model = quantize_dynamic_int8(model)
    if dtype != torch.float32 or quant_config is not None:
        head_in_float32(model)
    if settings.torch_compile:
        with timed(phases, "quantize"):
            model.forward = torch.compile(model.forward, dynamic=True)
    model.eval()
    if spec.label_words is not None:
        labels = list(spec.label_words)
    else:
        labels = [config.id2label[index] for index in range(config.num_labels)]
    problem_type = config.problem_type or "single_label_classification"
    if spec.decision_threshold is not None and (
        len(labels) != 2 or problem_type != "single_label_classification"
    ):
        raise LoadError(
            spec.name,
            folder,
            f"decision_threshold needs a two-label softmax classifier, not {len(labels)} "
            f"labels ({problem_type})",
        )
    numerics: dict[str, object] = {
        "quantization": spec.quantization,
        "dtype": str(dtype),
        "compute_dtype": str(getattr(quant_config, "bnb_4bit_compute_dtype", None)),
        "merged": merged,
        "attn_implementation": settings.attn_implementation,
        "torch_compile": settings.torch_compile,
        "device_type": device.type,
        "max_length": spec.max_length,
        "labels": labels,
        "problem_type": problem_type,
        "task": spec.task,
        "prompt": spec.prompt,
        "chat_template": spec.chat_template,
        "label_words": spec.label_words,
        "label_token_ids": label_token_ids,
        "decision_threshold": spec.decision_threshold,
    }
    return LoadedModel(
        spec=spec,
        model=model,
        tokenizer=tokenizer,
        device=device,
        folder=folder,
        labels=labels,
        problem_type=problem_type,
        architecture=architecture,
        base_fingerprint=base_fingerprint,
        adapter_digests=adapter_digests,
        dtype=str(dtype).removeprefix("torch."),
        weight_bytes=module_bytes(model),
        device_bytes=device_bytes(model),
        max_memory=max_memory,
        revision=revision,
        merged=merged,
        missing_base_keys=missing_keys,
        prompt=prompt,
        label_token_ids=label_token_ids,
        numerics=numerics,
        phases=phases,
        prequantized=prequantized,
    )


def _find_prequantized(
    spec: ModelSpec,
    settings: Settings,
    base_fingerprint: str,
    quant_config: Any,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[PrequantizedEntry | None, list[str] | None, str | None]:
    """For a bitsandbytes model with PREQUANTIZED_CACHE on: its pre-quantized entry, the
    base's recorded missing keys when the entry is complete and its files are the bytes
    written (else None), and what the load is now: "hit", "written" (no entry yet),
    "rebuilt" (the entry there was unusable, and is set aside) or "unreadable" (it cannot be
    read now: no entry to load or write, the shared one left alone). Else no entry, and the
    state "off", or None for a model that bitsandbytes does not quantize."""
    if quant_config is None:
        return None, None, None
    if not settings.prequantized_cache:
        return None, None, "off"
    cache = settings.model_cache_folder
    entry = PrequantizedEntry.of(cache, spec, base_fingerprint, quant_config, dtype, device)
    try:
        recorded = entry.read_manifest()
    except EntryUnreadable as exc:
        logger.warning(
            "model %s: pre-quantized checkpoint unreadable now, left in place; quantizing at "
            "start: %s",
            spec.name,
            exc,
        )
        return None, None, "unreadable"
    except PrequantizedError as exc:
        _set_aside(entry, spec, exc)
        return entry, None, "rebuilt"
    return entry, recorded, "written" if recorded is None else "hit"


def _set_aside(entry: PrequantizedEntry, spec: ModelSpec, reason: Exception) -> None:
    aside = entry.set_aside()
    logger.warning(
        "model %s: pre-quantized checkpoint unusable, rebuilt; the old one is kept as %s: %s",
        spec.name,
        aside or "(gone, or not movable)",
        reason,
    )


def _load_prequantized(
    entry: PrequantizedEntry,
    spec: ModelSpec,
    settings: Settings,
    source: Path,
    dtype: torch.dtype,
    device: torch.device,
    memory: dict[int | str, int] | None,
) -> torch.nn.Module | None:
    """The model from its pre-quantized checkpoint; None if transformers cannot read it (the
    entry is then set aside, to be written again)."""
    try:
        # Its config.json carries the quantization_config: transformers reads the quantized
        # tensors as they are, and quantizes nothing.
        config = _read_config(spec, entry.folder)
        model, lacking = _load_base(
            spec, settings, entry.folder, config, dtype, None, device, memory
        )
        if lacking:  # it was saved whole, the head included
            raise UnreadableCheckpoint(spec.name, entry.folder, f"tensors missing: {lacking[:3]}")
    except UnreadableCheckpoint as exc:  # its bytes are those written: their format is wrong
        _set_aside(entry, spec, exc)
        return None
    logger.info("model %s: loaded pre-quantized from %s", spec.name, entry.folder)
    # It is the source's model, quantized: named by the source, as adapters know their base.
    named: Any = model
    named.config._name_or_path = named.name_or_path = str(source)
    return model


def _save_prequantized(
    entry: PrequantizedEntry,
    spec: ModelSpec,
    model: torch.nn.Module,
    missing_keys: list[str],
    source: Path,
) -> bool:
    """Writes the entry; a failure (a full or read-only disk) is logged, and the model is
    served as quantized now. True once written."""
    try:
        entry.write(model, missing_keys, source)
    except PrequantizedError as exc:
        logger.warning("model %s: pre-quantized checkpoint not saved: %s", spec.name, exc)
        return False
    logger.info("model %s: saved pre-quantized into %s (once)", spec.name, entry.folder)
    return True


def _read_config(spec: ModelSpec, folder: Path) -> Any:
    try:
        config = AutoConfig.from_pretrained(
            str(folder), trust_remote_code=spec.trust_remote_code, local_files_only=True
        )
    except (OSError, ValueError) as exc:
        path = folder / "config.json"
        raise UnreadableCheckpoint(spec.name, path, f"unreadable config: {exc}") from None
    # A classifier reads one forward's logits: a KV cache would hold every layer's keys and
    # values for nothing (~1.2 GB at EXAONE-2.4B's warm-up shape).
    config.use_cache = False
    if spec.labels is not None and spec.task == "text-classification":
        config.num_labels = len(spec.labels)
        config.id2label = dict(enumerate(spec.labels))
        config.label2id = {label: index for index, label in enumerate(spec.labels)}
    return config


def read_tokenizer(spec: ModelSpec, folder: Path) -> Any:
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
    memory: dict[int | str, int] | None,
) -> tuple[torch.nn.Module, list[str]]:
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
    auto: Any = (
        AutoModelForCausalLM if spec.task == "causal-lm" else AutoModelForSequenceClassification
    )
    try:
        model, info = auto.from_pretrained(str(folder), **kwargs)
    except Exception as exc:  # transformers raises many types; each becomes one clear error
        error = LoadError if is_out_of_memory(exc) else UnreadableCheckpoint
        raise error(spec.name, folder, f"cannot load weights: {one_line(exc)}") from None
    if info.get("mismatched_keys"):
        reason = f"weights of the wrong shape: {info['mismatched_keys']}"
        raise UnreadableCheckpoint(spec.name, folder, reason)
    if device.type == "cuda":
        check_placement(spec.name, placement(model), memory)
    if memory is not None and device.type == "cuda":  # on the CPU device_map is explicit
        logger.info(
            "model %s: MAX_MEMORY_GB left it %s",
            spec.name,
            ", ".join(f"{where}: {left / GIB:.2f} GiB" for where, left in memory.items()),
        )
    return model, sorted(info.get("missing_keys", []))


def head_in_float32(model: torch.nn.Module) -> None:
    """The classification head (and each adapter's saved copy of it) in float32, fed float32.

    In bf16 a probability keeps about 3 significant digits, against a cascade threshold of 6;
    the head is a few thousand weights, so full precision costs nothing that shows.
    """
    heads = [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in HEAD_MODULES]
    for head in heads:
        head.float()
        head.register_forward_pre_hook(_inputs_in_float32)


def _inputs_in_float32(_module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(
        a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args
    )


def _fit_pad_token(model: torch.nn.Module, tokenizer: Any) -> None:
    """Decoder LLMs ship without a pad token; batching needs one, and the head must know it."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = tokenizer.pad_token_id


def module_bytes(model: torch.nn.Module) -> int:
    """Bytes held by parameters and buffers (quantized weights counted as stored)."""
    return sum(size for _, size in _stored(model))


def device_bytes(model: torch.nn.Module) -> dict[int | str, int]:
    """`module_bytes` by device, keyed as accelerate's max_memory (a GPU's index, "cpu");
    weights offloaded to the disk (on the meta device) hold no memory."""
    held: dict[int | str, int] = {}
    for device, size in _stored(model):
        if device.type in ("cuda", "cpu"):
            key: int | str = (device.index or 0) if device.type == "cuda" else "cpu"
            held[key] = held.get(key, 0) + size
    return held


def _stored(model: torch.nn.Module) -> Iterator[tuple[torch.device, int]]:
    """Each stored tensor's device and bytes: parameters, buffers, and the packed weights
    that dynamic int8 keeps outside parameters."""
    for tensor in (*model.parameters(), *model.buffers()):
        yield tensor.device, tensor.numel() * tensor.element_size()
    for module in model.modules():
        if isinstance(module, torch.ao.nn.quantized.dynamic.Linear):
            for packed in (module.weight(), module.bias()):
                if packed is not None:
                    yield packed.device, packed.numel() * packed.element_size()


def low_cpu_mem_usage_effect() -> str:
    """What LOW_CPU_MEM_USAGE does with the installed transformers."""
    version = importlib.metadata.version("transformers")
    if int(version.split(".")[0]) >= 5:
        return (
            f"none: transformers {version} always builds a model empty and fills it from "
            "the checkpoint, so loading never holds two copies; the setting is passed on "
            "and ignored"
        )
    return f"passed to from_pretrained (transformers {version})"
