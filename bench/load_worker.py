"""One cold load in a fresh process, measured: the worker side of `python -m bench.load_time`.

Each worker imports torch and transformers (timed), resolves the model class (timed: its
module is imported lazily), loads one way, then reads one value from every page of every
weight (the files are mapped lazily, so an untouched "load" reads nothing), recording the
process's memory as Linux reports it before, after and at its peak.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = REPO_ROOT / "bench" / "out" / "load_time"
TORCH_THREADS = 2
MODEL_WAYS = ("safetensors", "safetensors-lowmem-off", "pickle")
PAGE = 4096


@dataclass
class WorkerResult:
    """What one cold worker process measured. Memory in KiB, as Linux reports it."""

    way: str
    import_torch_s: float
    import_transformers_s: float
    import_model_s: float
    load_s: float
    touch_s: float
    rss_before_kib: int
    rss_after_load_kib: int
    peak_rss_kib: int
    vm_hwm_kib: int
    anon_before_kib: int
    anon_after_kib: int
    file_before_kib: int
    file_after_kib: int
    bytes_touched: int
    phases: dict[str, float] = field(default_factory=dict)
    # The service's loads: the pre-quantized checkpoint's state, and the bytes of the weight
    # files it read (the source's, or the pre-quantized checkpoint's).
    prequantized: str | None = None
    file_bytes: int = 0


# --- the worker: one cold load in a fresh process ------------------------------------------


def proc_status_kib() -> dict[str, int]:
    """This process's memory figures from /proc/self/status (VmRSS, VmHWM, RssAnon, RssFile)."""
    wanted = {"VmRSS", "VmHWM", "RssAnon", "RssFile"}
    figures: dict[str, int] = {}
    for line in Path("/proc/self/status").read_text(encoding="ascii").splitlines():
        name, _, value = line.partition(":")
        if name in wanted:
            figures[name] = int(value.split()[0])
    return figures


def peak_rss_kib() -> int:
    """ru_maxrss of this process, KiB on Linux.

    Linux carries the parent's RSS at fork into the child's ru_maxrss; the parent here is kept
    small (checkpoints are built in a process of their own), so it is the worker's own peak.
    VmHWM is recorded beside it as the cross-check.
    """
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def import_libraries() -> dict[str, float]:
    """Imports torch and transformers (with its Auto class), each timed."""
    times: dict[str, float] = {}
    start = time.perf_counter()
    import torch

    torch.set_num_threads(TORCH_THREADS)
    times["import_torch_s"] = time.perf_counter() - start
    start = time.perf_counter()
    from transformers import AutoModelForSequenceClassification  # noqa: F401
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # load reports name the random classifier head; noise here
    hf_logging.disable_progress_bar()
    times["import_transformers_s"] = time.perf_counter() - start
    return times


def import_model_class(folder: Path) -> Any:
    """Resolves the checkpoint's classifier class, which imports its modelling module.

    transformers imports a model's module lazily on first use (over a second for Llama), so
    it is done before the load, to count as import rather than as loading.
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(folder)
    return AutoModelForSequenceClassification._model_mapping[type(config)]


def load_model_way(way: str, folder: Path, dtype: str) -> list[Any]:
    """from_pretrained as the way says; returns the model's parameters."""
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(
        folder,
        use_safetensors=way != "pickle",
        # transformers 5 pops this argument and drops it: it always builds the model empty
        # and fills it. Passed anyway, so the two rows show what the flag does today.
        low_cpu_mem_usage=way != "safetensors-lowmem-off",
        dtype=getattr(torch, dtype),
    )
    return list(model.parameters())


def read_safetensors(folder: Path) -> list[Any]:
    """Every tensor of every shard, through safetensors alone."""
    from safetensors.torch import load_file

    tensors: list[Any] = []
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.extend(load_file(shard).values())
    return tensors


def read_bytes(folder: Path) -> bytearray:
    """The shards' bytes copied into one buffer with readinto: no mapping, no parsing."""
    shards = sorted(folder.glob("*.safetensors"))
    buffer = bytearray(sum(shard.stat().st_size for shard in shards))
    view, offset = memoryview(buffer), 0
    for shard in shards:
        with shard.open("rb", buffering=0) as handle:
            # One read(2) returns at most ~2 GiB on Linux, hence the loop.
            while count := handle.readinto(view[offset:]):
                offset += count
    return buffer


def allocate(folder: Path) -> bytearray:
    """A zeroed buffer as large as the shards; bytearray writes every page, so all resident."""
    return bytearray(sum(shard.stat().st_size for shard in sorted(folder.glob("*.safetensors"))))


def touch_pages(tensors: Iterable[Any]) -> int:
    """Reads one value from every 4 KiB page of each tensor; returns the tensors' bytes.

    safetensors and torch.load map files lazily: a "loaded" model has read almost nothing,
    and the first forward pays for the bytes instead. Touching every page puts that cost in
    the measurement, for every way alike.
    """
    import torch

    total = 0
    for tensor in tensors:
        flat = tensor.detach().reshape(-1)
        torch.sum(flat[:: max(1, PAGE // flat.element_size())].float())
        total += flat.numel() * flat.element_size()
    return total


def touch_buffer(buffer: bytearray) -> int:
    """The raw buffer is already resident (readinto wrote every page); its size."""
    return len(buffer)


def worker(way: str, folder: Path, dtype: str) -> WorkerResult:
    """One cold load: imports, then the load, then the first touch of every weight page."""
    times = import_libraries()
    start = time.perf_counter()
    import_model_class(folder)
    times["import_model_s"] = time.perf_counter() - start
    before = proc_status_kib()
    start = time.perf_counter()
    loaded: Any
    if way in MODEL_WAYS:
        loaded = load_model_way(way, folder, dtype)
    elif way == "read-safetensors":
        loaded = read_safetensors(folder)
    elif way == "read-bytes":
        loaded = read_bytes(folder)
    else:
        loaded = allocate(folder)
    loaded_at = time.perf_counter()
    after_load = proc_status_kib()
    touched = touch_buffer(loaded) if isinstance(loaded, bytearray) else touch_pages(loaded)
    done = time.perf_counter()
    return finish(way, times, before, after_load, loaded_at - start, done - loaded_at, touched)


def finish(
    way: str,
    times: dict[str, float],
    before: dict[str, int],
    after_load: dict[str, int],
    load_s: float,
    touch_s: float,
    touched: int,
) -> WorkerResult:
    """The worker's result, with the memory figures read now, at the end."""
    end = proc_status_kib()
    return WorkerResult(
        way=way,
        load_s=load_s,
        touch_s=touch_s,
        rss_before_kib=before["VmRSS"],
        rss_after_load_kib=after_load["VmRSS"],
        peak_rss_kib=peak_rss_kib(),
        vm_hwm_kib=end["VmHWM"],
        anon_before_kib=before["RssAnon"],
        anon_after_kib=end["RssAnon"],
        file_before_kib=before["RssFile"],
        file_after_kib=end["RssFile"],
        bytes_touched=touched,
        import_torch_s=times["import_torch_s"],
        import_transformers_s=times["import_transformers_s"],
        import_model_s=times["import_model_s"],
    )


def service_worker(way: str, target: str) -> WorkerResult:
    """The service's own loader (`load_model`) on a target of bench.load_targets, by phase."""
    times = import_libraries()
    start = time.perf_counter()
    from api.models.loader import load_model, resolve_folder
    from bench.load_targets import entry_folder, service_target

    spec, settings = service_target(target, way)
    import_model_class(resolve_folder(spec, settings)[0])
    times["import_model_s"] = time.perf_counter() - start  # with the project's modules, peft
    before = proc_status_kib()
    start = time.perf_counter()
    loaded = load_model(spec, settings)
    loaded_at = time.perf_counter()
    after_load = proc_status_kib()
    touched = touch_pages([*loaded.model.parameters(), *loaded.model.buffers()])
    result = finish(
        way, times, before, after_load, loaded_at - start, time.perf_counter() - loaded_at, touched
    )
    result.phases = dict(loaded.phases)
    result.prequantized = loaded.prequantized
    read = entry_folder(target) if loaded.prequantized == "hit" else loaded.folder
    result.file_bytes = sum(path.stat().st_size for path in read.glob("*.safetensors"))
    return result
